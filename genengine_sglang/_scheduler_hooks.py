"""Code SGLang's scheduler processes import by name (``custom_weight_loader``); keep it tiny.

SGLang answers ``update_weights_from_tensor`` once its scheduler returns from ``load_weights``, while the
copies it launched may still be running on the GPU: the trainer would be told its tensors are free while
they are still being read. This loader synchronises the device before returning, so the reply is the
barrier (docs/troubleshooting.md, "CUDA-IPC handles and buffers"); called with no tensors it is a pure
barrier. With ``$GENENGINE_SGLANG_MEMORY_REPORT`` set to a file when the engine starts, each barrier also
appends one JSON line of what the scheduler holds on its GPU, inside and outside SGLang's memory saver: the
only way to see, from outside, why a sleep frees less than expected.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["MEMORY_REPORT_ENV", "load_weights_and_sync", "memory_report"]

MEMORY_REPORT_ENV = "GENENGINE_SGLANG_MEMORY_REPORT"


def load_weights_and_sync(model: Any, named_tensors: Iterable[tuple[str, Any]]) -> None:
    import torch

    tensors = list(named_tensors)
    if tensors:
        model.load_weights(tensors)
    torch.cuda.synchronize()
    if not tensors:
        import os

        path = os.environ.get(MEMORY_REPORT_ENV)
        if path:
            import json

            with open(path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(memory_report()) + "\n")


def memory_report(min_block: int = 1 << 20) -> dict[str, Any]:
    """This process's GPU memory: the device's view, and torch's segments per pool with the sizes of the
    live blocks (at least ``min_block`` bytes) in the default pool, largest first."""
    import os

    import torch

    free, total = torch.cuda.mem_get_info()
    pools: dict[str, dict[str, int]] = {}
    blocks: list[int] = []
    for seg in torch.cuda.memory_snapshot():
        pool = "default" if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0) else "other"
        entry = pools.setdefault(pool, {"segments": 0, "reserved": 0, "allocated": 0})
        entry["segments"] += 1
        entry["reserved"] += int(seg["total_size"])
        entry["allocated"] += int(seg["allocated_size"])
        if pool == "default":
            blocks += [int(b["size"]) for b in seg["blocks"] if b["state"] == "active_allocated"]
    return {
        "pid": os.getpid(),
        "device": torch.cuda.current_device(),
        "device_free": int(free),
        "device_total": int(total),
        "pools": pools,
        "default_pool_blocks": sorted((b for b in blocks if b >= min_block), reverse=True)[:40],
    }
