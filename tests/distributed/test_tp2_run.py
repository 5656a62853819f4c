"""``support.tp2_run`` (tests/support), the shared frame of the tp_size=2 GPU scripts, on two real gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = """
import sys
from support.tp2_run import Tp2Run, exit_with

RUN = Tp2Run("tp2-demo")

def main() -> int:
    assert RUN.start(bind_device=True) == 2
    RUN.check(True, "always holds")
    if sys.argv[2] == "fail" and RUN.rank == 1:
        RUN.check(False, "rank 1 saw something wrong")
    if sys.argv[2] == "raise" and RUN.rank == 1:
        raise RuntimeError("boom on rank 1")
    RUN.result["seen"] = RUN.gather(RUN.rank)
    return RUN.finish(sys.argv[1])

exit_with(RUN, main)
"""


def _pythonpath() -> str:
    """The script imports ``support`` as the GPU scripts do, from ``tests/`` on the path."""
    tests = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join([tests, *filter(None, [os.environ.get("PYTHONPATH")])])


def _torchrun(tmp_path: Path, mode: str) -> tuple[int, str, Path]:
    script = tmp_path / "demo.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"{mode}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), str(out), mode],
        capture_output=True,
        text=True,
        timeout=150,
        env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=_pythonpath()),
    )
    return proc.returncode, proc.stdout + proc.stderr, out


def test_both_ranks_pass_and_the_default_group_survives(tmp_path: Path) -> None:
    code, output, out = _torchrun(tmp_path, "pass")
    assert code == 0, output
    result = json.loads(out.read_text())
    assert result["passed"] is True
    assert [(r["rank"], r["fails"], r["seen"]) for r in result["ranks"]] == [(0, [], [0, 1]), (1, [], [0, 1])]
    assert output.count("PASS: all_reduce on the trainer's default group works after shutdown") == 2
    assert output.count("TP2 DEMO PASSED") == 2 and "TP2_DEMO_RESULT " in output


def test_one_rank_failing_fails_the_run_on_every_rank(tmp_path: Path) -> None:
    code, output, out = _torchrun(tmp_path, "fail")
    assert code != 0, output
    result = json.loads(out.read_text())
    assert result["passed"] is False
    assert [r["fails"] for r in result["ranks"]] == [[], ["rank 1 saw something wrong"]]
    assert output.count("TP2 DEMO FAILED") == 2


def test_a_rank_that_raises_exits_2_with_its_traceback(tmp_path: Path) -> None:
    code, output, out = _torchrun(tmp_path, "raise")
    assert code != 0 and not out.exists(), output
    assert "FAIL: exception" in output and "RuntimeError: boom on rank 1" in output
