"""``genengine demo``: a small RL loop through the protocol, with a rising reward and a plot."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser", "run"]


DEFAULT_PLOT = "out/demo_reward.png"
DEFAULT_ASYNC_PLOT = "out/demo_async_reward.png"


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from genengine.cli.args import HelpFormatter, add_engine_arguments

    p = sub.add_parser(
        "demo",
        formatter_class=HelpFormatter,
        help="run a small RL loop (generate, sleep, train, wake, load_weights) and plot the reward",
        description=(
            "A GRPO-style loop that uses only the engine protocol. With no arguments it builds a tiny model "
            "and runs on the CPU with the embedded backend in about a minute; --backend sglang|vllm --model "
            "PATH runs the same loop on a GPU."
        ),
    )
    add_engine_arguments(
        p,
        dtype_help="engine dtype: auto, bfloat16, float16, float32 (default: float32 for transformers, so that "
        "engine and trainer logprobs agree; else bfloat16)",
    )
    p.add_argument("--steps", type=int, default=40, help="RL steps (one optimizer step each)")
    p.add_argument("--prompts-per-step", type=int, default=8, help="prompts sampled per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (the GRPO group)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens per sample")
    p.add_argument("--lr", type=float, default=1e-3, help="the trainer's Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="seeds the trainer, the prompts and the engine")
    p.add_argument("--sleep-level", type=int, default=2, choices=(1, 2), help="the engine's sleep while training")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the tiny model is too small)")
    p.add_argument("--trainer-device", default=None, help="default: cuda for GPU backends, else cpu")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help=f"PNG of reward per step (default: {DEFAULT_PLOT}, with --async {DEFAULT_ASYNC_PLOT}; skipped with a "
        "note when matplotlib is missing, while an explicit --plot without it is refused at once)",
    )
    p.add_argument("--no-plot", action="store_true", help="draw no plot")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--async",
        dest="async_rollouts",
        action="store_true",
        help="rollouts one weight version ahead of the trainer (pause, load, resume; partial samples carried "
        "over); runs the synchronous loop too and plots both",
    )
    p.set_defaults(func=run)


def plot_path(args: argparse.Namespace) -> str | None:
    """Where to draw: an explicit ``--plot`` as given (refused later, up front, if matplotlib is missing); by
    default the default path, or none with one line saying how to get it when matplotlib is missing."""
    if args.no_plot:
        return None
    if args.plot is not None:
        return str(args.plot)
    from genengine.plugins.optional import PLOT_INSTALL, plot_unavailable

    why = plot_unavailable()
    if why is not None:
        print(f"genengine demo: no reward plot ({why}); for one: {PLOT_INSTALL}", file=sys.stderr)
        return None
    return DEFAULT_ASYNC_PLOT if args.async_rollouts else DEFAULT_PLOT


def run(args: argparse.Namespace) -> int:
    from genengine.cli.demos.sync import DemoConfig, run_demo

    cfg = DemoConfig(
        backend=args.backend,
        model=args.model,
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        lr=args.lr,
        seed=args.seed,
        sleep_level=args.sleep_level,
        dtype=args.dtype,
        trainer_device=args.trainer_device,
        options=dict(args.option),
        cpu_threads=args.threads,
        plot=plot_path(args),
        progress=not args.no_progress,
    )
    if args.async_rollouts:
        from genengine.cli.demos.asynchronous import run_async_demo

        both = run_async_demo(cfg)
        result = both.rollout
    else:
        result = run_demo(cfg)
    if result.last_quarter <= result.first_quarter:
        print("genengine demo: the reward did not rise; try more --steps or a larger --lr")
    return 0
