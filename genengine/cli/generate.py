"""``genengine generate``: complete prompts with any backend, from the shell."""

from __future__ import annotations

import argparse
import dataclasses
import json

from genengine.cli.args import (
    HelpFormatter,
    add_engine_arguments,
    add_parallel_arguments,
    check_engine_args,
    engine_kwargs,
    parallel_kwargs,
)

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "generate",
        formatter_class=HelpFormatter,
        help="complete prompts with a backend",
        description="Complete each PROMPT with the chosen backend and print the completions (or JSON).",
    )
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    add_engine_arguments(p)
    add_parallel_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per completion, at most")
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: 1.0 is off")
    p.add_argument("--top-k", type=int, default=None, help="the k most likely tokens (default: off; -1 is off too)")
    p.add_argument("--seed", type=int, default=None, help="the request's seed (default: drawn from the engine's)")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable; default: none)")
    p.add_argument(
        "--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable; default: none)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")
    p.add_argument("--logprobs", action="store_true", help="print each token's processed logprob")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from genengine.plugins.registry import create_engine
    from genengine.protocol import SamplingParams

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
    check_engine_args(args, **parallel_kwargs(args))  # before the tiny model is built
    kwargs = {**engine_kwargs(args), **parallel_kwargs(args)}
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
