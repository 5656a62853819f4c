"""What a plugin author sees when their engine fails the conformance suite: the values of the failed check,
and no cascade of unrelated failures from the shared engine the failed test left broken.

Run as a third party runs it: a separate pytest process, in a directory outside this checkout (genengine is
imported from the path, as an installed package is: pytest rewrites no asserts in it by itself).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A name-mapping bug: layer 1's tensors are written into layer 0. A load of other weights is not equal to a fresh
# engine on them, and the load that ``restoring`` makes afterwards leaves layer 0 wrong, so with the one bug every
# later test that compares with the baseline would fail too.
_BROKEN = """
from typing import Any

from genengine.backends.transformers.engine import TransformersEngine
from genengine.testing.conformance import EngineConformance


class MisnamesLayer1(TransformersEngine):
    def _apply_weights(self, bucket: Any, session: Any) -> None:
        super()._apply_weights([(name.replace(".layers.1.", ".layers.0."), t) for name, t in bucket], session)


class TestMisnamesLayer1(EngineConformance):
    def make_engine(self, model_dir: str, **options: Any) -> Any:
        return MisnamesLayer1(model_dir, dtype="float32", device="cpu", **options)
"""

_TESTS = ("test_load_weights_equals_a_fresh_engine", "test_flush_cache", "test_generate_async_equals_generate")


def test_a_broken_backend_fails_with_values_and_only_where_it_is_broken(tmp_path: Path) -> None:
    (tmp_path / "test_broken.py").write_text(textwrap.dedent(_BROKEN))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", " or ".join(_TESTS), "test_broken.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1]
    # Only the check that meets the bug fails; the two after it pass on the engine that replaced the broken one.
    assert re.search(r"\b1 failed, 2 passed\b", summary), out[-6000:]
    assert "FAILED test_broken.py::TestMisnamesLayer1::test_load_weights_equals_a_fresh_engine" in out, out[-6000:]
    # The failure shows the values compared (pytest's rewritten assert), not a bare AssertionError.
    assert re.search(r"E\s+assert \[\[\[\d+", out) and "At index 0 diff" in out, out[-6000:]
    assert "E       AssertionError\n" not in out, out[-6000:]
    assert "test_load_weights_equals_a_fresh_engine failed and left the shared engine unusable" in out, out[-6000:]
    assert "later tests run on a fresh engine" in out, out[-6000:]
