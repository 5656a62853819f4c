"""The ``genengine`` command. Each subcommand is a module of this package (its engine arguments are in
:mod:`genengine.cli.args`) and imports heavy things only when run."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

__all__ = ["main"]

# Each module exposes add_parser(subparsers); a module not present yet (or broken) is skipped.
_SUBCOMMAND_MODULES = (
    "genengine.cli.backends",
    "genengine.cli.generate",
    "genengine.cli.demo",
    "genengine.cli.bench.command",
    "genengine.cli.topology",
)


def build_parser() -> argparse.ArgumentParser:
    from genengine.cli.args import HelpFormatter
    from genengine.plugins.versions import genengine_version

    parser = argparse.ArgumentParser(
        prog="genengine",
        description="Generation engines for RL post-training: generate, sleep, wake, load_weights.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"genengine {genengine_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from genengine.cli.args import report_error
    from genengine.errors import GenEngineError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except GenEngineError as exc:
        return report_error(exc)
