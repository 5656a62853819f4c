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

from support.processes import find_by_environ

__all__ = ["dump_stacks_and_kill"]


def _pids(key: str, value: str) -> list[int]:
    return [p.pid for p in find_by_environ(key, value)]


def dump_stacks_and_kill(key: str, value: str, *, settle_s: float = 3.0) -> list[int]:
    """SIGUSR1 to each live process whose environment holds ``key=value``, ``settle_s`` for the dumps, then
    SIGKILL until none is left; the pids signalled first."""
    pids = _pids(key, value)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(settle_s)
    deadline = time.monotonic() + 5
    while left := _pids(key, value):  # any started since are killed too; gone (or zombies) when we return
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {left} carrying {key}={value} outlived SIGKILL by 5 s")
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    return pids
