"""The embedded backend vs plain transformers ``generate``: same model, same prompts, same run.

    .venv/bin/python benchmarks/bench_embedded.py [--model DIR] [--dtype float32] [--batch 16]
        [--max-new-tokens 64] [--repeats 7] [--threads N] [--json PATH]
        [--stop-batch 8] [--stop-max-new-tokens 900] [--stop-repeats 5] [--stop-only]

Both sides load the model in this process (float32 on the CPU by default). Each repetition runs the
engine and ``generate`` back to back, alternating which goes first, so machine noise hits both alike;
the figure is the ratio of the medians of output tokens/s (goal: >= 1.0). Scenarios: greedy, and
temperature-1 sampling with top-p 0.9. Every output has exactly ``--max-new-tokens`` tokens on both
sides (EOS ignored), and the engine's prompt cache is flushed before each of its runs, so prefill is
counted for both.

Then the cost of stop strings (issue 15): the engine alone, greedy on ``--stop-batch`` prompts of
``--stop-max-new-tokens`` tokens, with one stop string that never matches and without, alternated the same
way; the figure is the ratio of the median times, with / without (goal: <= 1.05). ``--stop-only`` runs only
this part. Last, ``load_weights`` of the checkpoint with ``check_finite=True`` and without (its cost).
Prints a table and ``BENCH_EMBEDDED_RESULT {json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

for _key, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)


T = TypeVar("T")

_NEVER = "\x00never\x00"
"""The stop string of the stop-string runs: every output still runs to its length (checked)."""


def _prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(3, vocab) for _ in range(rnd.randint(8, 40))] for _ in range(batch)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the tiny random Qwen2 model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the result as JSON here")
    p.add_argument("--stop-batch", type=int, default=8)
    p.add_argument("--stop-max-new-tokens", type=int, default=900)
    p.add_argument("--stop-repeats", type=int, default=5)
    p.add_argument("--stop-only", action="store_true", help="only the stop-string ratio")
    args = p.parse_args(argv)

    import torch
    import transformers

    from genengine.backends.transformers.engine import TransformersEngine
    from genengine.models.tiny_model import tiny_model_dir
    from genengine.protocol import SamplingParams

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    model_dir = args.model or str(tiny_model_dir())
    engine = TransformersEngine(model_dir, dtype=args.dtype, device=args.device, max_batch_size=max(64, args.batch))
    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    hf.to(args.device).eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos: every row runs max_new_tokens
    vocab = int(hf.config.vocab_size)
    prompts = _prompts(args.batch, vocab, args.seed)
    width = max(len(x) for x in prompts)
    input_ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for b, ids in enumerate(prompts):
        input_ids[b, width - len(ids) :] = torch.tensor(ids)
        mask[b, width - len(ids) :] = 1
    input_ids, mask = input_ids.to(args.device), mask.to(args.device)
    expected = len(prompts) * args.max_new_tokens

    scenarios = {
        "greedy": (
            SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=True),
            {"do_sample": False},
        ),
        "sample T=1 top-p 0.9": (
            SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=1),
            {"do_sample": True, "temperature": 1.0, "top_p": 0.9, "top_k": 0},
        ),
    }

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def run_engine(params: SamplingParams) -> float:
        engine.flush_cache()
        sync()
        t = time.perf_counter()
        results = engine.generate(prompt_token_ids=prompts, sampling_params=params)
        sync()
        seconds = time.perf_counter() - t
        assert sum(len(r.outputs[0].token_ids) for r in results) == expected
        return expected / seconds

    def run_hf(kwargs: dict[str, Any]) -> float:
        gen = transformers.GenerationConfig(
            max_new_tokens=args.max_new_tokens, min_new_tokens=0, pad_token_id=0, **kwargs
        )
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids=input_ids, attention_mask=mask, generation_config=gen)
        sync()
        seconds = time.perf_counter() - t
        assert (out.shape[1] - width) * out.shape[0] == expected
        return expected / seconds

    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads "
        f"{torch.get_num_threads()}, torch {torch.__version__}, transformers {transformers.__version__}",
        "command": "python " + " ".join([os.path.relpath(__file__), *(argv if argv is not None else sys.argv[1:])]),
        "model": model_dir if args.model else "tiny random Qwen2 (hidden 256, 2 layers, vocab 512)",
        "dtype": args.dtype,
        "device": args.device,
        "batch": args.batch,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "scenarios": {},
    }
    if not args.stop_only:
        print(f"{'scenario':<22} {'engine tok/s':>13} {'HF generate tok/s':>18} {'ratio':>6}")
    for name, (params, hf_kwargs) in scenarios.items() if not args.stop_only else ():
        ours, theirs = _alternated(partial(run_engine, params), partial(run_hf, hf_kwargs), args.repeats)
        a, b = statistics.median(ours), statistics.median(theirs)
        report["scenarios"][name] = {
            "engine_tokens_per_s": round(a, 1),
            "hf_generate_tokens_per_s": round(b, 1),
            "ratio": round(a / b, 3),
            "engine_runs": [round(x, 1) for x in ours],
            "hf_runs": [round(x, 1) for x in theirs],
        }
        print(f"{name:<22} {a:>13.0f} {b:>18.0f} {a / b:>6.2f}")
    report["stop_strings"] = _stop_ratio(engine, args, vocab, sync)
    if not args.stop_only:
        report["check_finite"] = _finite_cost(engine, model_dir, args.repeats)
    engine.shutdown()
    print("BENCH_EMBEDDED_RESULT " + json.dumps(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
    return 0


def _alternated(first: Callable[[], T], second: Callable[[], T], repeats: int) -> tuple[list[T], list[T]]:
    """Both after a warm-up each, then ``repeats`` pairs back to back, alternating which goes first, so that
    machine noise hits both alike."""
    first()
    second()
    a: list[T] = []
    b: list[T] = []
    for rep in range(repeats):
        if rep % 2 == 0:
            a.append(first())
            b.append(second())
        else:
            b.append(second())
            a.append(first())
    return a, b


def _stop_ratio(engine: Any, args: argparse.Namespace, vocab: int, sync: Any) -> dict[str, Any]:
    """Greedy batches with one never-matching stop string and without, alternated: the ratio with / without.

    Wall seconds as in issue 15, and this process's CPU seconds beside them: on a shared machine other jobs'
    load stretches wall time run by run, CPU time much less. Each pair runs back to back, so the median of
    the pairs' ratios is given too.
    """
    from genengine.protocol import SamplingParams

    prompts = _prompts(args.stop_batch, vocab, args.seed + 1)
    plain = SamplingParams(temperature=0.0, max_new_tokens=args.stop_max_new_tokens, ignore_eos=True)
    stopped = dataclasses.replace(plain, stop=(_NEVER,))
    expected = len(prompts) * args.stop_max_new_tokens

    def run(params: SamplingParams) -> tuple[float, float]:
        engine.flush_cache()
        sync()
        wall, cpu = time.perf_counter(), time.process_time()
        results = engine.generate(prompt_token_ids=prompts, sampling_params=params)
        sync()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert sum(len(r.outputs[0].token_ids) for r in results) == expected, "the stop string matched"
        return wall, cpu

    without, with_stop = _alternated(lambda: run(plain), lambda: run(stopped), args.stop_repeats)
    out: dict[str, Any] = {"batch": len(prompts), "max_new_tokens": args.stop_max_new_tokens}
    out["repeats"] = args.stop_repeats
    shape = f"{len(prompts)} x {args.stop_max_new_tokens} greedy tokens"
    for i, clock in enumerate(("wall", "cpu")):
        yes, no = [x[i] for x in with_stop], [x[i] for x in without]
        a, b = statistics.median(yes), statistics.median(no)
        paired = statistics.median(y / n for y, n in zip(yes, no, strict=True))
        out[clock] = {
            "seconds_with_stop": round(a, 3),
            "seconds_without": round(b, 3),
            "ratio": round(a / b, 3),
            "paired_ratio": round(paired, 3),
            "runs_with_stop": [round(x, 3) for x in yes],
            "runs_without": [round(x, 3) for x in no],
        }
        print(
            f"stop string, {shape}, {clock} s: {a:.3f} with, {b:.3f} without, ratio {a / b:.3f}, "
            f"paired {paired:.3f} (goal <= 1.05)"
        )
    return out


def _finite_cost(engine: Any, model_dir: str, repeats: int) -> dict[str, Any]:
    """``load_weights`` of the whole checkpoint with ``check_finite=True`` and without, alternated: what the
    opt-in NaN/inf check costs (it reads every tensor once)."""
    from genengine.testing.conformance import load_checkpoint

    weights = load_checkpoint(model_dir)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())

    def run(check: bool) -> float:
        return float(engine.load_weights(weights, check_finite=check).seconds)

    on, off = _alternated(lambda: run(True), lambda: run(False), repeats)
    a, b = statistics.median(on), statistics.median(off)
    print(
        f"load_weights of {nbytes / 2**20:.1f} MiB: {a * 1e3:.2f} ms with check_finite, "
        f"{b * 1e3:.2f} ms without, ratio {a / b:.3f}"
    )
    return {
        "mib": round(nbytes / 2**20, 1),
        "seconds_with": round(a, 5),
        "seconds_without": round(b, 5),
        "ratio": round(a / b, 3),
    }


if __name__ == "__main__":
    sys.exit(main())
