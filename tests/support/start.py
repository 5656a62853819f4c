"""How the suite starts its worker processes (ranks, transport peers): forked from a fork server that imported
torch, torch.distributed and the tiny model's transformers modules once, instead of spawned afresh.

A spawned child imports torch (2-3 s of CPU) and, to build an engine, transformers' model code (3-4 s more) before
it does anything; the 2-core CI machine paid that once per rank, 8 ranks for tests/distributed/test_distributed.py
alone. Forked from the server, a child starts with those modules in memory. It is still a process of its own (its
own pid, memory, process group, signals), started by ``multiprocessing`` as before; what differs from ``spawn``: it
does not re-run its imports, and it sees the environment the server started with (the session's, conftest.py's
settings included), so a worker that needs a variable sets it itself, as the workers here do. Files whose subject is
a process's start itself (the SGLang-like children of tests/core/test_cleanup.py, the engines' own start-ups) keep
``spawn``, and so does tests/support/dist_worker.py's WorkerPool for now: forked, its 4-rank ``helpers`` job hung on
rank 3 in two of three full runs of tests/distributed/test_distributed.py on a loaded machine (the spawned pool
failed a 4-rank job there once too, with a gloo connection error; not yet understood).

The server is started by the first worker of a pytest process and serves every file that process runs.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

PRELOAD = (
    "torch",
    "torch.distributed",
    "transformers.models.qwen2.modeling_qwen2",
    "genengine.backends.transformers.engine",
)
"""What the server imports before its first fork; a module that fails to import is left to the child."""


def worker_context() -> Any:
    """The ``multiprocessing`` context the suite's workers start from (see the module docstring)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (the first worker), ignored after
    return ctx
