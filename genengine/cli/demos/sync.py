"""A small RL loop that uses nothing but the protocol: what a trainer does with a colocated engine each step.

generate rollouts (with processed logprobs) → reward → engine.sleep → one GRPO-style optimizer step on the
trainer's own HF copy of the model → wake(["weights"]) → load_weights(trainer state_dict) →
wake(["kv_cache"]). The reward is the fraction of completion tokens equal to a target token (the one the
untrained model emits most often, so it starts low but not at zero); it rises within a minute on a CPU.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genengine.engine.environ import malloc_trim
from genengine.errors import ConfigError, InvalidArgumentError
from genengine.plugins.optional import PLOT_INSTALL, plot_unavailable
from genengine.protocol import SamplingParams

__all__ = [
    "PROMPTS",
    "TRL_PROMPTS",
    "DemoConfig",
    "DemoResult",
    "StepStats",
    "pick_target",
    "rewards_and_advantages",
    "run_demo",
    "train_step",
]

PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "In a distant galaxy far away",
    "Hello",
    "the answer is",
    "write a story about",
    "one two three",
    "where did the old man go",
    "people say that",
    "my name is",
    "a little water",
    "every day we",
    "think about the number",
    "before the end of the day",
    "she said that the dog",
    "what time is it",
]
"""The demo's 16 prompts (each step samples ``prompts_per_step`` of them)."""
TRL_PROMPTS = [PROMPTS[i] for i in (0, 1, 3, 4, 5, 6, 9, 15, 2, 7, 8, 10, 11, 12, 13, 14)]
"""The same prompts in the order TRL's example and tests train on them (TRL reads its dataset in order, and the
learning figures of tests/integrations/test_trl.py were measured with this one)."""


@dataclass
class DemoConfig:
    """Everything the demo can be told; the defaults run on a CPU in about half a minute."""

    backend: str = "transformers"
    model: str | None = None
    """A model directory; None builds the tiny random Qwen2 model."""
    steps: int = 40
    prompts_per_step: int = 8
    group_size: int = 8
    """Samples per prompt: the group whose mean reward is each sample's baseline (GRPO)."""
    max_new_tokens: int = 16
    lr: float = 1e-3
    seed: int = 0
    sleep_level: int = 2
    dtype: str | None = None
    """Engine dtype; None is float32 for the embedded backend (exact logprobs) and bfloat16 otherwise."""
    trainer_device: str | None = None
    """None: cuda when the engine runs on a GPU (SGLang, vLLM, or ``device=cuda``), else cpu."""
    options: dict[str, Any] = field(default_factory=dict)
    cpu_threads: int | None = 1
    """torch CPU threads while the demo runs (restored after). One: the tiny model is too small for
    intra-op parallelism to pay, and two spinning threads slow down twentyfold on a busy 2-core machine."""
    plot: str | None = "out/demo_reward.png"
    progress: bool = True

    def check(self) -> None:
        """Reject bad settings, a model folder that is not one, and a plot without matplotlib, before any work."""
        for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name}={value!r} must be a positive integer")
        if self.group_size < 2:
            raise InvalidArgumentError(f"group_size={self.group_size} must be >= 2 (the group mean is the baseline)")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise InvalidArgumentError(f"lr={self.lr!r} must be a positive number")
        if self.cpu_threads is not None and (
            isinstance(self.cpu_threads, bool) or not isinstance(self.cpu_threads, int) or self.cpu_threads < 1
        ):
            raise InvalidArgumentError(f"cpu_threads={self.cpu_threads!r} must be a positive integer or None")
        if self.sleep_level not in (1, 2):
            raise InvalidArgumentError(f"sleep_level={self.sleep_level!r}: allowed are 1 and 2")
        if self.model is not None and not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ConfigError(
                f"model={self.model!r} is not a model directory (no config.json there): the demo's trainer and "
                "engine load it from disk"
            )
        if self.plot:
            why = plot_unavailable()
            if why is not None:
                raise InvalidArgumentError(
                    f"plot={self.plot!r} needs matplotlib ({why}): {PLOT_INSTALL}, or no plot (plot=None, --no-plot)"
                )

    @property
    def engine_dtype(self) -> str:
        """``dtype``, or float32 for the embedded backend (exact logprobs) and bfloat16 for the others."""
        return self.dtype or ("bfloat16" if self.backend != "transformers" else "float32")

    def check_engine(self) -> None:
        """What ``create_engine`` would refuse in these settings (backend, options), before the model is built."""
        from genengine.plugins.registry import check_engine_config

        check_engine_config(
            backend=self.backend, model=self.model, dtype=self.engine_dtype, seed=self.seed, **self.options
        )


@dataclass(frozen=True)
class StepStats:
    step: int
    reward: float
    tokens_per_s: float
    sync_ms: float
    """wake(weights) + load_weights + wake(kv_cache), as the trainer waits for it."""
    freed_bytes: int
    """Memory the engine's sleep gave back (GPU free memory on CUDA, process RSS on CPU)."""
    logprob_gap: float
    """Mean |trainer logprob - engine logprob| on the rollout tokens: how far the engine is from the trainer."""


@dataclass(frozen=True)
class DemoResult:
    steps: list[StepStats]
    target_token: int
    target_text: str
    seconds: float
    plot: str | None

    @property
    def first_quarter(self) -> float:
        k = max(1, len(self.steps) // 4)
        return sum(s.reward for s in self.steps[:k]) / k

    @property
    def last_quarter(self) -> float:
        k = max(1, len(self.steps) // 4)
        return sum(s.reward for s in self.steps[-k:]) / k


def _rss() -> int:
    """Resident memory of this process (anonymous and file-backed: weights may be mapped from safetensors)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _free_memory(device: str) -> int:
    """What sleeping should raise: free GPU memory on CUDA; minus the RSS on CPU.

    On CPU, freed-but-cached heap pages are returned first, so the difference is the sleep's own doing.
    """
    import gc

    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()
        return int(torch.cuda.mem_get_info()[0])
    gc.collect()
    malloc_trim()
    return -_rss()


def _engine_device(cfg: DemoConfig) -> str:
    if cfg.backend == "transformers":
        return str(cfg.options.get("device", "cpu"))
    return "cuda"


def run_demo(cfg: DemoConfig | None = None, *, echo: Callable[[str], None] | None = None) -> DemoResult:
    """Run the loop; print a per-step table (through ``echo``) and write the reward plot if ``cfg.plot``."""
    cfg = cfg or DemoConfig()
    cfg.check()
    cfg.check_engine()
    import torch

    threads = torch.get_num_threads()
    if cfg.cpu_threads is not None:
        torch.set_num_threads(cfg.cpu_threads)
    try:
        return _run(cfg, echo)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: DemoConfig, echo: Callable[[str], None] | None) -> DemoResult:
    from tqdm import tqdm

    from genengine.plugins.registry import create_engine

    start = time.perf_counter()
    t = Trainer.build(cfg)
    model, dtype, trainer_device, rng = t.model, t.dtype, t.device, t.rng
    tokenizer, policy, optimizer, pad = t.tokenizer, t.policy, t.optimizer, t.pad

    bar: Any = None
    say = echo or print
    engine = create_engine(backend=cfg.backend, model=model, dtype=dtype, seed=cfg.seed, **cfg.options)
    try:
        target, target_text = pick_target(engine, tokenizer, cfg.max_new_tokens)
        say(
            f"genengine demo: backend={cfg.backend} model={model} engine dtype={dtype} trainer on {trainer_device}; "
            f"reward = share of completion tokens equal to {target_text!r} (id {target})"
        )
        header = f"{'step':>4}  {'reward':>6}  {'tokens/s':>9}  {'sync ms':>8}  {'sleep freed':>11}  {'|Δlogp|':>8}"
        bar = tqdm(total=cfg.steps, desc="rl steps", disable=not cfg.progress, leave=False)
        write = bar.write if cfg.progress and echo is None else say
        write(header)
        stats: list[StepStats] = []
        for step in range(cfg.steps):
            prompts = rng.sample(PROMPTS, k=min(cfg.prompts_per_step, len(PROMPTS)))
            params = SamplingParams(
                temperature=1.0,
                max_new_tokens=cfg.max_new_tokens,
                n=cfg.group_size,
                seed=cfg.seed * 100_003 + step,
                logprobs=True,
                ignore_eos=True,
            )
            t0 = time.perf_counter()
            results = engine.generate(prompts, params)
            gen_seconds = time.perf_counter() - t0
            samples = [(r.prompt_token_ids, o.token_ids, o.logprobs or []) for r in results for o in r.outputs]
            rewards, adv = rewards_and_advantages(samples, target, cfg.group_size)

            before = _free_memory(_engine_device(cfg))
            engine.sleep(cfg.sleep_level)
            freed = _free_memory(_engine_device(cfg)) - before

            gap = train_step(policy, optimizer, samples, adv, pad, trainer_device)

            t1 = time.perf_counter()
            engine.wake(["weights"])
            engine.load_weights(policy.state_dict().items())
            engine.wake(["kv_cache"])
            sync_ms = (time.perf_counter() - t1) * 1000

            n_tokens = sum(len(toks) for _, toks, _ in samples)
            s = StepStats(step, float(rewards.mean()), n_tokens / gen_seconds, sync_ms, freed, gap)
            stats.append(s)
            write(
                f"{s.step:>4}  {s.reward:>6.3f}  {s.tokens_per_s:>9.0f}  {s.sync_ms:>8.1f}  "
                f"{s.freed_bytes / 2**20:>8.1f} MiB  {s.logprob_gap:>8.1e}"
            )
            bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        engine.shutdown()

    result = DemoResult(stats, target, target_text, time.perf_counter() - start, None)
    plot = _plot(result, cfg) if cfg.plot else None
    result = DemoResult(stats, target, target_text, time.perf_counter() - start, plot)
    say(
        f"reward: first quarter mean {result.first_quarter:.3f} -> last quarter mean {result.last_quarter:.3f} "
        f"({result.last_quarter - result.first_quarter:+.3f}) in {result.seconds:.1f} s"
        + (f"; plot: {plot}" if plot else "")
    )
    return result


@dataclass
class Trainer:
    """The demo's trainer side: its own fp32 HF copy of the model and an optimizer, on ``device``."""

    model: str
    dtype: str
    """The engine's dtype."""
    device: str
    rng: random.Random
    tokenizer: Any
    policy: Any
    optimizer: Any
    pad: int

    @classmethod
    def build(cls, cfg: DemoConfig) -> Trainer:
        import torch
        import transformers

        from genengine.models.tiny_model import tiny_model_dir

        model = cfg.model or str(tiny_model_dir())
        dtype = cfg.engine_dtype
        on_gpu = _engine_device(cfg).startswith("cuda") and torch.cuda.is_available()
        device = cfg.trainer_device or ("cuda" if on_gpu else "cpu")
        torch.manual_seed(cfg.seed)
        transformers.utils.logging.disable_progress_bar()
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        policy: Any = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        policy.to(device).train()
        optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return cls(model, dtype, device, random.Random(cfg.seed), tokenizer, policy, optimizer, int(pad))


def rewards_and_advantages(samples: list[tuple[list[int], list[int], list[float]]], target: int, group: int) -> Any:
    """Each sample's reward (share of its tokens equal to ``target``) and GRPO advantage within its group."""
    import torch

    rewards = torch.tensor([sum(t == target for t in toks) / max(1, len(toks)) for _, toks, _ in samples])
    groups = rewards.view(-1, group)
    adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
    return rewards, adv


def pick_target(engine: Any, tokenizer: Any, max_new_tokens: int) -> tuple[int, str]:
    """The reward's token: the one the untrained model samples most often (a readable, non-special one)."""
    special = set(tokenizer.all_special_ids)
    warm = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=0))
    counts: dict[int, int] = {}
    for r in warm:
        for t in r.outputs[0].token_ids:
            text = str(tokenizer.decode([t]))
            if t not in special and text.strip() and "\ufffd" not in text:
                counts[t] = counts.get(t, 0) + 1
    target = max(sorted(counts), key=lambda t: counts[t])
    return target, str(tokenizer.decode([target]))


def train_step(
    policy: Any,
    optimizer: Any,
    samples: list[tuple[list[int], list[int], list[float]]],
    adv: Any,
    pad: int,
    device: str,
    *,
    decoupled: bool = False,
) -> float:
    """One clipped policy-gradient step; the engine's logprobs are the behaviour policy's (PPO ratio).

    ``decoupled`` (for rollouts a version behind, as AReaL's decoupled PPO): the ratio is taken against the
    trainer's own policy before this step, and the behaviour policy enters as a truncated importance
    weight, so the staleness does not clip the gradient away.
    """
    import torch

    width = max(len(p) + len(c) for p, c, _ in samples)
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    comp = torch.zeros((len(samples), width), dtype=torch.bool)
    old = torch.zeros((len(samples), width))
    for b, (p, c, lps) in enumerate(samples):
        seq = p + c
        ids[b, : len(seq)] = torch.tensor(seq)
        mask[b, : len(seq)] = 1
        comp[b, len(p) : len(seq)] = True
        old[b, len(p) : len(seq)] = torch.tensor(lps)
    ids, mask, comp, old = ids.to(device), mask.to(device), comp.to(device), old.to(device)
    logits = policy(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None])[..., 0]
    target_mask, old = comp[:, 1:], old[:, 1:]
    a = adv.to(device)[:, None]
    if decoupled:
        proximal = logp.detach()
        weight = torch.exp(proximal - old).clamp(max=2.0)
        ratio = torch.exp(logp - proximal)
        per_token = -weight * torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)
    else:
        ratio = torch.exp(logp - old)
        per_token = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)
    loss = (per_token * target_mask).sum() / target_mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    return float(((logp.detach() - old).abs() * target_mask).sum() / target_mask.sum())


def running_mean(values: list[float]) -> tuple[int, list[float]]:
    """The window (an eighth of the run, at least 1) and each point's mean over the window ending there."""
    window = max(1, len(values) // 8)
    spans = [values[max(0, i - window + 1) : i + 1] for i in range(len(values))]
    return window, [sum(span) / len(span) for span in spans]


def _plot(result: DemoResult, cfg: DemoConfig) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    assert cfg.plot is not None
    path = Path(cfg.plot)
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = [s.step for s in result.steps]
    rewards = [s.reward for s in result.steps]
    window, smooth = running_mean(rewards)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, rewards, marker="o", markersize=3, linewidth=1, alpha=0.6, label="reward per step")
    ax.plot(steps, smooth, linewidth=2.5, label=f"running mean ({window} steps)")
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"share of tokens = {result.target_text!r}")
    ax.set_ylim(0, 1)
    ax.set_title(
        f"genengine demo ({cfg.backend}): reward {result.first_quarter:.2f} → {result.last_quarter:.2f} "
        f"in {result.seconds:.0f} s"
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
