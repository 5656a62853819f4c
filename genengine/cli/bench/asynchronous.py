"""``genengine bench --async``: partial rollouts against the synchronous ``generate`` on a long-tailed batch.

RL rollouts are long-tailed: most samples are short, a few run to the length cap, and a synchronous step
waits for its longest one. Both runs here play the same trainer: ``steps`` steps, each collecting
``batch_size`` finished samples and then taking the trainer's weights (``load_weights`` with the next
version). The samples come from one stream of jobs (random prompt ids, an output length drawn from a
lognormal, capped at ``max_new_tokens``, forced with ``ignore_eos``), so both runs see the same lengths:

* **sync**: each step is one ``generate`` on the next ``batch_size`` jobs, then ``load_weights``.
* **async** (partial rollouts, as APRIL and slime do): ``ceil(batch_size * oversample)`` requests stay in
  flight; a step ends when ``batch_size`` have finished since the last one; then ``pause_generation("keep")``
  → ``load_weights`` → ``resume_generation``, and the stragglers go on under the new weights (their
  ``weight_versions`` say where). Requests still running after the last step are aborted.

Reported: both wall times and their ratio (the goal is async ≤ 0.7× sync), the pause → load → resume gap
of each step, and how many collected tokens were sampled under an older weight version than the one their
sample finished with (the off-policy share a trainer masks or importance-weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from genengine.errors import ConfigError, InvalidArgumentError
from genengine.protocol import is_async_engine

if TYPE_CHECKING:
    import torch

    from genengine.protocol import GenerationResult

__all__ = ["AsyncBenchSettings", "format_async_report", "lognormal_lengths", "run_async_bench"]

Weights = Callable[[], Iterable[tuple[str, "torch.Tensor"]]]


@dataclass
class AsyncBenchSettings:
    """What to measure. The defaults take about half a minute on a two-core CPU with the tiny model."""

    backend: Any = "transformers"
    model: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    dtype: str | None = None
    mem_util: float | None = None
    batch_size: int = 16
    """Finished samples the trainer takes per step."""
    steps: int = 4
    oversample: float = 1.5
    """Requests kept in flight in the async run, as a multiple of ``batch_size``."""
    prompt_len: int = 32
    median_new_tokens: int = 16
    sigma: float = 1.0
    """Spread of the lognormal output lengths (1.0: the longest of 64 samples is about 10x the median)."""
    max_new_tokens: int = 256
    """The length cap (the issue's long-tail batch uses 4096 on the GPU)."""
    seed: int = 0

    def check(self) -> None:
        """Reject bad settings before anything is built or loaded."""
        for name in ("batch_size", "steps", "prompt_len", "median_new_tokens", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name}={value!r} must be an integer >= 1")
        for name, low in (("oversample", 1.0), ("sigma", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidArgumentError(f"{name}={value!r} must be a finite number >= {low}")
            if value < low:
                raise InvalidArgumentError(f"{name}={value!r} must be >= {low}")
        if self.model is not None and not os.path.isdir(self.model):
            raise ConfigError(f"model={self.model!r} is not a local model folder")
        if self.median_new_tokens > self.max_new_tokens:
            raise InvalidArgumentError(
                f"median_new_tokens={self.median_new_tokens} must be <= max_new_tokens={self.max_new_tokens}"
            )


def lognormal_lengths(count: int, median: int, sigma: float, cap: int, seed: int) -> list[int]:
    """``count`` output lengths, lognormal around ``median``, each in [1, cap]: the long tail of RL rollouts."""
    rnd = random.Random(seed)
    return [min(cap, max(1, round(median * math.exp(sigma * rnd.gauss(0.0, 1.0))))) for _ in range(count)]


@dataclass(frozen=True)
class _Job:
    index: int
    prompt: list[int]
    params: Any  # SamplingParams


def _jobs(settings: AsyncBenchSettings, vocab: int) -> Iterator[_Job]:
    """The endless stream of samples both runs draw from, in the same order."""
    from genengine.protocol import SamplingParams

    rnd = random.Random(settings.seed)
    block = 0
    while True:
        lengths = lognormal_lengths(
            1024, settings.median_new_tokens, settings.sigma, settings.max_new_tokens, settings.seed + 1 + block
        )
        for i, length in enumerate(lengths):
            index = block * 1024 + i
            prompt = [rnd.randrange(1, vocab) for _ in range(settings.prompt_len)]
            params = SamplingParams(max_new_tokens=length, temperature=1.0, ignore_eos=True)
            yield _Job(index, prompt, params)
        block += 1


def run_async_bench(
    settings: AsyncBenchSettings, *, weights: Weights | None = None, engine: Any = None
) -> dict[str, Any]:
    """Run both loops on one engine and return the report (plain JSON-able data).

    ``weights`` gives the trainer's tensors for each ``load_weights`` (default: the checkpoint's, read once);
    ``engine`` measures an engine the caller built (it is not shut down) instead of creating one.
    """
    settings.check()
    with contextlib.ExitStack() as stack:
        if engine is None:
            from genengine.cli.bench.measure import resolve_backend

            resolve_backend(settings.backend)  # a bad name fails before the model is built
            from genengine.config import EngineConfig
            from genengine.plugins.registry import create_engine

            model = settings.model
            if model is None:
                from genengine.models.tiny_model import build_tiny_model

                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="genengine-bench-async-"))
                model = str(build_tiny_model(Path(tmp) / "model"))
            fields: dict[str, Any] = {"backend": settings.backend, "model": model, "seed": settings.seed}
            if settings.dtype is not None:
                fields["dtype"] = settings.dtype
            if settings.mem_util is not None:
                fields["mem_util"] = settings.mem_util
            engine = create_engine(EngineConfig(options=dict(settings.options), **fields))
            stack.callback(engine.shutdown)
            if weights is None:
                from genengine.cli.bench.measure import trainer_weights

                tensors = trainer_weights(model, "cpu", settings.dtype)
                weights = lambda: tensors.items()  # noqa: E731
        if not is_async_engine(engine):
            raise ConfigError(
                f"backend {settings.backend!r} ({type(engine).__name__}) does not declare supports_async: "
                "genengine bench --async needs the async capability"
            )
        if weights is None:
            raise InvalidArgumentError("weights= is needed with an engine the caller built")
        vocab = _vocab(engine)
        # Warm-up (kernels, allocator, the scheduler thread): one short batch of each kind, untimed.
        warm = list(itertools.islice(_jobs(settings, vocab), 4))
        engine.generate(prompt_token_ids=[j.prompt for j in warm], sampling_params=[j.params for j in warm])
        asyncio.run(_warm_async(engine, warm))
        version = engine.weight_version
        sync = _sync_run(engine, settings, vocab, weights, version)
        version = engine.weight_version
        asyncr = asyncio.run(_async_run(engine, settings, vocab, weights, version))
    report: dict[str, Any] = {
        "backend": str(settings.backend),
        "engine": type(engine).__name__,
        "settings": {
            k: getattr(settings, k)
            for k in (
                "batch_size",
                "steps",
                "oversample",
                "prompt_len",
                "median_new_tokens",
                "sigma",
                "max_new_tokens",
                "seed",
            )
        },
        "sync": sync,
        "async": asyncr,
        "ratio": asyncr["seconds"] / sync["seconds"],
    }
    return report


def _vocab(engine: Any) -> int:
    """The id range the random prompts draw from (an engine that does not say: the first 1000 ids)."""
    vocab = engine._vocab_size() if hasattr(engine, "_vocab_size") else None
    return int(vocab) if vocab else 1000


async def _warm_async(engine: Any, jobs: list[_Job]) -> None:
    await asyncio.gather(*(engine.generate_async(prompt_token_ids=j.prompt, sampling_params=j.params) for j in jobs))


def _sync_run(engine: Any, s: AsyncBenchSettings, vocab: int, weights: Weights, version: int) -> dict[str, Any]:
    jobs = _jobs(s, vocab)
    steps: list[float] = []
    loads: list[float] = []
    tokens = 0
    start = time.perf_counter()
    for step in range(s.steps):
        batch = [next(jobs) for _ in range(s.batch_size)]
        t = time.perf_counter()
        results = engine.generate(prompt_token_ids=[j.prompt for j in batch], sampling_params=[j.params for j in batch])
        tokens += sum(len(o.token_ids) for r in results for o in r.outputs)
        t_load = time.perf_counter()
        engine.load_weights(weights(), version=version + step + 1)
        loads.append(time.perf_counter() - t_load)
        steps.append(time.perf_counter() - t)
    return {
        "seconds": time.perf_counter() - start,
        "step_seconds": steps,
        "load_seconds": loads,
        "samples": s.steps * s.batch_size,
        "tokens": tokens,
    }


async def _async_run(engine: Any, s: AsyncBenchSettings, vocab: int, weights: Weights, version: int) -> dict[str, Any]:
    jobs = _jobs(s, vocab)
    in_flight = math.ceil(s.batch_size * s.oversample)
    pending: set[asyncio.Task[GenerationResult]] = set()

    def submit() -> None:
        job = next(jobs)
        pending.add(
            asyncio.ensure_future(engine.generate_async(prompt_token_ids=job.prompt, sampling_params=job.params))
        )

    collected: list[GenerationResult] = []
    finished: list[GenerationResult] = []
    gaps: list[float] = []
    parts: dict[str, list[float]] = {"pause": [], "load": [], "resume": []}
    steps: list[float] = []
    start = time.perf_counter()
    for _ in range(in_flight):
        submit()
    for step in range(s.steps):
        t = time.perf_counter()
        while len(finished) < s.batch_size:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                pending.discard(task)
                finished.append(task.result())
                submit()
        collected.extend(finished[: s.batch_size])
        del finished[: s.batch_size]
        t_pause = time.perf_counter()
        await engine.pause_generation("keep")
        t_load = time.perf_counter()
        engine.load_weights(weights(), version=version + step + 1)
        t_resume = time.perf_counter()
        await engine.resume_generation()
        t_end = time.perf_counter()
        gaps.append(t_end - t_pause)
        for name, secs in (("pause", t_load - t_pause), ("load", t_resume - t_load), ("resume", t_end - t_resume)):
            parts[name].append(secs)
        steps.append(time.perf_counter() - t)
    seconds = time.perf_counter() - start
    await engine.abort()
    leftover = await asyncio.gather(*pending)
    tokens = sum(len(o.token_ids) for r in collected for o in r.outputs)
    off_policy = sum(_older_tokens(o.weight_versions, len(o.token_ids)) for r in collected for o in r.outputs)
    return {
        "seconds": seconds,
        "step_seconds": steps,
        "pause_load_resume_seconds": gaps,
        "pause_load_resume_median": statistics.median(gaps),
        "pause_load_resume_max": max(gaps),
        "pause_load_resume_parts": parts,  # where a gap over the goal goes: the pause, the load or the resume
        "samples": len(collected),
        "tokens": tokens,
        "off_policy_tokens": off_policy,
        "carried_samples": sum(1 for r in collected for o in r.outputs if len(o.weight_versions) > 1),
        "aborted_at_end": len(leftover),
        "in_flight": in_flight,
    }


def _older_tokens(versions: tuple[tuple[int, int], ...], length: int) -> int:
    """Tokens sampled before the sample's last weight version started."""
    return min(versions[-1][0], length) if versions else 0


def format_async_report(report: Mapping[str, Any]) -> str:
    """The report as a small table."""
    sync, asy, cfg = report["sync"], report["async"], report["settings"]
    rows = [
        ("backend", f"{report['backend']} ({report['engine']})"),
        (
            "workload",
            f"{cfg['steps']} steps x {cfg['batch_size']} samples, lengths lognormal(median {cfg['median_new_tokens']}, "
            f"sigma {cfg['sigma']}) capped at {cfg['max_new_tokens']}, prompts of {cfg['prompt_len']}",
        ),
        ("sync generate + load", f"{sync['seconds']:.2f} s ({sync['tokens']} tokens)"),
        (
            "async partial rollouts",
            f"{asy['seconds']:.2f} s ({asy['tokens']} tokens collected; {asy['in_flight']} in flight)",
        ),
        ("async / sync", f"{report['ratio']:.3f} (goal <= 0.7)"),
        (
            "pause -> load -> resume",
            f"median {asy['pause_load_resume_median']:.4f} s, max {asy['pause_load_resume_max']:.4f} s "
            "(medians: "
            + ", ".join(f"{k} {statistics.median(v):.4f} s" for k, v in asy["pause_load_resume_parts"].items())
            + ")",
        ),
        (
            "carried over an update",
            f"{asy['carried_samples']} of {asy['samples']} samples; {asy['off_policy_tokens']} of {asy['tokens']} "
            "tokens sampled under an older version",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
