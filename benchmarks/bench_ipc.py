"""What handing the trainer's CUDA tensors to another process on the same GPU costs, per phase, two ways side
by side in one run (the phases ``cuda_ipc``'s in-place reads spend a pool sync's time on):

* ``torch``: torch's IPC reduction, as ``cuda_ipc`` shares with ``GENENGINE_CUDA_IPC_HANDLES=torch``
  (``genengine.engine.ipc.share`` / ``open_shared`` / ``settle``): a handle, an IPC event and a reference count per
  tensor;
* ``driver``: one CUDA driver IPC handle per allocation the tensors lie in (``genengine.engine.ipc.share_allocations``
  / ``Opened``, as ``cuda_ipc`` shares by default), opened once by the receiver and viewed per tensor, closed
  before the receiver answers.

The trainer's 339 Qwen2-7B-shaped bf16 tensors (``_bench_7b.trainer_state``: each its own allocation),
``--rounds`` rounds with the two ways alternating (ABBA); the receiver reads every tensor's first values,
which must equal the trainer's. ``--expandable`` allocates them with ``expandable_segments:True`` (the driver
way then says which tensors it cannot share).

    bash tools/gpu/run_tests.sh ENGINE --script benchmarks/bench_ipc.py [--rounds 6] [--json PATH]

Prints a table and ``BENCH_IPC_RESULT {json}`` (and writes ``$OUT/bench_ipc.json`` when ``$OUT`` is set).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from typing import Any

from _bench_7b import trainer_state

PROBE = 4
"""Values read from the start of every tensor by the receiver."""


def probe(tensors: list[Any]) -> list[float]:
    import torch

    return torch.stack([t.reshape(-1)[:PROBE].float() for t in tensors]).cpu().reshape(-1).tolist()


def receiver(conn: Any, index: int) -> None:
    """The replica's side: open what arrives, read the probe values, let go, answer with the phases."""
    import torch

    from genengine.engine import ipc

    torch.cuda.set_device(index)
    torch.zeros(1, device=f"cuda:{index}")
    while True:
        blob = conn.recv_bytes()
        start = time.perf_counter()
        way, payload = pickle.loads(blob)
        if way == "stop":
            return
        marks: dict[str, float] = {}
        if way == "torch":
            tensors = [ipc.open_shared(args, index) for args in payload]
        else:
            mapped = ipc.Opened(payload[0], index)
            tensors = [mapped.view(place, *meta) for place, meta in zip(payload[1], payload[2], strict=True)]
        marks["open"] = time.perf_counter() - start
        values = probe(tensors)
        torch.cuda.synchronize()
        marks["read"] = time.perf_counter() - start - marks["open"]
        begin = time.perf_counter()
        del tensors  # no spares lent: nothing to settle
        if way == "driver":
            marks["left_open"] = mapped.release()
            del mapped
        marks["release"] = time.perf_counter() - begin
        conn.send((marks, values))


def run(rounds: int, expandable: bool) -> dict[str, Any]:
    import multiprocessing as mp

    import torch

    from genengine.engine import ipc

    index = torch.cuda.current_device()
    tensors = [t for _, t in trainer_state()]
    expected = probe(tensors)
    metas = [("bfloat16", tuple(t.shape), t.numel() * t.element_size()) for t in tensors]
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=receiver, args=(child, index), daemon=True)
    proc.start()
    rows: dict[str, list[dict[str, float]]] = {"torch": [], "driver": []}
    notes: dict[str, Any] = {"tensors": len(tensors), "bytes": sum(t.numel() * 2 for t in tensors)}
    try:
        for r in range(rounds):
            for way in ("torch", "driver") if r % 2 == 0 else ("driver", "torch"):
                start = time.perf_counter()
                if way == "torch":
                    payload: Any = [ipc.share(t) for t in tensors]
                else:
                    shared = ipc.share_allocations(tensors, index)
                    notes["driver_allocations"] = None if shared is None else len(shared[0])
                    if shared is None:  # the driver cannot share them (expandable segments)
                        continue
                    payload = (shared[0], shared[1], metas)
                share = time.perf_counter() - start
                parent.send_bytes(pickle.dumps((way, payload)))
                marks, values = parent.recv()
                total = time.perf_counter() - start
                if values != expected or marks.pop("left_open", 0):
                    raise AssertionError(f"{way}: the receiver read other values than the trainer's, or kept {marks}")
                rows[way].append({"share": share, **marks, "total": total})
        parent.send_bytes(pickle.dumps(("stop", None)))
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    torch.cuda.ipc_collect()
    medians = {
        way: {k: 1000 * statistics.median(row[k] for row in got) for k in got[0]} for way, got in rows.items() if got
    }
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "expandable_segments": expandable,
        "rounds": rounds,
        **notes,
        "median_ms": medians,
        "all": rows,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--expandable", action="store_true", help="the trainer's allocator with expandable segments")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.expandable:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    report = run(a.rounds, a.expandable)
    for way, m in report["median_ms"].items():
        print(f"{way:<7} " + ", ".join(f"{k} {v:.1f} ms" for k, v in m.items()))
    print(f"allocations the driver shares: {report.get('driver_allocations')} (None: it cannot share them)")
    print("BENCH_IPC_RESULT " + json.dumps(report), flush=True)
    out = a.json or (os.path.join(os.environ["OUT"], "bench_ipc.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
