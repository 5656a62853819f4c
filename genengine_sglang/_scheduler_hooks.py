"""Code SGLang's scheduler processes import by name (``custom_weight_loader``); keep it tiny.

Both functions are reached through ``update_weights_from_tensor(load_format=...)``, the one way SGLang
0.5.17 offers to run our code inside its schedulers.

SGLang answers ``update_weights_from_tensor`` once its scheduler returns from ``load_weights``, but the
copies it launched may still be running on the GPU: the trainer would be told its tensors are free while
they are still being read. This loader synchronises the device before returning, so the reply is the
barrier. It costs the copy time itself (which has to be waited for anyway), against the ~66 ms of a
one-token generate used as a barrier elsewhere, and it works while the KV cache is released, when a
generate cannot run. Called with no tensors it is a pure barrier.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["load_weights_and_sync", "return_cached_memory"]

REPORT_ENV = "GENENGINE_SGLANG_MEMORY_REPORT"
"""A file path: when set, ``return_cached_memory`` appends one JSON line per call (for benchmarks)."""


def load_weights_and_sync(model: Any, named_tensors: Iterable[tuple[str, Any]]) -> None:
    import torch

    tensors = list(named_tensors)
    if tensors:
        model.load_weights(tensors)
    torch.cuda.synchronize()


def return_cached_memory(model: Any, named_tensors: Iterable[tuple[str, Any]]) -> None:
    """After a release: give the scheduler's cached-but-unused blocks back to the driver.

    SGLang's release unmaps the memory saver's regions, but blocks that torch's caching allocator keeps for
    reuse (activations of the last forward, the copy of the model's buffers SGLang stashes on release) stay
    reserved by the scheduler process and count against the trainer. Takes no tensors.
    """
    import gc
    import json
    import os

    del model, named_tensors
    before = _memory_stats()
    gc.collect()
    import torch

    torch.cuda.empty_cache()
    path = os.environ.get(REPORT_ENV)
    if path:
        line = {"pid": os.getpid(), "before": before, "after": _memory_stats()}
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")


def _memory_stats() -> dict[str, int]:
    import torch

    return {
        "free": int(torch.cuda.mem_get_info()[0]),
        "reserved": int(torch.cuda.memory_reserved()),
        "allocated": int(torch.cuda.memory_allocated()),
    }
