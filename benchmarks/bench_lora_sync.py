"""LoRA sync of a PEFT policy: adapter only (``load_adapter``) against TRL's way (merge the adapter into the base,
send the whole model with ``load_weights``, unmerge), on an engine that serves adapters.

    python3 benchmarks/bench_lora_sync.py [--backend transformers|sglang|vllm] [--reps 5] [--json PATH]  # a GPU
    python3 benchmarks/bench_lora_sync.py --tiny                       # a CPU: the tiny model (its default)

The base is a random-weight Qwen2 model of ``--params`` (default 7e9, bf16; written once by the project's builder,
15 GB) served by ``--backend`` on the GPU with LoRA enabled (sglang: ``enable_lora``, ``max_lora_rank``,
``lora_target_modules``; vllm: ``enable_lora``, ``max_lora_rank``); the "trainer" holds its own copy of the base on
the same GPU (read from the folder), plus a rank-``--rank`` (16) adapter on q/k/v/o and gate/up/down of every
layer. Each side is timed ``--reps`` times after a warm-up:

  adapter   engine.load_adapter("policy", <the adapter's lora_A/lora_B tensors>, config, version=step)
  merge     W += s·B@A on the trainer's copy (every targeted module), engine.load_weights(<the whole model>),
            W -= s·B@A (TRL's merge_adapter / sync / unmerge_adapter)

``adapter_phases`` splits the adapter side by step (the medians of ``AdapterInfo.phases``: ``check_s``, the
backend's own steps, ``retire_s``; host-side seconds, so GPU work launched in one step may be paid in a later
one; SGLang's ``flatten_reused`` is a flag, 1 when the median sync reused a recycled shared-memory buffer, as
from the second timed sync on); ``--adapter-sync`` picks the backend's way (vllm: ``memory``, ``folder``;
sglang: ``flattened``, ``cuda_ipc``, ``tensors``; the default is the first named, the last is the first way,
kept to compare);
``adapter_first_use_s`` is a one-token generate with the adapter right after a sync, ``adapter_warm_use_s`` the
same generate again (what an engine leaves to the first batch that uses a new adapter). And the GPU memory each
needs: this process's allocator peak over the sync above what was allocated before it (the embedded engine and
vLLM allocate here; SGLang's engine runs in its own process), and how much less of the device is free after
the sync than before (``*_free_drop_gib``: SGLang's side too). Goal (issue 45): adapter sync <= 10 ms and no
merged copy of the model. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_over(device: str, call: Any) -> tuple[float, int, int]:
    """Seconds of ``call()``, this process's allocator peak over it above what was allocated before, and how much
    less GPU memory is free after it than before (the whole device: an engine in its own process too); 0 on CPU."""
    import torch

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before, free_before = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    call()
    _sync(device)
    seconds = time.perf_counter() - start
    if not cuda:
        return seconds, 0, 0
    return seconds, int(torch.cuda.max_memory_allocated() - before), int(free_before - torch.cuda.mem_get_info()[0])


def phase_medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """The median seconds of each step over the runs (a step missing from a run counts 0 there)."""
    names = sorted({name for run in runs for name in run})
    return {name: statistics.median(run.get(name, 0.0) for run in runs) for name in names}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (the default without CUDA)")
    parser.add_argument("--params", type=float, default=7e9, help="base model size (Qwen2 proportions)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--backend", default="transformers", choices=("transformers", "sglang", "vllm"))
    parser.add_argument("--mem-util", type=float, default=0.5, help="the engine's share of the GPU (sglang, vllm)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--adapter-sync",
        help="the backend's adapter_sync mode (vllm: memory|folder; sglang: "
        "flattened|cuda_ipc|tensors); default: the backend's own",
    )
    parser.add_argument("--model-dir", default="/tmp/genengine-bench-lora", help="where the base is written once")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)

    import torch

    import genengine
    from genengine.models.tiny_model import build_tiny_model

    tiny = args.tiny or not torch.cuda.is_available()
    device = "cpu" if tiny else "cuda"
    dtype = "float32" if tiny else "bfloat16"
    path = Path(args.model_dir) / ("tiny" if tiny else f"qwen2-{args.params:.0e}")
    if not (path / "config.json").exists():
        kwargs: dict[str, Any] = {"dtype": dtype} if tiny else {"dtype": dtype, "num_params": int(args.params)}
        build_tiny_model(path, **kwargs)
    if args.backend == "transformers" or tiny:
        options: dict[str, Any] = {"device": device, "max_lora_rank": args.rank}
        engine = genengine.create_engine(backend="transformers", model=str(path), dtype=dtype, options=options)
    else:
        lora: dict[str, Any] = {"enable_lora": True, "max_lora_rank": args.rank}
        if args.backend == "sglang":
            lora["lora_target_modules"] = list(TARGETS)
        else:
            lora["max_loras"] = 2
        engine = genengine.create_engine(
            backend=args.backend, model=str(path), dtype=dtype, mem_util=args.mem_util, options=lora
        )
    try:
        if args.adapter_sync is not None:
            if not hasattr(engine, "adapter_sync"):
                parser.error(f"--adapter-sync: the {args.backend} backend has one way to load adapters")
            engine.adapter_sync = args.adapter_sync  # type: ignore[attr-defined]
        from safetensors.torch import load_file

        trainer: dict[str, Any] = {}  # the trainer's own copy of the base, where it trains
        for file in sorted(path.glob("*.safetensors")):
            trainer.update({n: t.to(device) for n, t in load_file(str(file)).items()})
        gen = torch.Generator(device=device).manual_seed(0)
        adapter: dict[str, Any] = {}
        for name, weight in trainer.items():
            module = name.removesuffix(".weight")
            if weight.dim() == 2 and module.rpartition(".")[2] in TARGETS:
                out_f, in_f = weight.shape
                tdtype = weight.dtype
                a = torch.randn((args.rank, in_f), generator=gen, device=device, dtype=tdtype) * 0.01
                b = torch.randn((out_f, args.rank), generator=gen, device=device, dtype=tdtype) * 0.01
                adapter[f"base_model.model.{module}.lora_A.weight"] = a
                adapter[f"base_model.model.{module}.lora_B.weight"] = b
        config = {"r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": list(TARGETS)}
        scale = 2.0

        phases: list[dict[str, float]] = []

        def adapter_sync(step: int) -> None:
            info = engine.load_adapter("policy", adapter.items(), config, version=step)  # type: ignore[attr-defined]
            if step > 0:  # not the warm-up
                phases.append(dict(info.phases))

        def merge_sync(step: int) -> None:
            with torch.no_grad():
                for key, a in adapter.items():
                    if ".lora_A." in key:
                        module = key.removeprefix("base_model.model.").partition(".lora_A.")[0]
                        b = adapter[key.replace(".lora_A.", ".lora_B.")]
                        trainer[f"{module}.weight"].add_(b @ a, alpha=scale)
                engine.load_weights(list(trainer.items()), version=step)
                for key, a in adapter.items():
                    if ".lora_A." in key:
                        module = key.removeprefix("base_model.model.").partition(".lora_A.")[0]
                        b = adapter[key.replace(".lora_A.", ".lora_B.")]
                        trainer[f"{module}.weight"].sub_(b @ a, alpha=scale)

        result: dict[str, Any] = {
            "device": torch.cuda.get_device_name() if not tiny else "cpu",
            "backend": "transformers" if tiny else args.backend,
            "base_params": sum(t.numel() for t in trainer.values()),
            "adapter_tensors": len(adapter),
            "adapter_bytes": sum(t.numel() * t.element_size() for t in adapter.values()),
            "rank": args.rank,
        }
        for side, call in (("adapter", adapter_sync), ("merge", merge_sync)):
            call(0)  # warm-up
            runs = [_peak_over(device, lambda step=step, call=call: call(step)) for step in range(1, args.reps + 1)]
            result[f"{side}_s"] = statistics.median(s for s, _, _ in runs)
            result[f"{side}_extra_gib"] = max(m for _, m, _ in runs) / (1 << 30)  # this process's allocator peak
            result[f"{side}_free_drop_gib"] = max(f for _, _, f in runs) / (1 << 30)  # the device, after the sync
        result["adapter_sync_mode"] = getattr(engine, "adapter_sync", "peft")
        result["adapter_phases"] = phase_medians(phases)
        probe = engine.generate(
            prompt_token_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 4, "adapter": "policy"}
        )
        result["adapter_served"] = bool(probe[0].outputs[0].token_ids)

        def one_token() -> None:
            engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 1, "adapter": "policy"})

        # What an engine leaves to the first batch that uses a new adapter (SGLang copies it into its GPU pool
        # then): a one-token generate right after a sync, against the same generate again.
        first, warm = [], []
        for step in range(args.reps):
            adapter_sync(args.reps + 1 + step)
            first.append(_peak_over(device, one_token)[0])
            warm.append(_peak_over(device, one_token)[0])
        result["adapter_first_use_s"] = statistics.median(first)
        result["adapter_warm_use_s"] = statistics.median(warm)
        result["goal_10ms"] = result["adapter_s"] <= 0.010
    finally:
        engine.shutdown()
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
