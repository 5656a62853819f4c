"""``genengine bench``: throughput, weight sync, sleep and wake of one backend, through the protocol."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from genengine.cli.args import (
    HelpFormatter,
    add_engine_arguments,
    add_parallel_arguments,
    check_engine_args,
    int_at_least,
)
from genengine.errors import InvalidArgumentError


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sleep-levels {text!r}: expected e.g. '1,2', '2' or ''") from None
    if any(lvl not in (1, 2) for lvl in levels):
        raise argparse.ArgumentTypeError(f"--sleep-levels {text!r}: allowed levels are 1 and 2")
    return levels


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "bench",
        formatter_class=HelpFormatter,
        help="measure generate throughput, load_weights, sleep and wake of a backend",
        description=(
            "Measure one backend through the GenerationEngine protocol: generation throughput (paired with the "
            "raw engine, alive at once in a child process, when the plugin registers a raw_engine; beside it, "
            "after ours, when it registers a raw_runner), load_weights time and GB/s (bucketed and one call "
            "per parameter), memory freed by sleep and the time of each wake stage. With no arguments it "
            "builds a tiny model and runs the embedded backend on CPU. With --tp-size N, run it under "
            "`torchrun --nproc-per-node N`. With --async it instead times partial rollouts (pause, load, resume, "
            "stragglers carried over) against the synchronous generate on a long-tailed batch."
        ),
    )
    add_engine_arguments(
        p,
        backend_help="a registered backend, or module:EngineClass",
        dtype_help="engine dtype: auto, bfloat16, float16, float32 (default: the tiny model's, float32 on a CPU "
        "and bfloat16 on a GPU; with --model, bfloat16)",
    )
    add_parallel_arguments(p)
    p.add_argument(
        "--threads",
        type=_positive,
        default=None,
        help="torch CPU threads in this process (default: 1 on a machine without CUDA, where more threads "
        "oversubscribe a busy machine and slow the run several times; torch's own with CUDA)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per random prompt")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="tokens per sample (default: 32; with --async the length cap, default 256)",
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="runs per measurement, the median reported (default 3; --pool: 5)"
    )
    p.add_argument("--bucket-mb", type=float, default=None, help="load_weights bucket size (default: the backend's)")
    p.add_argument("--sleep-levels", type=_levels, default=(1, 2), help="comma-separated (default: '1,2')")
    p.add_argument("--no-raw", action="store_true", help="skip the raw engine's throughput")
    p.add_argument(
        "--p1-samples",
        type=_at_least_10,
        default=10,
        help="paired rounds of ours and the raw engine, alive at once (the plugin's raw_engine; default 10)",
    )
    p.add_argument("--no-per-parameter", action="store_true", help="skip the one-call-per-tensor weight sync")
    p.add_argument(
        "--json", metavar="FILE", default=None, help="write the report as JSON ('-' for stdout; default: no JSON)"
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="draw the figures into a PNG (default: none; needs matplotlib, checked before measuring)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    pool = p.add_argument_group("--pool", "a one-replica colocated Ray EnginePool against the same engine in-process")
    pool.add_argument("--pool", action="store_true", help="run the pool comparison instead (needs genengine[ray])")
    pool.add_argument("--pool-mem-util", type=float, default=None, help="the replica's share (default: --mem-util)")
    pool.add_argument("--min-seconds", type=float, default=3.0, help="seconds of generation per repeat")
    pool.add_argument(
        "--syncs", type=int, default=None, help="weight syncs, a new version each (default 3; --sync --pool: 10)"
    )
    pool.add_argument(
        "--transport", default=None, help="the pool's weight transport (default: cuda_ipc, or gloo on CPU)"
    )
    sync = p.add_argument_group(
        "--sync",
        "one weight sync split into pause, gather, transfer, load, resume; with --pool, the same syncs through an "
        "EnginePool of --replicas replicas on a local Ray cluster too (a second group of bars)",
    )
    sync.add_argument("--sync", action="store_true", help="time the sync's phases instead (--syncs of them)")
    sync.add_argument(
        "--replicas", type=_positive, default=2, help="with --sync --pool: the pool's replicas (default 2)"
    )
    sync.add_argument("--in-flight", type=int, default=4, help="requests generating during each sync")
    sync.add_argument("--trainer-dtype", default=None, help="the trainer's parameters' dtype (default: the engine's)")
    group = p.add_argument_group("--async", "partial rollouts against the synchronous generate")
    group.add_argument("--async", dest="async_", action="store_true", help="run the async comparison instead")
    group.add_argument("--steps", type=int, default=4, help="trainer steps (weight updates)")
    group.add_argument("--oversample", type=float, default=1.5, help="requests in flight per sample taken")
    group.add_argument("--median-new-tokens", type=int, default=16, help="median of the lognormal lengths")
    group.add_argument("--sigma", type=float, default=1.0, help="spread of the lognormal lengths")
    p.set_defaults(func=run)


_at_least_10 = int_at_least(10, "{text!r}: expected an integer >= 10 (a 1 % difference needs them)")
_positive = int_at_least(1)


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """torch's CPU threads set to ``count`` (None: 1 without CUDA, else left alone) while measuring."""
    import torch

    if count is None and not torch.cuda.is_available():
        count = 1
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(args: argparse.Namespace) -> int:
    if args.async_ and args.pool:
        raise InvalidArgumentError("--async and --pool are two different comparisons: pass one of them")
    if args.sync and args.async_:
        raise InvalidArgumentError("--sync and --async are two different measurements: pass one of them")
    if args.plot:  # refused now, not after the measurements
        if args.async_:
            raise InvalidArgumentError(
                f"--plot {args.plot}: --async prints a table; the default comparison, --sync and --pool draw figures"
            )
        from genengine.plugins.optional import PLOT_INSTALL, plot_unavailable

        why = plot_unavailable()
        if why is not None:
            raise InvalidArgumentError(f"--plot {args.plot} needs matplotlib ({why}): {PLOT_INSTALL}, or no --plot")
    if ":" not in args.backend:  # a registered name (not module:EngineClass): its options checked before any work
        check_engine_args(args)
    with _threads(args.threads):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.sync:
        return _run_sync(args)
    if args.async_:
        return _run_async(args)
    if args.pool:
        return _run_pool(args)
    from genengine.cli.bench import BenchSettings, format_report, plot_report, run_bench

    settings = BenchSettings(
        **_engine(args, "tp_size", "batch_size", "prompt_len", "sleep_levels"),
        max_new_tokens=32 if args.max_new_tokens is None else args.max_new_tokens,
        repeats=3 if args.repeats is None else args.repeats,
        bucket_bytes=_bucket_bytes(args),
        raw=not args.no_raw,
        pair_samples=args.p1_samples,
        per_parameter=not args.no_per_parameter,
        progress=not args.quiet,
    )
    report = run_bench(settings)
    if report["rank"] != 0:  # under torchrun: every rank measured, rank 0 reports
        return 0
    return _report(args, report, format_report(report), lambda path: print(f"wrote {plot_report(report, path)}"))


def _run_async(args: argparse.Namespace) -> int:
    from genengine.cli.bench.asynchronous import AsyncBenchSettings, format_async_report, run_async_bench

    _one_engine(args, "bench --async measures one engine in this process")
    settings = AsyncBenchSettings(
        **_engine(args, "batch_size", "steps", "oversample", "prompt_len", "median_new_tokens", "sigma"),
        max_new_tokens=256 if args.max_new_tokens is None else args.max_new_tokens,
    )
    report = run_async_bench(settings)
    return _report(args, report, format_async_report(report), None)


def _run_sync(args: argparse.Namespace) -> int:
    from genengine.cli.bench.sync import SyncBenchSettings, format_sync_report, run_sync_bench, write_plot

    _one_engine(args, "bench --sync measures one engine in this process")
    settings = SyncBenchSettings(
        **_engine(args, "in_flight", "prompt_len", "trainer_dtype", "replicas", "transport", "pool_mem_util"),
        syncs=(10 if args.pool else 3) if args.syncs is None else args.syncs,
        max_new_tokens=64 if args.max_new_tokens is None else args.max_new_tokens,
        bucket_bytes=_bucket_bytes(args),
    )
    if args.pool:
        from genengine.cli.bench.pool_sync import run_pool_sync_bench

        report = run_pool_sync_bench(settings)
    else:
        report = run_sync_bench(settings)
    return _report(args, report, format_sync_report(report), lambda path: write_plot(report, path, print))


def _run_pool(args: argparse.Namespace) -> int:
    from genengine.cli.bench.pool import PoolBenchSettings, format_pool_report, pool_sync_phases, run_pool_bench
    from genengine.cli.bench.sync import write_plot

    _one_engine(args, "bench --pool measures tp_size=1 replicas")
    settings = PoolBenchSettings(
        **_engine(args, "pool_mem_util", "batch_size", "prompt_len", "min_seconds", "transport"),
        syncs=3 if args.syncs is None else args.syncs,
        max_new_tokens=32 if args.max_new_tokens is None else args.max_new_tokens,
        repeats=5 if args.repeats is None else args.repeats,
        bucket_bytes=_bucket_bytes(args),
    )
    report = run_pool_bench(settings)
    has_phases = "phases" in report.get("sync", {})
    draw = (lambda path: write_plot(pool_sync_phases(report), path, print)) if has_phases else None
    return _report(args, report, format_pool_report(report), draw)


def _one_engine(args: argparse.Namespace, why: str) -> None:
    """Refuse ``--tp-size`` other than 1 for a mode that measures one engine here (``why`` says so), as every
    other bad setting is (report_error, exit status 2)."""
    if args.tp_size != 1:
        raise InvalidArgumentError(f"--tp-size {args.tp_size}: {why}; allowed: 1")


def _engine(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """Settings' keywords: the engine every mode measures, as the command line names it, and the arguments
    ``names`` as given (each a settings field of the same name)."""
    given = {name: getattr(args, name) for name in ("backend", "model", "dtype", "mem_util", *names)}
    return {**given, "options": dict(args.option)}


def _bucket_bytes(args: argparse.Namespace) -> int | None:
    return None if args.bucket_mb is None else int(args.bucket_mb * (1 << 20))


def _report(args: argparse.Namespace, report: dict[str, Any], table: str, draw: Callable[[str], object] | None) -> int:
    """Print or write the report (``_write``), then, with ``--plot``, ``draw(path)`` the mode's figures (None:
    this mode or this run has none)."""
    _write(args, report, table)
    if args.plot and draw is not None:
        draw(args.plot)
    return 0


def _write(args: argparse.Namespace, report: dict[str, object], table: str) -> None:
    print(table, file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json == "-":
        print(json.dumps(report, indent=2))
    elif args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
        print(f"wrote {args.json}")
