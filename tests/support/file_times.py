"""Per-file timing of the CPU suite, for balancing the two xdist workers: set ``GENENGINE_FILE_TIMES`` to a
path and every worker appends one JSON line per test file (wall seconds, and CPU seconds of the pytest
process and of the children it reaped), in the order it ran them.

CPU seconds are what to compare across runs on a shared machine: wall time there depends on who else is
running. CPU of processes the test did not reap (Ray's daemons and actors) is not counted.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

ENV = "GENENGINE_FILE_TIMES"

_current: dict[str, object] = {}


def _cpu() -> tuple[float, float]:
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


def _flush() -> None:
    path = os.environ.get(ENV)
    if not path or not _current:
        return
    cpu, children = _cpu()
    record = {
        "file": _current["file"],
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "wall_s": round(time.monotonic() - float(_current["wall"]), 2),  # type: ignore[arg-type]
        "cpu_s": round(cpu - float(_current["cpu"]), 2),  # type: ignore[arg-type]
        "children_cpu_s": round(children - float(_current["children"]), 2),  # type: ignore[arg-type]
        "tests": _current["tests"],
    }
    with Path(path).open("a") as out:
        out.write(json.dumps(record) + "\n")
    _current.clear()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if not os.environ.get(ENV):
        return
    name = item.path.name
    if _current.get("file") != name:
        _flush()
        cpu, children = _cpu()
        _current.update(file=name, wall=time.monotonic(), cpu=cpu, children=children, tests=0)
    _current["tests"] = int(_current["tests"]) + 1  # type: ignore[call-overload]


def pytest_sessionfinish(session: pytest.Session) -> None:
    _flush()
