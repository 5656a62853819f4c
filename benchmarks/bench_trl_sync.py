"""One TRL ``sync_weights()`` at the Qwen2-7B shape: genengine's (one bucketed ``load_weights``) against TRL 1.16's
own colocated vLLM loop (``load_weights([(name, param)])`` once per parameter), in the same run.

    python3 benchmarks/bench_trl_sync.py [--backend vllm|sglang] [--reps 3] [--json PATH]   # a GPU
    python3 benchmarks/bench_trl_sync.py --tiny                                             # any CPU

GPU: the policy is a Qwen2-7B-shaped HF model in bf16 on the GPU (random weights, 339 tensors, 15.2 GB); the
engines start from ``load_format="dummy"`` (_bench_7b.make_model_dir writes only config.json and a small
tokenizer). Each side runs in its own child process (vLLM's sleep allocator and its external_launcher state
serve one engine per process), each timing ``sync_weights()`` of its generator ``--reps`` times after a warm-up:

  genengine   GenEngineGeneration (what genengine.integrations.trl's trainers build) on ``--backend``;
              beside it, TRL's per-parameter loop run against the same genengine engine, which separates the
              bucketing from the engine;
  trl         TRL's own VLLMGeneration, unmodified, its ``vllm.LLM`` built by TRL's ``_init_vllm`` with
              ``load_format="dummy"`` added (the only change: the folder holds no weights).

Each side then proves its sync landed: the policy's final norm is zeroed, synced, and one sampled token must
have logprob -log(vocab) (uniform logits). GPU memory: the allocator's peak over a sync, above what was
allocated before it.

``--tiny`` (the default without CUDA) runs the same code on the tiny model with the embedded engine; there is no
vLLM there, so the "trl" row is TRL's loop against the embedded engine. Prints a table and
``BENCH_TRL_SYNC_RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
}.items():
    os.environ.setdefault(_key, _value)

GIB = 1 << 30
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


def _landed(policy: Any, sync: Any, sample: Any, vocab: int) -> float:
    """|logprob + log(vocab)| of one token sampled after syncing a zeroed final norm (uniform logits)."""
    import torch

    with torch.no_grad():
        policy.model.norm.weight.zero_()
    sync()
    return abs(float(sample()) + math.log(vocab))


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

        def per_param() -> None:  # TRL's colocate loop, against the same engine
            for name, param in gen._iter_named_params():
                engine.load_weights([(name, param)])

        loop = _timed(per_param, reps, device)
        report = gen.last_load
        gap = _landed(
            policy, gen.sync_weights, lambda: gen.generate([[1, 2, 3]], None, 1)[2][0][0][0], policy.config.vocab_size
        )
        return {
            "genengine": {
                "seconds": ours,
                "peak_extra_gib": peak,
                "tensors": report.num_tensors,
                "buckets": report.num_buckets,
                "bytes": report.num_bytes,
                "landed_gap": gap,
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

    vllm_generation.LLM = functools.partial(vllm.LLM, load_format="dummy")  # the folder has no weights
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
    gap = _landed(
        policy, gen.sync_weights, lambda: gen.generate([[1, 2, 3]], None, 1)[2][0][0][0], policy.config.vocab_size
    )
    calls = sum(1 for _ in policy.named_parameters())
    return {"trl_vllm_per_param": {"seconds": seconds, "peak_extra_gib": peak, "calls": calls, "landed_gap": gap}}


def _child(side: str, model_dir: str, backend: str, device: str, reps: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--side",
        side,
        "--model-dir",
        model_dir,
        "--backend",
        backend,
        "--device",
        device,
        "--reps",
        str(reps),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("SIDE_RESULT "):
            return json.loads(line.removeprefix("SIDE_RESULT "))  # type: ignore[no-any-return]
    sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
    raise SystemExit(f"the {side} side failed (exit {proc.returncode})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backend",
        choices=["vllm", "sglang", "transformers"],
        default="vllm",
        help="genengine's engine on the GPU (--tiny always uses the embedded one)",
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (the default without CUDA)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--side", choices=["genengine", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.side is not None:  # a child: one side, one JSON line
        if args.side == "genengine":
            result = side_genengine(args.model_dir, args.backend, args.device, args.reps)
        else:
            result = side_trl(args.model_dir, args.device, args.reps)
        print("SIDE_RESULT " + json.dumps(result), flush=True)
        return

    import torch

    tiny = args.tiny or not torch.cuda.is_available()
    if tiny:
        from genengine.testing.tiny_model import tiny_model_dir

        model_dir, backend, device, shape = str(tiny_model_dir()), "transformers", "cpu", "tiny Qwen2 (27 tensors)"
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _bench_7b import make_model_dir

        model_dir = make_model_dir(os.path.join(tempfile.gettempdir(), "genengine-trl-7b"), tokenizer=True)
        backend, device, shape = args.backend, "cuda", "Qwen2-7B (339 tensors, 15.2 GB bf16)"
    results: dict[str, Any] = {"shape": shape, "backend": backend, "device": device}
    results.update(_child("genengine", model_dir, backend, device, args.reps))
    if tiny:  # no vLLM on a CPU: the per-parameter row against the embedded engine stands for TRL's loop
        results["trl_vllm_per_param"] = None
    else:
        results.update(_child("trl", model_dir, backend, device, args.reps))

    print(f"one TRL sync_weights(), {shape}, on {device}; median of {args.reps} after a warm-up")
    rows = [
        ("genengine " + backend + ": one bucketed load_weights", results["genengine"]),
        ("TRL's per-parameter loop into genengine's engine", results["per_param_into_genengine"]),
        ("TRL 1.16 VLLMGeneration (vLLM, per parameter)", results["trl_vllm_per_param"]),
    ]
    for label, row in rows:
        if row is None:
            print(f"  {label:<52} (not run: no vLLM on this machine)")
            continue
        peak = row.get("peak_extra_gib")
        print(
            f"  {label:<52} {statistics.median(row['seconds']):8.4f} s"
            + (f"  peak +{peak} GiB" if peak is not None else "")
            + (f"  landed: |lp + log V| = {row['landed_gap']:.1e}" if "landed_gap" in row else "")
        )
    print("BENCH_TRL_SYNC_RESULT " + json.dumps(results))
    for path in filter(None, [args.json, os.environ.get("OUT") and os.path.join(os.environ["OUT"], "trl_sync.json")]):
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
