"""``genengine demo``: a small RL loop through the protocol, with a rising reward and a plot."""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from genengine.cli.args import add_engine_arguments

    p = sub.add_parser(
        "demo",
        help="run a small RL loop (generate, sleep, train, wake, load_weights) and plot the reward",
        description=(
            "A GRPO-style loop that uses only the engine protocol. With no arguments it builds a tiny model "
            "and runs on the CPU with the embedded backend in about a minute; --backend sglang|vllm --model "
            "PATH runs the same loop on a GPU."
        ),
    )
    add_engine_arguments(p)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (the GRPO group)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sleep-level", type=int, default=2, choices=(1, 2))
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the tiny model is too small)")
    p.add_argument("--trainer-device", default=None, help="default: cuda for GPU backends, else cpu")
    p.add_argument("--plot", default="out/demo_reward.png", help="PNG of reward per step")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--async",
        dest="async_rollouts",
        action="store_true",
        help="rollouts one weight version ahead of the trainer (pause, load, resume; partial samples carried "
        "over); runs the synchronous loop too and plots both",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from genengine.demo import DemoConfig, run_demo

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
        plot=None if args.no_plot else args.plot,
        progress=not args.no_progress,
    )
    if args.async_rollouts:
        from genengine.demo_async import run_async_demo

        if args.plot == "out/demo_reward.png":
            cfg.plot = None if args.no_plot else "out/demo_async_reward.png"
        both = run_async_demo(cfg)
        result = both.rollout
    else:
        result = run_demo(cfg)
    if result.last_quarter <= result.first_quarter:
        print("genengine demo: the reward did not rise; try more --steps or a larger --lr")
    return 0
