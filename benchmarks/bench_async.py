"""``genengine bench --async`` at 7B scale on one GPU, for the sglang or the vllm backend.

    bash tools/gpu/run_tests.sh ENGINE --script benchmarks/bench_async.py ENGINE [--json PATH]

Model: Qwen2-7B shapes with ``load_format="dummy"`` (random bf16 weights), as bench_sglang.py and
bench_vllm.py (same engine options, the context raised to fit the length cap). Workload
(genengine/cli/bench/asynchronous.py says how both loops run): 3 steps x 64 samples, prompts of 128 random
ids, output lengths lognormal (median 64, sigma 1.0) capped at 4096, forced with ``ignore_eos``;
``load_weights`` of all 339 trainer-held CUDA tensors after each step. Async keeps 96 requests in flight
(oversample 1.5) and carries the stragglers over each update with ``pause_generation("keep")``.

Goals (issue 17): async wall time <= 0.7x the synchronous one; pause -> load_weights -> resume <= 0.1 s.
Prints the table and ``BENCH_ASYNC_RESULT {json}``.
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

from _bench_7b import CFG, MEM_UTIL, make_model_dir, trainer_state, warm_trainer_process

PROMPT_LEN, CAP = 128, 4096
GOALS = {"ratio": 0.7, "pause_load_resume_seconds": 0.1}


def engine_options(engine: str) -> dict[str, Any]:
    """The 7B benches' options for this engine, with a context that fits prompt + cap."""
    if engine == "vllm":
        from bench_vllm import OPTIONS as VLLM_OPTIONS

        return {**VLLM_OPTIONS, "max_model_len": PROMPT_LEN + CAP + 64}
    from bench_sglang import OPTIONS as SGLANG_OPTIONS

    return {**SGLANG_OPTIONS, "context_length": PROMPT_LEN + CAP + 64}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", choices=("sglang", "vllm"))
    ap.add_argument("--model", default=None, help="the 7B-shaped model folder (default: built in the temp dir)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--median-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t0 = time.time()

    from genengine import create_engine
    from genengine.cli.bench.asynchronous import AsyncBenchSettings, format_async_report, run_async_bench
    from genengine.config import EngineConfig

    model = a.model or os.path.join(tempfile.gettempdir(), f"genengine-qwen2-7b-shape-{a.engine}")
    make_model_dir(model, tokenizer=a.engine == "sglang")
    options = engine_options(a.engine)
    settings = AsyncBenchSettings(
        backend=a.engine,
        model=model,
        options=options,
        dtype="bfloat16",
        mem_util=MEM_UTIL,
        batch_size=a.batch_size,
        steps=a.steps,
        oversample=1.5,
        prompt_len=PROMPT_LEN,
        median_new_tokens=a.median_new_tokens,
        sigma=1.0,
        max_new_tokens=CAP,
    )
    report: dict[str, Any] = {"model": "Qwen2-7B shape (dummy weights)", "cfg": CFG, "goals": GOALS}
    warm_trainer_process()
    items = trainer_state()
    engine = create_engine(
        EngineConfig(backend=a.engine, model=model, mem_util=MEM_UTIL, dtype="bfloat16", seed=0, options=options)
    )
    try:
        report.update(run_async_bench(settings, weights=lambda: items, engine=engine))
        print(format_async_report(report), flush=True)
        report["verdicts"] = {
            "ratio": report["ratio"] <= GOALS["ratio"],
            "pause_load_resume_seconds": report["async"]["pause_load_resume_max"] <= GOALS["pause_load_resume_seconds"],
        }
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()[-3000:]
        print(report["traceback"], flush=True)
    finally:
        engine.shutdown()
    report["elapsed_s"] = round(time.time() - t0, 1)
    line = json.dumps(report, default=str)
    print("BENCH_ASYNC_RESULT " + line, flush=True)
    out = a.json or (os.path.join(os.environ["OUT"], f"bench_async_{a.engine}.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(report, indent=1, default=str))
    sys.stdout.flush()
    os._exit(1 if "error" in report else 0)


if __name__ == "__main__":
    sys.exit(main())
