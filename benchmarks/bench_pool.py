"""``genengine bench --pool`` at 7B scale on one GPU (P7), for the sglang or the vllm backend.

    bash tools/gpu/run_tests.sh ENGINE --script benchmarks/bench_pool.py ENGINE [--json PATH]

Model: Qwen2-7B shapes with ``load_format="dummy"``, the engine options of bench_sglang.py / bench_vllm.py with
CUDA graphs on (``GRAPHS``; ``--eager`` for none).
A Ray trainer actor holds the trainer's 339 bf16 CUDA tensors (15.2 GB), an in-process engine and a
one-replica colocated ``EnginePool`` in its placement-group bundle (genengine/cli/bench/pool.py says how they
are measured): generate tokens/s both ways, 5 interleaved repeats of >= 3 s each (64 prompts x 128 ids ->
128 tokens, greedy); 6 syncs of new weights over ``cuda_ipc`` against the in-process ``load_weights``, the
outputs of both compared after each, taking the CUDA driver's IPC handles and torch's in turn
(``GENENGINE_CUDA_IPC_HANDLES``; the figure is the driver's, the default; ``--handles driver`` for it alone).

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

from genengine_sglang.compat import graph_options

MEM_UTILS = {"sglang": (0.3, 0.6), "vllm": (0.3, 0.3)}
"""(in-process, replica). SGLang sizes its pool as a fraction of the whole GPU minus what is already taken
when it starts, so the replica, which starts second, asks for more to get about as much."""


GRAPHS = {
    "sglang": graph_options(64),  # decode graphs up to 64, no prefill graphs: named per release (compat)
    "vllm": {"max_num_seqs": 64},
}
"""With CUDA graphs (``--eager`` turns them off), captured up to the batch of 64: eager decode at 7B is bound by the
host's CPU, and on the shared H200 host one 3 s repeat differed from the next by up to 2x (2026-12-02), which
no ratio of medians survives. Decode only on SGLang: its prefill graphs (58 token counts up to 8192) would cost
each start more capture than the bench's 128-id prompts spend in prefill."""


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


def bench_settings(
    engine: str,
    *,
    model: str | None = None,
    repeats: int = 5,
    min_seconds: float = 3.0,
    syncs: int = 6,
    bucket_mib: int | None = None,
    eager: bool = False,
    sleep: bool = False,
    sleep_level: int = 1,
    handles: tuple[str, ...] = ("driver", "torch"),
) -> Any:
    """The benchmark's ``PoolBenchSettings`` (the 7B-shaped folder made when missing). tests/gpu/test_ray_gpu.py
    runs its checks on these too (``GENENGINE_RAY_GPU_SCALE=7b``, verify.sh's default), so that one run gives
    both the Ray test's verdicts and this benchmark's figures."""
    from genengine.cli.bench.pool import PoolBenchSettings

    model = model or os.path.join(tempfile.gettempdir(), f"genengine-qwen2-7b-shape-{engine}")
    make_model_dir(model, tokenizer=engine == "sglang")
    in_process, replica = MEM_UTILS[engine]
    assert in_process <= MEM_UTIL
    return PoolBenchSettings(
        backend=engine,
        model=model,
        options=engine_options(engine, eager),
        dtype="bfloat16",
        mem_util=in_process,
        pool_mem_util=replica,
        batch_size=N_PROMPTS,
        prompt_len=PROMPT_LEN,
        max_new_tokens=NEW_TOKENS,
        repeats=repeats,
        min_seconds=min_seconds,
        syncs=syncs,
        transport="cuda_ipc",
        bucket_bytes=None if bucket_mib is None else bucket_mib << 20,
        sleep=sleep,
        sleep_level=sleep_level,
        handles=handles,
    )


MODEL_LABEL = "Qwen2-7B shape (dummy weights)"


def write_report(report: dict[str, Any], engine: str, path: str | None = None) -> None:
    """``BENCH_POOL_RESULT {json}`` on stdout, and the JSON in ``path`` (default ``$OUT/bench_pool_ENGINE.json``)."""
    print("BENCH_POOL_RESULT " + json.dumps(report, default=str), flush=True)
    out = path or (os.path.join(os.environ["OUT"], f"bench_pool_{engine}.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(report, indent=1, default=str))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", choices=("sglang", "vllm"))
    ap.add_argument("--model", default=None, help="the 7B-shaped model folder (default: built in the temp dir)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-seconds", type=float, default=3.0)
    ap.add_argument("--syncs", type=int, default=6)
    ap.add_argument(
        "--handles",
        default="driver,torch",
        help="cuda_ipc's ways of sharing, taken in turn by the syncs (GENENGINE_CUDA_IPC_HANDLES): driver, torch",
    )
    ap.add_argument("--bucket-mib", type=int, default=None, help="the transport's bucket size (default: its own)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs on either side (the settings before 12-02)")
    ap.add_argument("--sleep", action="store_true", help="also sleep both ways and compare the memory freed")
    ap.add_argument("--sleep-level", type=int, default=1, choices=(1, 2))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t0 = time.time()

    from genengine.cli.bench.pool import format_pool_report, run_pool_bench

    settings = bench_settings(
        a.engine,
        model=a.model,
        repeats=a.repeats,
        min_seconds=a.min_seconds,
        syncs=a.syncs,
        bucket_mib=a.bucket_mib,
        eager=a.eager,
        sleep=a.sleep,
        sleep_level=a.sleep_level,
        handles=tuple(a.handles.split(",")),
    )
    report: dict[str, Any] = {"model": MODEL_LABEL}
    try:
        report.update(run_pool_bench(settings))
        print(format_pool_report(report), flush=True)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()[-3000:]
        print(report["traceback"], flush=True)
    report["elapsed_s"] = round(time.time() - t0, 1)
    write_report(report, a.engine, a.json)
    sys.stdout.flush()
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
