"""docs/plugins.md's minimal complete plugin is what it says: its files, written out as the page gives them and
registered through the entry point its pyproject declares, pass the conformance suite.

The plugin is made visible to ``importlib.metadata`` as pip would make an installed one (a ``.dist-info`` with
the pyproject's entry points, on the path): pip itself would only add minutes of wheel building. The suite runs
in its own pytest process, as the plugin's author runs it, outside this checkout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "plugins.md"


_CHECKS = (
    "test_is_a_generation_engine",
    "test_output_fields",
    "test_greedy_matches_hf_generate",
    "test_sampled_logprobs_are_processed",
    "test_mixed_greedy_and_sampled_batch_keeps_each_rows_logprobs",
    "test_top_k_1_and_tiny_top_p_sample_greedily",
    "test_stop_strings",
    "test_sleep_level_1_cycle",
    "test_level_2_needs_weights_before_generate",
    "test_staged_wake_after_level_2",
    "test_load_weights_equals_a_fresh_engine",
    "test_failure_inside_a_bucket_refuses_until_a_full_load",
    "test_context_manager_and_shutdown",
)


def _files() -> dict[str, str]:
    """The page's code blocks that name a file (```lang title="path"), by path."""
    blocks = re.findall(r'^```\w+ title="([^"]+)"\n(.*?)^```', PAGE.read_text(), re.MULTILINE | re.DOTALL)
    return dict(blocks)


def test_the_minimal_plugin_passes_the_conformance_suite(tmp_path: Path) -> None:
    files = _files()
    assert set(files) == {
        "pyproject.toml",
        "src/genengine_mini/plugin.py",
        "src/genengine_mini/engine.py",
        "tests/test_conformance.py",
    }, sorted(files)
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    (tmp_path / "src" / "genengine_mini" / "__init__.py").write_text("")
    project = tomllib.loads(files["pyproject.toml"])["project"]
    entry_points = project["entry-points"]["genengine.backends"]
    assert entry_points == {"mini": "genengine_mini.plugin"}
    info = tmp_path / "site" / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    (info / "entry_points.txt").write_text(
        "[genengine.backends]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(tmp_path / "src"), str(tmp_path / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    # The checks of what the page shows and of its pitfalls (the whole suite passes too: 89 tests, 25 s of CPU).
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", " or ".join(_CHECKS), "tests"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1]
    assert proc.returncode == 0 and "failed" not in summary and "error" not in summary, out[-6000:]
    assert re.search(rf"\b{len(_CHECKS) + 2} passed\b", summary), out[-6000:]  # the bucket test has 3 cases
