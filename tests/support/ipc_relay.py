"""Three processes on one GPU: a trainer shares its tensors, a replica opens them and passes them on
(``genengine.engine.ipc.PassOn.dumps``), an engine process opens what it was passed. What the colocated SGLang
replica of a ``cuda_ipc`` sync does, with torch alone; ``tests/gpu/test_transport_gpu.py`` runs it.

Checked: the engine process reads the trainer's values bit for bit (a dense tensor and a view at an odd
offset of a larger storage), under the trainer's spare share and, once none is left (or none was sent), as
the replica's copy; and once every process let go the trainer's memory goes back to its allocator (every
share was released exactly once: a share left counted would hold the memory for good).
``python tests/support/ipc_relay.py`` prints the result of each mode.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import pickle
import sys
from typing import Any

SHAPE = (1024, 1536)


MODES = ("spare", "settled", "no-spare", "driver")
"""``spare``: two shares a tensor, passed on twice (the spare share, then a copy); ``settled``: the spare share
released unused; ``no-spare``: one share a tensor, passed on once (a copy; the GPU test leaves it out, as
``spare``'s second pass-on is the same copy); ``driver``: ``spare`` with the replica's own share a CUDA driver
handle per allocation (``GENENGINE_CUDA_IPC_HANDLES=driver``), every allocation closed once nothing views it."""
DRIVER = "__driver__"


def _engine(payloads: list[bytes], out: Any) -> None:
    import torch

    torch.cuda.set_device(0)
    sums = []
    for payload in payloads:
        named = pickle.loads(payload)
        own = [(name, t.clone()) for name, t in named]  # the engine's copy, as a weight loader makes
        torch.cuda.synchronize()
        del named
        sums.append({name: float(t.double().sum()) for name, t in own})
    out.put(sums)


def _replica(shares: dict[str, Any], mode: str, out: Any) -> None:
    import torch

    from genengine.engine import ipc

    torch.cuda.set_device(0)
    try:
        mapped = ipc.Opened(shares.pop(DRIVER), 0) if mode == "driver" else None
        pass_on = ipc.PassOn()  # what a cuda_ipc receiver hands its engine's load session
        opened = {}
        for name, (own, spare) in shares.items():
            tensor = ipc.open_shared(own, 0) if mapped is None else mapped.view(*own)
            pass_on.lend(tensor, spare, 0, 0 if mapped is None else own[0][2])
            opened[name] = tensor
        del tensor
        row: dict[str, Any] = {"replica": {name: float(t.double().sum()) for name, t in opened.items()}}
        if mode != "settled":
            payloads = [pass_on.dumps(list(opened.items())) for _ in range(1 if mode == "no-spare" else 2)]
            row["passes"] = pass_on.passed
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=_engine, args=(payloads, q))
            p.start()
            row["engine"] = q.get(timeout=120)
            p.join(60)
        pass_on.settle(opened.values())
        del opened
        if mapped is not None:
            row["left_open"] = mapped.release()
        out.put(row)
    except BaseException as exc:
        out.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def run(mode: str) -> dict[str, Any]:
    """The trainer's side; returns what each process read and the trainer's memory before, during and after."""
    import torch

    from genengine.engine import ipc

    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    gen = torch.Generator(device="cuda").manual_seed(0)
    dense = torch.randn(SHAPE, generator=gen, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(SHAPE[0] * SHAPE[1] + 7, generator=gen, device="cuda", dtype=torch.bfloat16)
    view = big[7:].view(SHAPE)  # an odd element offset into a larger storage
    tensors = {"dense": dense, "view": view}
    expected = {name: float(t.double().sum()) for name, t in tensors.items()}
    shares: dict[str, Any] = {}
    if mode == "driver":
        shared = ipc.share_allocations(list(tensors.values()), 0)
        if shared is None:
            return {"error": "the CUDA driver could not share the trainer's allocations"}
        shares[DRIVER] = shared[0]
        # a comprehension: a loop variable would keep the last tensor (the view's storage) past the check below
        shares |= {
            name: ((place, "bfloat16", tuple(t.shape), t.numel() * t.element_size()), ipc.share(t))
            for (name, t), place in zip(tensors.items(), shared[1], strict=True)
        }
    else:
        shares = {name: (ipc.share(t), ipc.share(t) if mode != "no-spare" else None) for name, t in tensors.items()}
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_replica, args=(shares, mode, q))
    p.start()
    row = q.get(timeout=240)
    p.join(60)
    del tensors, dense, big, view, shares
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    after = torch.cuda.memory_allocated()
    return {"expected": expected, **row, "base": base, "held": held, "after": after, "exitcode": p.exitcode}


if __name__ == "__main__":
    result = {mode: run(mode) for mode in MODES}
    print("IPC_RELAY " + json.dumps(result))
    sys.exit(0)
