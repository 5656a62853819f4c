"""``genengine topology``: print how a world of ranks maps onto engines, without starting any process.

For planning a launch (which rank owns which engine, on which GPUs and port) and for checking a layout
before paying for a cluster. Every row is :func:`genengine.distributed.compute_topology` for that rank.
Imports nothing heavy at module level, so ``genengine --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_parser", "format_table", "rows", "run"]

COLUMNS = ("rank", "node", "local_rank", "tp_group", "tp_rank", "dp_rank", "leader", "gpu_ids", "port")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``topology`` on an ``argparse`` subparsers object; ``args.func`` is :func:`run`."""
    from genengine.cli.args import HelpFormatter

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "topology",
        formatter_class=HelpFormatter,
        help="print every rank's TP group, leader, GPUs and engine port",
        description=(
            "Print the engine topology of a torch.distributed world: TP groups of contiguous ranks, "
            "the leader that owns each engine, its GPU ids (through CUDA_VISIBLE_DEVICES) and port."
        ),
    )
    parser.add_argument("--world-size", type=int, required=True, help="total number of ranks")
    parser.add_argument("--tp-size", type=int, required=True, help="tensor-parallel size of one engine")
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument(
        "--cuda-visible-devices",
        default=None,
        metavar="IDS",
        help="CUDA_VISIBLE_DEVICES on every node, e.g. 4,5,6,7 (default: unset)",
    )
    parser.add_argument("--base-port", type=int, default=None, help="engine port base (default 40000)")
    parser.add_argument("--allow-multi-node", action="store_true", help="let one engine span several whole nodes")
    parser.add_argument("--json", action="store_true", help="one JSON object per rank instead of a table")
    parser.set_defaults(func=run)
    return parser


def rows(
    world_size: int,
    tp_size: int,
    nodes: int = 1,
    cuda_visible_devices: str | None = None,
    base_port: int | None = None,
    *,
    allow_multi_node: bool = False,
) -> list[dict[str, Any]]:
    """One dict per rank with the table's columns; raises the errors of ``compute_topology``."""
    from genengine.distributed import DEFAULT_BASE_PORT, compute_topology, parse_cuda_visible_devices
    from genengine.errors import DistributedSetupError

    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise DistributedSetupError(f"--nodes must be an int >= 1; got {nodes!r}")
    if isinstance(world_size, int) and world_size % nodes != 0:
        raise DistributedSetupError(
            f"world size {world_size} is not divisible by {nodes} nodes: every node must run the same number of ranks"
        )
    local_world_size = world_size // nodes
    visible = parse_cuda_visible_devices(cuda_visible_devices)
    port = DEFAULT_BASE_PORT if base_port is None else base_port
    out = []
    for rank in range(world_size):
        t = compute_topology(
            rank,
            world_size,
            rank % max(local_world_size, 1),
            local_world_size,
            tp_size,
            visible,
            port,
            allow_multi_node=allow_multi_node,
        )
        out.append(
            {
                "rank": t.rank,
                "node": t.node_rank,
                "local_rank": t.local_rank,
                "tp_group": list(t.tp_group_ranks),
                "tp_rank": t.tp_rank,
                "dp_rank": t.dp_rank,
                "leader": t.leader_rank,
                "is_leader": t.is_leader,
                "gpu_ids": list(t.physical_gpu_ids),
                "port": t.port,
            }
        )
    return out


def _cell(row: dict[str, Any], column: str) -> str:
    value = row[column]
    if column == "tp_group":
        return f"{value[0]}-{value[-1]}" if len(value) > 1 else str(value[0])
    if column == "gpu_ids":
        return ",".join(value)
    if column == "leader":
        return f"{value}*" if row["is_leader"] else str(value)
    return str(value)


def format_table(table: list[dict[str, Any]]) -> str:
    """Aligned text; ``*`` marks the leaders, the ranks that own an engine."""
    cells = [list(COLUMNS)] + [[_cell(r, c) for c in COLUMNS] for r in table]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in cells)


def run(args: argparse.Namespace) -> int:
    """Print the table (or JSON lines); exit status 2 with a one-line reason if the layout is invalid."""
    from genengine.cli.args import report_error
    from genengine.errors import GenEngineError

    try:
        table = rows(
            args.world_size,
            args.tp_size,
            args.nodes,
            args.cuda_visible_devices,
            args.base_port,
            allow_multi_node=args.allow_multi_node,
        )
    except GenEngineError as exc:
        return report_error(exc, "genengine topology")
    if args.json:
        for row in table:
            print(json.dumps(row))
        return 0
    print(
        f"world_size={args.world_size} nodes={args.nodes} tp_size={args.tp_size} "
        f"engines={args.world_size // args.tp_size}; leader* owns its group's engine; gpu_ids: the "
        "engine's GPUs on that rank's node"
        + (f", through CUDA_VISIBLE_DEVICES={args.cuda_visible_devices}" if args.cuda_visible_devices else "")
    )
    print(format_table(table))
    return 0
