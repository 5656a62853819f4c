"""How the suite starts its worker processes (ranks, transport peers): forked from a fork server that imported
torch, torch.distributed and the tiny model's transformers modules once, instead of spawned afresh.

A spawned child imports torch (2-3 s of CPU) and, to build an engine, transformers' model code (3-4 s more) before
it does anything; the 2-core CI machine paid that once per rank, 8 ranks for tests/distributed/test_distributed.py
alone. Forked from the server, a child starts with those modules in memory. It is still a process of its own (its
own pid, memory, process group, signals), started by ``multiprocessing`` as before; what differs from ``spawn``: it
does not re-run its imports (modules that read a variable at import read the server's, the session's), while
``os.environ`` is its parent's at ``start()``, as a spawned child's is. Files whose subject is a process's start
itself (the SGLang-like children of tests/core/test_cleanup.py, the engines' own start-ups) keep ``spawn``, and so
does tests/support/dist_worker.py's WorkerPool for now: forked, its 4-rank ``helpers`` job hung on rank 3 in two of
three full runs of tests/distributed/test_distributed.py on a loaded machine (the spawned pool failed a 4-rank job
there once too, with a gloo connection error; not yet understood).

The server is started by the first worker of a pytest process and serves every file that process runs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

PRELOAD = (
    "torch",
    "torch.distributed",
    "transformers.models.qwen2.modeling_qwen2",
    "genengine.backends.transformers.engine",
)
"""What the server imports before its first fork; a module that fails to import is left to the child."""


class _Process(mp.context.ForkServerProcess):  # type: ignore[name-defined,misc]
    """A child forked from the server that runs with its parent's environment as it is at ``start()``, as a
    spawned child does (the server's is the session's at its own start: a test's ``monkeypatch.setenv``, e.g.
    the transport GPU tests' fault switches, would not reach the child)."""

    def start(self) -> None:
        self._parent_environ = dict(os.environ)  # pickled to the server with the process object
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._parent_environ)
        super().run()


class _Context(mp.context.ForkServerContext):  # type: ignore[name-defined,misc]
    Process = _Process


def worker_context() -> Any:
    """The ``multiprocessing`` context the suite's workers start from (see the module docstring)."""
    ctx = _Context()
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (the first worker), ignored after
    return ctx
