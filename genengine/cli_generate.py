"""``genengine generate``: complete prompts with any backend, from the shell."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

__all__ = ["add_parser", "parse_option", "run"]


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as YAML, so ``max_batch_size=8`` is an int and ``device=cpu`` a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option {text!r}: expected KEY=VALUE")
    import yaml

    try:
        return key, yaml.safe_load(value)
    except yaml.YAMLError:
        return key, value


def add_engine_arguments(
    p: argparse.ArgumentParser, *, backend_help: str = "a registered backend (default: transformers)"
) -> None:
    """The arguments that choose and configure an engine (shared with ``genengine demo`` and ``bench``)."""
    p.add_argument("--backend", default="transformers", help=backend_help)
    p.add_argument("--model", default=None, help="local HF model folder (default: build the tiny random model)")
    p.add_argument("--dtype", default=None, help="engine dtype: auto, bfloat16, float16, float32")
    p.add_argument(
        "--option",
        action="append",
        type=parse_option,
        default=[],
        metavar="KEY=VALUE",
        help="backend option (repeatable), VALUE read as YAML, e.g. --option device=cpu",
    )


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "generate",
        help="complete prompts with a backend",
        description="Complete each PROMPT with the chosen backend and print the completions (or JSON).",
    )
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    add_engine_arguments(p)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--mem-util", type=float, default=None, help="share of GPU memory the engine may take")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None, help="off when omitted or -1")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", action="store_true", help="print each token's processed logprob")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=run)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``create_engine`` keyword arguments from the shared engine arguments; the tiny model if none given."""
    kwargs: dict[str, Any] = {"backend": args.backend, **dict(args.option)}
    if args.model is None:
        from genengine.testing.tiny_model import tiny_model_dir

        print("genengine: no --model given: using a tiny random-weight Qwen2 model", file=sys.stderr)
        kwargs["model"] = str(tiny_model_dir())
    else:
        kwargs["model"] = args.model
    if args.dtype is not None:
        kwargs["dtype"] = args.dtype
    elif args.backend == "transformers":
        kwargs["dtype"] = "auto"
    return kwargs


def run(args: argparse.Namespace) -> int:
    from genengine.protocol import SamplingParams
    from genengine.registry import create_engine

    params = SamplingParams(  # checked before any engine starts
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_id),
        n=args.n,
        seed=args.seed,
        logprobs=args.logprobs,
        ignore_eos=args.ignore_eos,
    )
    kwargs = engine_kwargs(args)
    kwargs["tp_size"] = args.tp_size
    if args.mem_util is not None:
        kwargs["mem_util"] = args.mem_util
    with create_engine(**kwargs) as engine:
        results = engine.generate(list(args.prompts), params)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
        return 0
    for i, result in enumerate(results):
        for j, out in enumerate(result.outputs):
            label = f"[{i}]" if len(result.outputs) == 1 else f"[{i}.{j}]"
            reason = out.finish_reason + (f" ({out.stop_reason!r})" if out.stop_reason is not None else "")
            print(f"{label} {args.prompts[i]!r} -> {len(out.token_ids)} tokens, finish: {reason}")
            print(out.text)
            if out.logprobs is not None:
                pairs = ", ".join(f"{t}:{lp:.3f}" for t, lp in zip(out.token_ids, out.logprobs, strict=True))
                print(f"  logprobs (sum {sum(out.logprobs):.3f}): {pairs}")
    return 0
