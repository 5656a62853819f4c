"""``import genengine``, listing backends and ``--help`` must load no heavy package (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "sglang", "vllm")

CASES = {
    "import": "import genengine",
    "list": "import genengine; genengine.available_backends()",
    "plugins": "import genengine_sglang.plugin, genengine_vllm.plugin, genengine.backends.transformers_plugin",
    "help": "from genengine.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
    "backends-cli": "from genengine.cli import main; main(['backends'])",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_heavy_imports(case: str) -> None:
    code = CASES[case] + f"\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_every_subcommand_help_is_light() -> None:
    from genengine.cli import build_parser

    commands = list(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert "backends" in commands
    for command in commands:
        code = (
            f"from genengine.cli import main\ntry:\n    main([{command!r}, '--help'])\nexcept SystemExit:\n    pass\n"
            f"import sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.strip().splitlines()[-1] == "[]", command
