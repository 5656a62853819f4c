"""``genengine backends``: what is installed, and why a backend cannot be used."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from genengine.cli.args import HelpFormatter

    p = sub.add_parser(
        "backends", help="list the installed backends and whether each can be loaded", formatter_class=HelpFormatter
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from genengine.registry import available_backends

    rows = [
        {
            "name": b.name,
            "distribution": b.distribution or "-",
            "version": b.version or "-",
            "status": "loadable" if b.loadable else b.reason,
            "description": b.description,
        }
        for b in available_backends()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    headers = ("name", "distribution", "version", "status")
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) if rows else len(h) for h in headers]
    print("  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r[h]).ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    return 0
