"""The arguments every engine-starting command shares, and the CLI's one way of reporting an error.

Used by ``genengine generate``, ``demo`` and ``bench`` (and ``benchmarks/soak.py``). Imports nothing heavy
at module level, so ``genengine --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "MEM_UTIL_HELP",
    "HelpFormatter",
    "add_engine_arguments",
    "add_parallel_arguments",
    "check_engine_args",
    "engine_kwargs",
    "int_at_least",
    "parallel_kwargs",
    "parse_option",
    "report_error",
]

MEM_UTIL_HELP = "share of GPU memory the engine may take (default: the backend's)"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default: argparse's ``(default: X)``, unless the help says it in its
    own words (a default that depends on something, such as ``--repeats``); a flag is off unless given."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.nargs == 0 or action.default is None:
            return text
        return super()._get_help_string(action)


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


def int_at_least(minimum: int, refusal: str = "{text!r}: expected an integer >= {minimum}") -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, else a usage error, ``refusal`` with ``{text!r}`` (what was
    given) and ``{minimum}`` filled in. The CLI's and the benchmark scripts' counts share it."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(refusal.format(text=text, minimum=minimum))
        return value

    return parse


DTYPE_HELP = "engine dtype: auto, bfloat16, float16, float32 (default: auto for transformers, else bfloat16)"


def add_engine_arguments(
    p: argparse.ArgumentParser, *, backend_help: str = "a registered backend", dtype_help: str = DTYPE_HELP
) -> None:
    """The arguments that choose and configure an engine (shared by ``genengine generate``, ``demo`` and ``bench``)."""
    p.add_argument("--backend", default="transformers", help=backend_help)
    p.add_argument("--model", default=None, help="local HF model folder (default: build the tiny random model)")
    p.add_argument("--dtype", default=None, help=dtype_help)
    p.add_argument(
        "--option",
        action="append",
        type=parse_option,
        default=[],
        metavar="KEY=VALUE",
        help="backend option (repeatable), VALUE read as YAML, e.g. --option device=cpu (default: none)",
    )


def add_parallel_arguments(p: argparse.ArgumentParser, *, mem_util_help: str | None = MEM_UTIL_HELP) -> None:
    """``--tp-size`` (default 1) and ``--mem-util`` (default: the backend's); ``mem_util_help=None``: no help line."""
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size of the engine")
    p.add_argument("--mem-util", type=float, default=None, help=mem_util_help)


def _fields(args: argparse.Namespace) -> dict[str, Any]:
    """The shared engine arguments as ``create_engine`` keywords, the model left out."""
    kwargs: dict[str, Any] = {"backend": args.backend, **dict(args.option)}
    if args.dtype is not None:
        kwargs["dtype"] = args.dtype
    elif args.backend == "transformers":
        kwargs["dtype"] = "auto"
    return kwargs


def check_engine_args(args: argparse.Namespace, **extra: Any) -> None:
    """Refuse what ``create_engine`` would refuse (unknown or missing backend, an option's typo or bad value,
    ``--tp-size`` the backend cannot run) before any slow work: the tiny model takes seconds to build.
    ``extra``: more ``create_engine`` keywords (``parallel_kwargs(args)``)."""
    from genengine.plugins.registry import check_engine_config

    kwargs = {**_fields(args), **extra}
    if args.model is not None:
        kwargs["model"] = args.model
    check_engine_config(**kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``create_engine`` keyword arguments from the shared engine arguments; the tiny model if none given
    (call :func:`check_engine_args` first, so that a typo is not found after the model is built)."""
    kwargs = _fields(args)
    if args.model is None:
        from genengine.models.tiny_model import tiny_model_dir

        print("genengine: no --model given: using a tiny random-weight Qwen2 model", file=sys.stderr)
        kwargs["model"] = str(tiny_model_dir())
    else:
        kwargs["model"] = args.model
    return kwargs


def parallel_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``create_engine`` keyword arguments from :func:`add_parallel_arguments`: ``mem_util`` only when given."""
    kwargs: dict[str, Any] = {"tp_size": args.tp_size}
    if args.mem_util is not None:
        kwargs["mem_util"] = args.mem_util
    return kwargs


def report_error(exc: BaseException, prog: str = "genengine") -> int:
    """Print ``PROG: error: EXC`` on stderr and return the exit status of a refused command, 2 (as argparse)."""
    print(f"{prog}: error: {exc}", file=sys.stderr)
    return 2
