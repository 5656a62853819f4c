"""The GPU verl test's diagnostic for a run that never ends (tests/support/stacks.py with the sitecustomize in
tests/support/verl_site), on a real process tree: a shell, a Python child and its Python grandchild."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from support.processes import find_by_environ
from support.stacks import dump_stacks_and_kill

SITE = Path(__file__).resolve().parents[1] / "support" / "verl_site"

CHILD = """
import subprocess, sys, time
GRANDCHILD = "import time\\ndef grandchild_waits():\\n    time.sleep(600)\\ngrandchild_waits()"
subprocess.Popen([sys.executable, "-c", GRANDCHILD])
def child_waits():
    time.sleep(600)
child_waits()
"""


def test_every_process_of_a_stuck_run_dumps_its_stacks_then_dies(tmp_path: Path) -> None:
    stacks = tmp_path / "stacks"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")])}
    env["GENENGINE_STACKS_DIR"] = str(stacks)
    run = subprocess.Popen(["bash", "-c", f"\"{sys.executable}\" -c '{CHILD}'; sleep 600"], env=env)
    deadline = time.monotonic() + 60
    while len(list(stacks.glob("stacks-*.txt"))) < 2:  # both Pythons started (each opened its file)
        assert time.monotonic() < deadline, "the Python processes never started"
        time.sleep(0.1)
    time.sleep(0.5)  # past the imports, into the sleeps
    pids = dump_stacks_and_kill("GENENGINE_STACKS_DIR", str(stacks), settle_s=2.0)
    assert len(pids) == 3, pids  # bash, the child and the grandchild: found by their environment
    run.wait(timeout=10)
    dumps = "\n".join(f.read_text() for f in stacks.glob("stacks-*.txt"))
    assert "in child_waits" in dumps and "in grandchild_waits" in dumps, dumps
    assert not find_by_environ("GENENGINE_STACKS_DIR", str(stacks))


def test_trl_is_hidden_only_when_asked(tmp_path: Path) -> None:
    code = (
        "import importlib.util as u; print(u.find_spec('json') is not None)\n"
        "try:\n s = u.find_spec('trl')\nexcept ModuleNotFoundError as e: print(e)\nelse: print('not hidden')"
    )
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")])}
    base.pop("GENENGINE_HIDE_TRL", None)
    hidden = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, "GENENGINE_HIDE_TRL": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert hidden.stdout.splitlines() == ["True", "No module named 'trl' (hidden for verl 0.9.1)"], hidden.stdout
    shown = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, check=True)
    assert shown.stdout.splitlines() == ["True", "not hidden"], shown.stdout
