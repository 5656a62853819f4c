"""tools/gpu/prepare.sh takes the engine version: every supported release has its pins, which agree with the
exact pins of that release's wheel (recorded in its surface, ``requires_exact``); others are refused."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREPARE = ROOT / "tools" / "gpu" / "prepare.sh"
PLUGINS = {"vllm": "genengine_vllm", "sglang": "genengine_sglang"}
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _pins(engine: str, *version: str) -> dict[str, str]:
    out = subprocess.run(
        ["bash", str(PREPARE), engine, "/nonexistent", *version],
        env={"PINS_ONLY": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    return {re.sub(r"[-_.]+", "-", p.split("==")[0]).lower(): p.split("==")[1] for p in out}


@pytest.mark.parametrize("engine", sorted(PLUGINS))
def test_each_supported_release_has_pins_matching_its_wheel(engine: str) -> None:
    compat = importlib.import_module(f"{PLUGINS[engine]}.compat")
    for version in compat.SUPPORTED:
        pins = _pins(engine, version)
        assert pins[engine] == version
        surface = json.loads((ROOT / PLUGINS[engine] / "surfaces" / f"{version}.json").read_text())
        exact = surface["requires_exact"]
        assert exact["torch"] == "2.11.0", f"{engine} {version} is not on the torch 2.11 line"
        wrong = {name: (pins[name], exact[name]) for name in pins if name in exact and pins[name] != exact[name]}
        assert not wrong, f"{engine} {version}: kit pin != the release's own pin: {wrong}"
    # no version: the newest verified release
    assert _pins(engine)[engine] == compat.VERIFIED.maximum


def test_an_unknown_release_is_refused_naming_the_known_ones() -> None:
    done = subprocess.run(
        ["bash", str(PREPARE), "vllm", "/nonexistent", "0.23.0"],
        env={"PINS_ONLY": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode != 0
    assert "no pins for vllm 0.23.0 (known: 0.24.0 0.25.0 0.25.1 0.26.0)" in done.stderr
