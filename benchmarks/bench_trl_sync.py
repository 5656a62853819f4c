"""One TRL ``sync_weights()`` at the Qwen2-7B shape: genengine's (one bucketed ``load_weights``) against TRL 1.16's
own colocated vLLM loop (``load_weights([(name, param)])`` once per parameter), in the same run.

    python3 benchmarks/bench_trl_sync.py [--backend vllm|sglang] [--reps 3] [--json PATH]   # a GPU
    python3 benchmarks/bench_trl_sync.py --tiny                                             # a CPU (its default)

GPU: the policy is a Qwen2-7B-shaped HF model in bf16 on the GPU (random weights, 339 tensors, 15.2 GB); the
engines start from ``load_format="dummy"`` (_bench_7b.make_model_dir writes only config.json and a small
tokenizer). Each side runs in its own child process (vLLM's sleep allocator and its external_launcher state
serve one engine per process), each timing ``sync_weights()`` of its generator ``--reps`` times after a warm-up:

  genengine   GenEngineGeneration (what genengine.integrations.trl's trainers build) on ``--backend``;
              beside it, TRL's per-parameter loop run against the same genengine engine, which separates the
              bucketing from the engine;
  trl         TRL's own VLLMGeneration, unmodified, its ``vllm.LLM`` built by TRL's ``_init_vllm`` with
              ``load_format="dummy"`` (the folder holds no weights) and ``enforce_eager=True`` added (as
              genengine's side: no torch.compile or CUDA-graph capture at start; a sync writes the same
              parameters either way). Run only where vLLM is installed: with ``--backend sglang`` in SGLang's
              site (which has no vLLM) that row is "not run", and the vllm run gives it.

genengine's side also splits one sync (``breakdown``): TRL's parameter walk alone, the engine's writes (its
``_apply_weights`` calls: vLLM's loader, SGLang's calls) and how many, the cache flush, and the rest (genengine's
checks, bucketing and bookkeeping). Goal (issue 41): genengine's sync at least 2x faster than TRL's own (``goal_2x``).

Each side then proves its syncs land: 16 one-token samples after the timed syncs must be far from uniform
(the engine holds the policy's random weights, not the dummy ones, whose logits are nearly flat), and after the
policy's final norm is zeroed and synced, uniform (every logprob -log(vocab) within 1e-2). GPU memory: the
allocator's peak over a sync, above what was allocated before it.

``--tiny`` (the default without CUDA) runs the same code on the tiny model with the embedded engine; there is no
vLLM there, so the "trl" row is TRL's loop against the embedded engine. Prints a table and
``BENCH_TRL_SYNC_RESULT {json}``; the JSON also goes to ``--json`` or, when ``$OUT`` is set, to
``$OUT/bench_trl_sync_BACKEND.json`` (rewritten after each side, with ``error`` when one failed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import _bench_7b

_bench_7b.set_offline_env()

GIB = 1 << 30
N_SAMPLES = 16  # one-token samples per landing check
LANDED_TOL = 1e-2  # |logprob + log(vocab)| after the zeroed norm: logits are exactly 0, so ~1e-6 in fp32
MOVED_MIN = 0.1  # the largest of 16 such gaps on the random policy: ~1 at 7B (logit std ~1.2), ~0 on dummy weights
MEM_UTIL = 0.3  # TRL's default vllm_gpu_memory_utilization; the 15 GB policy shares the GPU
ENGINE_OPTIONS: dict[str, dict[str, Any]] = {
    "vllm": {"load_format": "dummy", "disable_cuda_graph": True, "enable_prefix_caching": False},
    "sglang": {"load_format": "dummy", "disable_cuda_graph": True, "disable_radix_cache": True, "log_level": "warning"},
    "transformers": {"device": "cpu"},
}


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _timed(fn: Any, reps: int, device: str) -> list[float]:
    out = []
    for i in range(reps + 1):  # one warm-up
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        if i:
            out.append(time.perf_counter() - t)
    return out


def _peak_extra_gib(fn: Any, device: str) -> float | None:
    if device != "cuda":
        return None
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / GIB, 3)


def _sync_breakdown(gen: Any, engine: Any, device: str) -> dict[str, Any]:
    """One ``sync_weights()`` split: TRL's walk (timed alone, before), the engine's writes and calls, the flush,
    and the rest (genengine's checks, bucketing, bookkeeping: the total less the other three)."""
    _sync(device)
    t = time.perf_counter()
    walked = sum(1 for _ in gen._named_tensors())
    walk_s = time.perf_counter() - t
    seconds = {"_apply_weights": 0.0, "_finish_weights": 0.0}
    calls = {"_apply_weights": 0, "_finish_weights": 0}

    def timing(name: str) -> Any:
        real = getattr(engine, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - t
                calls[name] += 1

        return wrapper

    for name in seconds:
        setattr(engine, name, timing(name))
    _sync(device)
    t = time.perf_counter()
    try:
        gen.sync_weights()
        _sync(device)
    finally:
        total = time.perf_counter() - t
        for name in seconds:
            delattr(engine, name)  # the class's own method again
    writes, flush = seconds["_apply_weights"], seconds["_finish_weights"]
    return {
        "total_s": round(total, 4),
        "trl_walk_s": round(walk_s, 4),
        "tensors": walked,
        "engine_writes_s": round(writes, 4),
        "engine_write_calls": calls["_apply_weights"],
        "flush_s": round(flush, 4),
        "genengine_rest_s": round(total - walk_s - writes - flush, 4),
    }


def _policy(model_dir: str, device: str) -> Any:
    """The trainer's model: real HF modules under HF names (what TRL walks), random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if device == "cpu":
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config._name_or_path = model_dir  # TRL hands name_or_path to vLLM
    return model


def _landing(policy: Any, sync: Any, generate: Any) -> dict[str, float | bool]:
    """Largest |logprob + log(vocab)| of 16 one-token samples on the synced random policy ("before": far from 0)
    and after syncing a zeroed final norm, which makes every logit 0 ("after": 0)."""
    import torch

    log_v = math.log(policy.config.vocab_size)
    prompts = [[1, 2, 3 + i] for i in range(N_SAMPLES)]

    def gap() -> float:
        logprobs = generate(prompts, None, 1)[2]
        return max(abs(float(row[0][0]) + log_v) for row in logprobs)

    before = gap()
    with torch.no_grad():
        policy.model.norm.weight.zero_()
    sync()
    after = gap()
    return {"gap_before": before, "gap_after": after, "landed": before > MOVED_MIN and after < LANDED_TOL}


def side_genengine(model_dir: str, backend: str, device: str, reps: int) -> dict[str, Any]:
    from accelerate import Accelerator
    from transformers import AutoTokenizer

    from genengine.integrations.trl import GenEngineGeneration

    policy = _policy(model_dir, device)
    accelerator = Accelerator(cpu=device == "cpu")
    config = {
        "backend": backend,
        "dtype": "float32" if backend == "transformers" else "bfloat16",
        "options": ENGINE_OPTIONS[backend],
    }
    gen = GenEngineGeneration(
        model=policy,
        accelerator=accelerator,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        gpu_memory_utilization=MEM_UTIL,
        max_model_length=2048,
        max_completion_length=1,
        logprobs=0,
        genengine=config,
    )
    try:
        engine = gen.engine
        ours = _timed(gen.sync_weights, reps, device)
        peak = _peak_extra_gib(gen.sync_weights, device)
        breakdown = _sync_breakdown(gen, engine, device)

        def per_param() -> None:  # TRL's colocate loop, against the same engine
            for name, param in gen._iter_named_params():
                engine.load_weights([(name, param)])

        loop = _timed(per_param, reps, device)
        report = gen.last_load
        assert report is not None, "sync_weights() left no LoadReport"
        landing = _landing(policy, gen.sync_weights, gen.generate)
        return {
            "genengine": {
                "seconds": ours,
                "peak_extra_gib": peak,
                "tensors": report.num_tensors,
                "buckets": report.num_buckets,
                "bytes": report.num_bytes,
                "breakdown": breakdown,
                **landing,
            },
            "per_param_into_genengine": {"seconds": loop, "calls": report.num_tensors},
        }
    finally:
        gen.shutdown()


def side_trl(model_dir: str, device: str, reps: int) -> dict[str, Any]:
    import functools

    import vllm
    from accelerate import Accelerator
    from transformers import AutoTokenizer
    from trl.generation import vllm_generation

    # The folder has no weights; eager as genengine's side (only the start differs: the sync writes the same tensors).
    vllm_generation.LLM = functools.partial(vllm.LLM, load_format="dummy", enforce_eager=True)
    policy = _policy(model_dir, device)
    gen = vllm_generation.VLLMGeneration(
        model=policy,
        accelerator=Accelerator(),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        gpu_memory_utilization=MEM_UTIL,
        max_model_length=2048,
        max_num_seqs=16,
        model_impl="vllm",  # GRPOConfig's default
        max_completion_length=1,
        logprobs=0,
    )
    seconds = _timed(gen.sync_weights, reps, device)
    peak = _peak_extra_gib(gen.sync_weights, device)
    landing = _landing(policy, gen.sync_weights, gen.generate)
    calls = sum(1 for _ in policy.named_parameters())
    return {"trl_vllm_per_param": {"seconds": seconds, "peak_extra_gib": peak, "calls": calls, **landing}}


class SideFailed(RuntimeError):
    """A side's child process ended without a result (its output is in this process's log, above)."""


def _child(side: str, model_dir: str, backend: str, device: str, reps: int, timeout: float) -> dict[str, Any]:
    """Run one side in a process of its own; its output goes to this process's stdout and stderr (the log)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "side.json")
        cmd = [sys.executable, __file__, "--side", side, "--model-dir", model_dir, "--backend", backend]
        cmd += ["--device", device, "--reps", str(reps), "--result", result]
        print(f"--- {side} side: {' '.join(cmd[1:])}", flush=True)
        try:
            code = subprocess.run(cmd, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise SideFailed(f"the {side} side did not finish within {timeout:.0f} s") from None
        if code != 0 or not os.path.exists(result):
            raise SideFailed(f"the {side} side failed (exit {code}); its traceback is in the log")
        with open(result, encoding="utf-8") as fh:
            return json.load(fh)  # type: ignore[no-any-return]


def _median(row: dict[str, Any] | None) -> float | None:
    return None if row is None else statistics.median(row["seconds"])


def _summarise(results: dict[str, Any]) -> None:
    """Medians, ratios and the landing verdicts, beside the raw rows."""
    ours = _median(results.get("genengine"))
    loop = _median(results.get("per_param_into_genengine"))
    trl = _median(results.get("trl_vllm_per_param"))
    results["median_s"] = {"genengine": ours, "per_param_into_genengine": loop, "trl_vllm_per_param": trl}
    results["speedup"] = {
        "per_param_into_genengine": loop / ours if ours and loop else None,
        "trl_vllm_per_param": trl / ours if ours and trl else None,
    }
    results["goal_2x"] = trl / ours >= 2 if ours and trl else None
    sides = {k: results.get(k) for k in ("genengine", "trl_vllm_per_param")}
    results["landed"] = {k: row["landed"] for k, row in sides.items() if row}


def _write(results: dict[str, Any], path: str | None) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backend",
        choices=["vllm", "sglang", "transformers"],
        help="genengine's engine: vllm or sglang at 7B on a GPU (default: vllm where there is CUDA), transformers: "
        "the embedded one on the tiny model on the CPU (the default without CUDA)",
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU, with the embedded engine")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--json", help="write the results here (default: $OUT/bench_trl_sync_BACKEND.json when $OUT is set)"
    )
    parser.add_argument("--side-timeout", type=float, default=270.0, help="seconds each side's process may take")
    parser.add_argument("--side", choices=["genengine", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.side is not None:  # a child: one side, its result in a file
        if args.side == "genengine":
            result = side_genengine(args.model_dir, args.backend, args.device, args.reps)
        else:
            result = side_trl(args.model_dir, args.device, args.reps)
        _write(result, args.result)
        return 0

    import torch

    cuda = torch.cuda.is_available()
    backend = args.backend or ("vllm" if cuda and not args.tiny else "transformers")
    tiny = args.tiny or backend == "transformers"
    out = args.json or (
        os.path.join(os.environ["OUT"], f"bench_trl_sync_{backend}.json") if os.environ.get("OUT") else None
    )
    t0 = time.perf_counter()
    results: dict[str, Any] = {"backend": backend, "reps": args.reps}
    try:
        if tiny and backend != "transformers":
            raise ValueError(f"--tiny runs the embedded engine (backend transformers), not --backend {backend}")
        if not tiny and not cuda:
            raise ValueError(f"--backend {backend} runs at 7B on a CUDA GPU and there is none; --tiny runs on the CPU")
        if tiny:
            from genengine.models.tiny_model import tiny_model_dir

            model_dir, device, shape = str(tiny_model_dir()), "cpu", "tiny Qwen2 (27 tensors)"
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from _bench_7b import make_model_dir

            model_dir = make_model_dir(os.path.join(tempfile.gettempdir(), "genengine-trl-7b"), tokenizer=True)
            device, shape = "cuda", "Qwen2-7B (339 tensors, 15.2 GB bf16)"
        results.update({"shape": shape, "device": device})
        results.update(_child("genengine", model_dir, backend, device, args.reps, args.side_timeout))
        _summarise(results)
        _write(results, out)  # the genengine side's figures survive a failure of the other
        if tiny:  # no vLLM on a CPU: the per-parameter row against the embedded engine stands for TRL's loop
            results["trl_vllm_per_param"] = None
            results["trl_not_run"] = "tiny run on the CPU: no vLLM"
        elif importlib.util.find_spec("vllm") is None:
            results["trl_vllm_per_param"] = None
            results["trl_not_run"] = "no vLLM installed here (the vllm backend's run measures TRL's own loop)"
        else:
            results.update(_child("trl", model_dir, backend, device, args.reps, args.side_timeout))
        _summarise(results)
    except Exception as exc:  # the JSON says what failed (the exit status too)
        results["error"] = f"{type(exc).__name__}: {exc}"
        results["elapsed_s"] = round(time.perf_counter() - t0, 1)
        _write(results, out)
        print(f"bench_trl_sync: {results['error']}", file=sys.stderr, flush=True)
        return 1
    results["elapsed_s"] = round(time.perf_counter() - t0, 1)

    print(f"one TRL sync_weights(), {shape}, on {device}; median of {args.reps} after a warm-up")
    rows = [
        ("genengine " + backend + ": one bucketed load_weights", results["genengine"]),
        ("TRL's per-parameter loop into genengine's engine", results["per_param_into_genengine"]),
        ("TRL 1.16 VLLMGeneration (vLLM, per parameter)", results["trl_vllm_per_param"]),
    ]
    for label, row in rows:
        if row is None:
            print(f"  {label:<52} (not run: {results['trl_not_run']})")
            continue
        peak = row.get("peak_extra_gib")
        print(
            f"  {label:<52} {statistics.median(row['seconds']):8.4f} s"
            + (f"  peak +{peak} GiB" if peak is not None else "")
            + (
                f"  landed: {row['landed']} (max |lp + log V| {row['gap_before']:.2f} -> {row['gap_after']:.1e})"
                if "landed" in row
                else ""
            )
        )
    split = results["genengine"].get("breakdown")
    if split:
        print(
            f"  genengine's sync split: TRL walk {split['trl_walk_s']:.4f} s, engine writes"
            f" {split['engine_writes_s']:.4f} s ({split['engine_write_calls']} calls),"
            f" flush {split['flush_s']:.4f} s, genengine's checks and bookkeeping {split['genengine_rest_s']:.4f} s;"
            f" goal >= 2x TRL's own: {results.get('goal_2x')}"
        )
    print("BENCH_TRL_SYNC_RESULT " + json.dumps(results))
    _write(results, out)
    return 0 if all(results["landed"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
