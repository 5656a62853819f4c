"""Three processes on one GPU: a trainer shares its tensors, a replica opens them and passes them on
(``genengine.ipc.dumps``), an engine process opens what it was passed. What the colocated SGLang replica of a
``cuda_ipc`` sync does, with torch alone; ``tests/gpu/test_transport_gpu.py`` runs it.

Checked: the engine process reads the trainer's values bit for bit (a dense tensor and a view at an odd
offset of a larger storage), a second pass-on of the same share is refused with a clear error, and once every
process let go the trainer's memory goes back to its allocator (every share was released exactly once: a
share left counted would hold the memory for good). ``python tests/support/ipc_relay.py`` prints the result.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import pickle
import sys
from typing import Any

SHAPE = (1024, 1536)


def _engine(payload: bytes, out: Any) -> None:
    import torch

    torch.cuda.set_device(0)
    named = pickle.loads(payload)
    own = [(name, t.clone()) for name, t in named]  # the engine's copy, as a weight loader makes
    torch.cuda.synchronize()
    del named
    out.put({name: float(t.double().sum()) for name, t in own})


def _replica(shares: dict[str, Any], forward: bool, out: Any) -> None:
    import torch

    from genengine import ipc

    torch.cuda.set_device(0)
    try:
        opened = {name: ipc.open_shared(own, 0, spare) for name, (own, spare) in shares.items()}
        row: dict[str, Any] = {"replica": {name: float(t.double().sum()) for name, t in opened.items()}}
        if forward:
            payload = ipc.dumps(list(opened.items()))
            try:
                ipc.dumps(list(opened.items()))
                row["second"] = "passed on twice"
            except Exception as exc:
                row["second"] = f"{type(exc).__name__}: {exc}"
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=_engine, args=(payload, q))
            p.start()
            row["engine"] = q.get(timeout=120)
            p.join(60)
        ipc.settle(opened.values())
        del opened
        out.put(row)
    except BaseException as exc:
        out.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def run(forward: bool = True) -> dict[str, Any]:
    """The trainer's side; returns what each process read and the trainer's memory before, during and after."""
    import torch

    from genengine import ipc

    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    gen = torch.Generator(device="cuda").manual_seed(0)
    dense = torch.randn(SHAPE, generator=gen, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(SHAPE[0] * SHAPE[1] + 7, generator=gen, device="cuda", dtype=torch.bfloat16)
    view = big[7:].view(SHAPE)  # an odd element offset into a larger storage
    tensors = {"dense": dense, "view": view}
    expected = {name: float(t.double().sum()) for name, t in tensors.items()}
    shares = {name: (ipc.share(t), ipc.share(t)) for name, t in tensors.items()}
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_replica, args=(shares, forward, q))
    p.start()
    row = q.get(timeout=240)
    p.join(60)
    del tensors, dense, big, view, shares
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    after = torch.cuda.memory_allocated()
    return {"expected": expected, **row, "base": base, "held": held, "after": after, "exitcode": p.exitcode}


if __name__ == "__main__":
    result = {str(forward): run(forward) for forward in (True, False)}
    print("IPC_RELAY " + json.dumps(result))
    sys.exit(0)
