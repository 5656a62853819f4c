"""``genengine bench --sync`` at the 7B shape: one weight sync split into pause, gather, transfer, load, resume
(genengine.cli.bench.sync), with requests in flight, on one GPU; the JSON and the bar chart of the phases.

    PYTHONPATH=/tmp/site-proj:/tmp/site-ENGINE python3 benchmarks/bench_sync_7b.py ENGINE [--syncs 5]
        [--in-flight 4] [--pool [--replicas 2]] [--json PATH] [--plot PATH]
                                                          (or: tools/gpu/run_tests.sh ENGINE --script ...)

The engine is the bench script's (benchmarks/bench_ENGINE.py: Qwen2-7B shapes, ``load_format="dummy"``, memory
fraction 0.6, eager, no prefix cache) in this process; the trainer's weights are random bf16 CUDA tensors under
the model's 339 names (15.2 GB). One warm-up sync, then ``--syncs``. Writes ``bench_sync_ENGINE.json`` and, where
matplotlib is installed, ``bench_sync_ENGINE.png`` (to ``$OUT`` when set, else the working folder); without
matplotlib the PNG is drawn from the JSON on any machine that has it:

    python3 -c "import json, sys; from genengine.cli.bench.sync import plot_sync_report as p; \\
        p(json.load(open(sys.argv[1])), sys.argv[2])" bench_sync_vllm.json bench_sync_vllm.png

Seconds on one H200: an eager 7B start ~30-40 s, 15 GB of random weights ~5 s, 6 syncs of ~0.1 s with 4
requests of 64 tokens each in flight: ~60 s.

``--pool`` adds the pool's row (genengine/cli/bench/pool_sync.py): once the in-process engine is shut down, an
``EnginePool`` of ``--replicas`` replicas of the same engine on a local Ray cluster, on the same GPU, synced
from this process over ``cuda_ipc`` (``--syncs`` of them, 10 by default with ``--pool``, after one that forms
the group), each phase from both ends' ``$GENENGINE_SYNC_TRACE`` files. The replicas share the GPU with the
trainer's 15 GB and each other, so each gets a capped KV cache (:data:`POOL_SHARING`). Run it on one GPU
(``CUDA_VISIBLE_DEVICES`` of one device): cuda_ipc needs the replicas on the trainer's GPU. The pool's row adds
~60-90 s (two 7B starts side by side, 11 syncs).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from _bench_7b import MEM_UTIL, make_model_dir  # this folder is on sys.path when the script runs

from genengine.cli.args import int_at_least

POOL_SHARING: dict[str, tuple[dict[str, Any], float]] = {
    # SGLang sizes its KV pool from the memory free when it starts, less (1 - mem_util) of the device: the
    # second replica would find ~0 left. A high fraction and a capped pool (as tests/gpu/test_exit_gpu.py).
    "sglang": ({"max_total_tokens": 65536}, 0.8),
    # vLLM checks mem_util of the device is free at start; a fixed KV cache skips its profiling, which would
    # count the other replica's allocations as its own.
    "vllm": ({"kv_cache_memory_bytes": 4 << 30}, 0.3),
}
"""(engine options, mem_util) of each replica when several share the GPU with the trainer."""


COUNT = "{text!r}: an integer >= {minimum}"


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", choices=("sglang", "vllm"))
    ap.add_argument("--model", default=None, help="the 7B-shaped folder (default: the bench script's)")
    ap.add_argument(
        "--syncs",
        type=int_at_least(1, COUNT),
        default=None,
        help="timed syncs after one warm-up (default 5; --pool: 10)",
    )
    ap.add_argument(
        "--in-flight", type=int_at_least(0, COUNT), default=4, help="requests generating during each sync (default 4)"
    )
    ap.add_argument("--pool", action="store_true", help="add the pool's row (an EnginePool on the same GPU)")
    ap.add_argument("--replicas", type=int_at_least(1, COUNT), default=2, help="the pool's replicas (default 2)")
    ap.add_argument("--json", default=None, help="the report (default: $OUT/bench_sync_ENGINE.json)")
    ap.add_argument("--plot", default=None, help="the PNG (default: $OUT/bench_sync_ENGINE.png)")
    a = ap.parse_args(argv)
    a.syncs = a.syncs or (10 if a.pool else 5)
    out = os.environ.get("OUT") or "."
    a.json = a.json or os.path.join(out, f"bench_sync_{a.engine}.json")
    a.plot = a.plot or os.path.join(out, f"bench_sync_{a.engine}.png")
    a.model = a.model or os.path.join(tempfile.gettempdir(), f"genengine-qwen2-7b-shape-{a.engine}")
    return a


def settings(engine: str, model: str, syncs: int, in_flight: int, replicas: int = 2) -> Any:
    """The SyncBenchSettings of the bench script's engine (its options: dummy weights, eager, no prefix cache;
    the pool's replicas: :data:`POOL_SHARING`, over cuda_ipc)."""
    from genengine.cli.bench.sync import SyncBenchSettings

    bench = importlib.import_module(f"bench_{engine}")
    pool_options, pool_mem_util = POOL_SHARING[engine]
    return SyncBenchSettings(
        backend=engine,
        model=model,
        options=dict(bench.OPTIONS),
        dtype="bfloat16",
        mem_util=MEM_UTIL,
        syncs=syncs,
        in_flight=in_flight,
        prompt_len=128,
        max_new_tokens=64,
        replicas=replicas,
        transport="cuda_ipc",
        pool_mem_util=pool_mem_util,
        pool_options=pool_options,
    )


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    from genengine.cli.bench.sync import format_sync_report, run_sync_bench, write_plot

    chosen = settings(a.engine, a.model, a.syncs, a.in_flight, a.replicas)
    make_model_dir(a.model, tokenizer=a.engine == "sglang")
    try:
        if a.pool:
            from genengine.cli.bench.pool_sync import run_pool_sync_bench

            report: dict[str, Any] = run_pool_sync_bench(chosen)
        else:
            report = run_sync_bench(chosen)
    except Exception as exc:
        report = {"backend": a.engine, "error": f"{type(exc).__name__}: {exc}"}
    with open(a.json, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1, default=str)
    if "error" in report:
        print(f"bench_sync_7b {a.engine}: failed: {report['error']}", flush=True)
        return 1
    print(format_sync_report(report), flush=True)
    write_plot(report, a.plot, print)
    print("BENCH_SYNC_RESULT " + json.dumps(report["targets"], default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
