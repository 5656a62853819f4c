"""The suite's worker processes (tests/support/start.py) and the pool bench's Ray workers start with the right
environment: both broke the GPU runs once, where nothing on the CPU showed it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from support.start import worker_context


def _report(queue: Any, name: str) -> None:
    queue.put(os.environ.get(name))


def test_a_forked_worker_sees_a_variable_set_after_the_server_started(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = worker_context()
    queue = ctx.Queue()
    first = ctx.Process(target=_report, args=(queue, "GENENGINE_TEST_START_FLAG"))  # starts the server if needed
    first.start()
    assert queue.get(timeout=60) is None
    first.join(30)
    monkeypatch.setenv("GENENGINE_TEST_START_FLAG", "set-later")
    later = ctx.Process(target=_report, args=(queue, "GENENGINE_TEST_START_FLAG"))
    later.start()
    assert queue.get(timeout=60) == "set-later"
    later.join(30)


def test_the_pool_bench_puts_the_folder_above_genengine_on_the_workers_path() -> None:
    from genengine.cli.bench.pool import source_root

    root = Path(source_root())
    assert (root / "genengine" / "__init__.py").is_file(), root
    assert not (root / "ray").exists(), f"{root} holds a 'ray' folder that would shadow Ray in the workers"
