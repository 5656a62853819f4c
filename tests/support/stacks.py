"""Where a run that never ends got to: signal every process of it to dump its stacks, then kill them.

The processes are found by a variable in their environment (inherited by a driver's Ray daemons, workers and
engine children alike, where process groups and parents are not); they dump through ``tests/support/verl_site``'s
``sitecustomize`` (faulthandler on SIGUSR1 into ``GENENGINE_STACKS_DIR``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

__all__ = ["dump_stacks_and_kill", "processes_with_env"]


def processes_with_env(marker: str) -> list[int]:
    """The pids whose environment holds the entry ``marker`` (``NAME=value``), this process excluded."""
    pids = []
    for env_file in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in env_file.read_bytes().split(b"\0"):
                pids.append(int(env_file.parent.name))
        except (OSError, ValueError):
            continue
    return [pid for pid in pids if pid != os.getpid()]


def dump_stacks_and_kill(marker: str, *, settle_s: float = 3.0) -> list[int]:
    """SIGUSR1 to each process carrying ``marker``, ``settle_s`` for the dumps, then SIGKILL until none is left;
    the pids signalled first."""
    pids = processes_with_env(marker)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(settle_s)
    deadline = time.monotonic() + 5
    while left := processes_with_env(marker):  # any started since are killed too; gone (or reaped) when we return
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {left} carrying {marker} outlived SIGKILL by 5 s")
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    return pids
