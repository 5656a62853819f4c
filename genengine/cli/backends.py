"""``genengine backends``: what is installed, which engine version (and whether it was verified), and why a
backend cannot be used."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from genengine.plugins.registry import BackendInfo


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from genengine.cli.args import HelpFormatter

    p = sub.add_parser(
        "backends", help="list the installed backends and whether each can be loaded", formatter_class=HelpFormatter
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _engine_columns(info: BackendInfo) -> dict[str, Any]:
    """The installed engine's version and whether it is in the range the plugin was verified with, e.g.
    ``yes (vllm==0.26.0)`` or ``NO (vllm==0.26.0)`` ("-": the plugin does not say what it was verified with)."""
    status = info.engine_version
    if status is None:
        return {"engine": "-", "verified": "-", "verified_range": None, "in_verified_range": None}
    engine = f"{status.verified.distribution} {status.installed}" if status.installed else "not installed"
    mark = {None: "", True: "yes ", False: "NO "}[status.in_range]
    verified = f"{mark}({status.verified.requirement})"
    return {
        "engine": engine,
        "verified": verified,
        "verified_range": status.verified.requirement,
        "in_verified_range": status.in_range,
    }


def run(args: argparse.Namespace) -> int:
    from genengine.plugins.registry import available_backends

    rows = [
        {
            "name": b.name,
            "distribution": b.distribution or "-",
            "version": b.version or "-",
            **_engine_columns(b),
            "status": "loadable" if b.loadable else b.reason,
            "description": b.description,
        }
        for b in available_backends()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    headers = ("name", "distribution", "version", "engine", "verified", "status")
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) if rows else len(h) for h in headers]
    print("  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for r in rows:
        print("  ".join(str(r[h]).ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    return 0
