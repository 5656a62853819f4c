"""``genengine bench --pool`` at 7B scale on one GPU (P7), for the sglang or the vllm backend.

    bash tools/gpu/run_tests.sh ENGINE --script benchmarks/bench_pool.py ENGINE [--json PATH]

Model: Qwen2-7B shapes with ``load_format="dummy"``, the engine options of bench_sglang.py / bench_vllm.py with
CUDA graphs on (``GRAPHS``; ``--eager`` for none).
A Ray trainer actor holds the trainer's 339 bf16 CUDA tensors (15.2 GB), an in-process engine and a
one-replica colocated ``EnginePool`` in its placement-group bundle (genengine/bench/pool.py says how they
are measured): generate tokens/s both ways, 5 interleaved repeats of >= 3 s each (64 prompts x 128 ids ->
128 tokens, greedy); 4 syncs of new weights over ``cuda_ipc`` against the in-process ``load_weights``, the
outputs of both compared after each.

Goals (issue 25): pool / in-process tokens/s >= 0.95; a sync through the pool <= 0.1 s.
Prints the table and ``BENCH_POOL_RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any

from _bench_7b import MEM_UTIL, N_PROMPTS, NEW_TOKENS, PROMPT_LEN, make_model_dir

MEM_UTILS = {"sglang": (0.3, 0.6), "vllm": (0.3, 0.3)}
"""(in-process, replica). SGLang sizes its pool as a fraction of the whole GPU minus what is already taken
when it starts, so the replica, which starts second, asks for more to get about as much."""


GRAPHS = {"sglang": {"cuda_graph_max_bs_decode": 64}, "vllm": {"max_num_seqs": 64}}
"""With CUDA graphs (``--eager`` turns them off), captured up to the batch of 64: eager decode at 7B is bound by the
host's CPU, and on the shared H200 host one 3 s repeat differed from the next by up to 2x (2026-12-02), which
no ratio of medians survives."""


def engine_options(engine: str, eager: bool = False) -> dict[str, Any]:
    """bench_sglang.py's / bench_vllm.py's options (dummy 7B weights, no prefix cache), CUDA graphs unless eager."""
    if engine == "vllm":
        from bench_vllm import OPTIONS
    else:
        from bench_sglang import OPTIONS
    options = dict(OPTIONS)
    if not eager:
        options.update(disable_cuda_graph=False, **GRAPHS[engine])
    return options


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", choices=("sglang", "vllm"))
    ap.add_argument("--model", default=None, help="the 7B-shaped model folder (default: built in the temp dir)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-seconds", type=float, default=3.0)
    ap.add_argument("--syncs", type=int, default=4)
    ap.add_argument("--bucket-mib", type=int, default=None, help="the transport's bucket size (default: its own)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs on either side (the settings before 12-02)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t0 = time.time()

    from genengine.bench.pool import PoolBenchSettings, format_pool_report, run_pool_bench

    model = a.model or os.path.join(tempfile.gettempdir(), f"genengine-qwen2-7b-shape-{a.engine}")
    make_model_dir(model, tokenizer=a.engine == "sglang")
    in_process, replica = MEM_UTILS[a.engine]
    assert in_process <= MEM_UTIL
    settings = PoolBenchSettings(
        backend=a.engine,
        model=model,
        options=engine_options(a.engine, a.eager),
        dtype="bfloat16",
        mem_util=in_process,
        pool_mem_util=replica,
        batch_size=N_PROMPTS,
        prompt_len=PROMPT_LEN,
        max_new_tokens=NEW_TOKENS,
        repeats=a.repeats,
        min_seconds=a.min_seconds,
        syncs=a.syncs,
        transport="cuda_ipc",
        bucket_bytes=None if a.bucket_mib is None else a.bucket_mib << 20,
        sleep=False,  # the suite's and the Ray test's: at 7B only speed is measured here
    )
    report: dict[str, Any] = {"model": "Qwen2-7B shape (dummy weights)"}
    try:
        report.update(run_pool_bench(settings))
        print(format_pool_report(report), flush=True)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()[-3000:]
        print(report["traceback"], flush=True)
    report["elapsed_s"] = round(time.time() - t0, 1)
    print("BENCH_POOL_RESULT " + json.dumps(report, default=str), flush=True)
    out = a.json or (os.path.join(os.environ["OUT"], f"bench_pool_{a.engine}.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(report, indent=1, default=str))
    sys.stdout.flush()
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
