"""The RL demo with asynchronous rollouts: generation runs ahead of the trainer by one weight version.

Completion lengths are long-tailed (lognormal around ``max_new_tokens``, capped at 4x). A pool of requests
stays in flight; each step trains on the first groups to finish, and the rest go on generating.

While the trainer steps on batch k, batch k+1 is already being generated with weights k. After the step the
engine pauses (``keep``), takes the new weights as version k+1 and resumes: batch k+1's samples carry their
partial tokens across the update, and ``weight_versions`` says where each switched. The engine's logprobs
are the behaviour policy's, so the PPO ratio weighs the off-policy part. No sleep: requests are in flight
the whole time (what a run on separate or spare GPUs does). ``run_async_demo`` also runs the synchronous
demo on the same settings and plots both reward curves in one PNG.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from genengine.cli.demos.sync import (
    PROMPTS,
    DemoConfig,
    DemoResult,
    StepStats,
    Trainer,
    pick_target,
    rewards_and_advantages,
    run_demo,
    running_mean,
    train_step,
)
from genengine.protocol import GenerationResult, SamplingParams, is_async_engine

__all__ = ["AsyncDemoResult", "run_async_demo"]


@dataclass(frozen=True)
class AsyncDemoResult:
    sync: DemoResult | None
    rollout: DemoResult
    """The async run; its ``sync_ms`` is the pause → load_weights → resume gap."""
    carried: int
    """Samples that started on one weight version and finished on the next."""
    plot: str | None


def run_async_demo(
    cfg: DemoConfig | None = None, *, with_sync: bool = True, echo: Callable[[str], None] | None = None
) -> AsyncDemoResult:
    """The async loop (and, with ``with_sync``, the synchronous one on the same settings, for the plot)."""
    cfg = cfg or DemoConfig()
    cfg.check()
    cfg.check_engine()
    import torch

    say = echo or print
    sync = run_demo(replace(cfg, plot=None), echo=echo) if with_sync else None
    threads = torch.get_num_threads()
    if cfg.cpu_threads is not None:
        torch.set_num_threads(cfg.cpu_threads)
    try:
        rollout, carried = asyncio.run(_run(cfg, say))
    finally:
        torch.set_num_threads(threads)
    plot = _plot(sync, rollout, cfg) if cfg.plot else None
    say(
        f"async reward: first quarter mean {rollout.first_quarter:.3f} -> last quarter mean {rollout.last_quarter:.3f} "
        f"in {rollout.seconds:.1f} s; {carried} samples carried across a weight update"
        + (f"; sync run: {sync.first_quarter:.3f} -> {sync.last_quarter:.3f} in {sync.seconds:.1f} s" if sync else "")
        + (f"; plot: {plot}" if plot else "")
    )
    return AsyncDemoResult(sync, rollout, carried, plot)


async def _run(cfg: DemoConfig, say: Callable[[str], None]) -> tuple[DemoResult, int]:

    from genengine.plugins.registry import create_engine

    start = time.perf_counter()
    t = Trainer.build(cfg)
    model, dtype, trainer_device, rng = t.model, t.dtype, t.device, t.rng
    tokenizer, policy, optimizer, pad = t.tokenizer, t.policy, t.optimizer, t.pad

    engine: Any = create_engine(backend=cfg.backend, model=model, dtype=dtype, seed=cfg.seed, **cfg.options)
    if not is_async_engine(engine):
        engine.shutdown()
        raise ValueError(f"backend={cfg.backend!r} does not offer the async capability")
    stats: list[StepStats] = []
    carried = 0
    try:
        target, target_text = pick_target(engine, tokenizer, cfg.max_new_tokens)
        say(f"genengine demo --async: backend={cfg.backend} reward = share of tokens equal to {target_text!r}")
        say(f"{'step':>4}  {'reward':>6}  {'tokens/s':>9}  {'update ms':>9}  {'carried':>7}  {'|Δlogp|':>8}")

        counter = 0
        pool: list[tuple[asyncio.Task[GenerationResult], int]] = []  # (request, weight version it started on)
        extra = max(1, cfg.prompts_per_step // 2)

        def top_up(version: int) -> None:
            nonlocal counter
            while len(pool) < cfg.prompts_per_step + extra:
                # Long-tailed lengths, as RL rollouts have: the stragglers are what partial rollouts carry over.
                length = min(4 * cfg.max_new_tokens, max(2, round(cfg.max_new_tokens * rng.lognormvariate(0, 0.6))))
                params = SamplingParams(
                    temperature=1.0,
                    max_new_tokens=length,
                    n=cfg.group_size,
                    seed=cfg.seed * 100_003 + counter,
                    logprobs=True,
                    ignore_eos=True,
                )
                counter += 1
                pool.append((asyncio.ensure_future(engine.generate_async(rng.choice(PROMPTS), params)), version))

        version = 0
        top_up(version)
        t0 = time.perf_counter()
        for step in range(cfg.steps):
            # The first groups to finish make the batch; the others go on generating (partial rollouts).
            results: list[GenerationResult] = []
            while len(results) < cfg.prompts_per_step:
                ready = [item for item in pool if item[0].done()]
                if not ready:
                    await asyncio.wait([task for task, _ in pool], return_when=asyncio.FIRST_COMPLETED)
                    continue
                for item in ready[: cfg.prompts_per_step - len(results)]:
                    pool.remove(item)
                    results.append(item[0].result())
            gen_seconds = time.perf_counter() - t0
            t0 = time.perf_counter()
            top_up(version)  # generated with these weights while the trainer steps
            samples = [(r.prompt_token_ids, o.token_ids, o.logprobs or []) for r in results for o in r.outputs]
            switched = sum(len(o.weight_versions) > 1 for r in results for o in r.outputs)
            carried += switched
            rewards, adv = rewards_and_advantages(samples, target, cfg.group_size)
            step_args = (policy, optimizer, samples, adv, pad, trainer_device)
            gap = await asyncio.to_thread(functools.partial(train_step, *step_args, decoupled=True))
            t1 = time.perf_counter()
            await engine.pause_generation("keep")
            version += 1
            engine.load_weights(policy.state_dict().items(), version=version)
            await engine.resume_generation()
            update_ms = (time.perf_counter() - t1) * 1000
            # At most one version behind the policy that trains on them: older stragglers are dropped.
            stale = [item for item in pool if item[1] < version - 1]
            for item in stale:
                pool.remove(item)
                item[0].cancel()
            tokens = sum(len(toks) for _, toks, _ in samples)
            s = StepStats(step, float(rewards.mean()), tokens / max(gen_seconds, 1e-9), update_ms, 0, gap)
            stats.append(s)
            say(
                f"{s.step:>4}  {s.reward:>6.3f}  {s.tokens_per_s:>9.0f}  {s.sync_ms:>9.1f}  {switched:>7}  "
                f"{s.logprob_gap:>8.1e}"
            )
    finally:
        await engine.abort()
        engine.shutdown()
    return DemoResult(stats, target, target_text, time.perf_counter() - start, None), carried


def _plot(sync: DemoResult | None, rollout: DemoResult, cfg: DemoConfig) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    assert cfg.plot is not None
    path = Path(cfg.plot)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    runs = [("async rollouts (one version ahead)", rollout)] + ([("synchronous", sync)] if sync else [])
    for label, run in runs:
        steps = [s.step for s in run.steps]
        rewards = [s.reward for s in run.steps]
        _, smooth = running_mean(rewards)
        (line,) = ax.plot(steps, smooth, linewidth=2.5, label=f"{label}: {run.seconds:.0f} s")
        ax.plot(steps, rewards, marker="o", markersize=2, linewidth=0.8, alpha=0.4, color=line.get_color())
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"share of tokens = {rollout.target_text!r}")
    ax.set_ylim(0, 1)
    ax.set_title(f"genengine demo --async ({cfg.backend}): reward per step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
