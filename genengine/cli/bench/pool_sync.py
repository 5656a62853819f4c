"""``genengine bench --sync --pool``: the same syncs as the in-process engine's, through an ``EnginePool``.

The process that runs the bench is the trainer (rank 0 of the pool's weight-sync group): it starts, or joins,
a local Ray cluster, starts ``replicas`` replicas of the same engine and times ``syncs`` syncs (after one
untimed one, which forms the group) with requests in flight, as ``genengine bench --sync`` times the
in-process engine. Both ends of every sync write their phases (``$GENENGINE_SYNC_TRACE``, a folder of this
run); they are mapped onto the five phases so:

* ``pause``, ``gather``, ``resume``: the trainer's own calls (``pool.pause_generation("keep")``, the cast to
  the engine's dtype, ``pool.resume_generation()``), timed in this process. A replica has none of them.
* ``load``: on a replica, its engine's own load: the trace phases in :data:`~genengine.cli.bench.sync.LOAD_PHASES`
  (``session``: ``begin_load``; ``write``, ``write_sync``: the buckets written; ``commit``). On the trainer,
  the waits for every replica to load and acknowledge (:data:`SENDER_LOAD_PHASES`: ``ack_wait`` of
  ``cuda_ipc``, ``status_wait`` of ``gloo``/``nccl``).
* ``transfer``: the rest of the pool's ``load_weights`` call: the trace phases that plan, share, pack, move or
  wait for the bytes (``plan``, ``metadata``, ``pack``, ``broadcast``, ``receive_wait``, ``copy``, ``checksum``,
  ``notice_wait``, ``status``, ...) and the pool's own time outside the transport (its member pings and Ray
  calls; reported alone as ``untraced``).

The pool's row (the second group of bars) is the replica's split: ``load`` is the slowest replica's load
(the trainer waits for it), ``transfer`` the call less that. Per side (``report["pool"]["sides"]``) the same
five phases from that side's trace alone, and the trace's own phases, each as median and spread.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from genengine.cli.bench.sync import (
    LOAD_PHASES,
    PHASES,
    SyncBenchSettings,
    one_sync,
    run_sync_bench,
    spread,
    summarize_phases,
)
from genengine.errors import ConfigError

__all__ = ["SENDER_LOAD_PHASES", "measure_pool", "run_pool_sync_bench", "split_pool_sync"]

SENDER_LOAD_PHASES = frozenset({"ack_wait", "status_wait"})
"""The sender's trace phases spent waiting for the replicas to load (and acknowledge) what they received."""


def run_pool_sync_bench(settings: SyncBenchSettings) -> dict[str, Any]:
    """``run_sync_bench`` with the pool's row: the in-process engine's syncs, then the same syncs through a
    pool of ``settings.replicas`` replicas (``report["targets"]["pool"]``, details in ``report["pool"]``)."""
    return run_sync_bench(settings, then=measure_pool)


def _load_of(totals: Mapping[str, float], side: str) -> float:
    phases = LOAD_PHASES if side == "receiver" else SENDER_LOAD_PHASES
    return float(sum(v for k, v in totals.items() if k in phases))


def split_pool_sync(
    times: Mapping[str, Any], senders: Sequence[Mapping[str, Any]], receivers: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """One pool sync (``one_sync``'s ``times``: ``load`` is the whole ``load_weights`` call) split by its trace
    files (``totals`` of each): the pool's row, and each side's five phases and trace phases (per side, the
    endpoint the sync waited for: the receiver with the longest load)."""
    if not senders or not receivers:
        raise ConfigError(
            f"the pool's sync left {len(senders)} sender and {len(receivers)} receiver trace(s): its transport "
            "does not trace ($GENENGINE_SYNC_TRACE), so its phases cannot be split"
        )
    call = float(times["load"])
    ends = {
        "trainer": ("sender", max(senders, key=lambda r: _load_of(r["totals"], "sender"))),
        "replica": ("receiver", max(receivers, key=lambda r: _load_of(r["totals"], "receiver"))),
    }
    sides: dict[str, Any] = {}
    for who, (side, trace) in ends.items():
        totals = {k: float(v) for k, v in trace["totals"].items()}
        load = min(_load_of(totals, side), call)
        own = who == "trainer"  # the trainer paused, gathered and resumed; a replica did none of it
        sides[who] = {
            "pause": times["pause"] if own else None,
            "gather": times["gather"] if own else None,
            "transfer": call - load,
            "load": load,
            "resume": times["resume"] if own else None,
            "whole": times.get("whole") if own else call,
            "trace": {**totals, "untraced": max(call - sum(totals.values()), 0.0)},
        }
    row = {k: v for k, v in times.items() if k not in ("transfer", "load")}
    row.update(transfer=sides["replica"]["transfer"], load=sides["replica"]["load"], call=call)
    return {"row": row, "sides": sides}


def _new_traces(folder: str, seen: set[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The trace files written since the last look: (senders, receivers)."""
    files = sorted(set(glob.glob(os.path.join(folder, "sync-*.json"))) - seen)
    seen.update(files)
    found = [json.loads(Path(f).read_text()) for f in files]
    return [x for x in found if x["side"] == "sender"], [x for x in found if x["side"] == "receiver"]


def _ray_started(ray: Any, replicas: int) -> bool:
    """Join the running cluster, or start a local one (False: it was running)."""
    if ray.is_initialized():
        return False
    from genengine.cli.bench.pool import source_root

    path = os.pathsep.join(p for p in (source_root(), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        include_dashboard=False,
        num_cpus=max(2, replicas),
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    return True


def measure_pool(
    settings: SyncBenchSettings,
    fields: dict[str, Any],
    trainer: Mapping[str, Any],
    dtype: Any,
    prompts: list[list[int]],
) -> dict[str, Any]:
    """``settings.syncs`` syncs of ``trainer`` through a pool of ``settings.replicas`` replicas of the engine
    ``fields`` describe (``EngineConfig`` fields; each replica at ``settings.pool_mem_util`` when set), after
    one untimed one: ``{"targets": {"pool": row}, "pool": details}`` (the row as ``summarize_phases`` gives
    it; the details: transport, the trace phases' mapping, both sides)."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"bench --sync --pool needs Ray (pip install 'genengine[ray]'): {exc}") from exc
    import torch

    from genengine.engine.environ import scoped_environ
    from genengine.ray import EnginePool
    from genengine.transport import TRACE_ENV

    fields = {**fields, "options": {**fields.get("options", {}), **settings.pool_options}}
    if settings.pool_mem_util is not None:
        fields["mem_util"] = settings.pool_mem_util
    gpu = torch.cuda.is_available()
    transport = settings.transport or ("cuda_ipc" if gpu else "gloo")
    with contextlib.ExitStack() as stack:
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="genengine-sync-trace-"))
        if _ray_started(ray, settings.replicas):
            stack.callback(ray.shutdown)
        env = {TRACE_ENV: folder}
        if not gpu:
            env["OMP_NUM_THREADS"] = "1"  # two replicas on a few cores: intra-op threads only oversubscribe
        topts: dict[str, Any] = {}
        if settings.bucket_bytes is not None:
            topts["bucket_bytes"] = settings.bucket_bytes
        start = time.perf_counter()
        pool = EnginePool(
            **fields,
            num_replicas=settings.replicas,
            # one GPU shared by the trainer and every replica (cuda_ipc reads the trainer's memory on it)
            num_gpus=round(0.9 / (settings.replicas + 1), 3) if gpu else 0,
            num_cpus=0.25,
            transport=transport,
            transport_options=topts,
            runtime_env={"env_vars": env},
        )
        stack.callback(pool.shutdown)
        create_s = time.perf_counter() - start
        stack.enter_context(scoped_environ({TRACE_ENV: folder}))  # this process is the sender
        seen: set[str] = set()

        def sync(version: int) -> dict[str, Any]:
            new = settings.max_new_tokens
            times = one_sync(pool, trainer.items(), dtype=dtype, prompts=prompts, max_new_tokens=new, version=version)
            return split_pool_sync(times, *_new_traces(folder, seen))

        sync(1)  # the group forms; first-touch allocations
        syncs = [sync(version) for version in range(2, settings.syncs + 2)]
    rows = [s["row"] for s in syncs]
    summary = summarize_phases(rows)
    summary["call"] = spread([r["call"] for r in rows])
    sides: dict[str, Any] = {}
    for who in ("trainer", "replica"):
        got = [s["sides"][who] for s in syncs]
        side = summarize_phases([{k: v for k, v in g.items() if k != "trace"} for g in got])
        names = sorted({k for g in got for k in g["trace"]})
        side["trace"] = {k: spread([g["trace"].get(k, 0.0) for g in got]) for k in names}
        sides[who] = side
    mapping = {
        side: {
            phase: "load" if phase in load else "transfer"
            for phase in sorted({k for s in syncs for k in s["sides"][who]["trace"]} - {"untraced"})
        }
        for who, side, load in (
            ("trainer", "sender", SENDER_LOAD_PHASES),
            ("replica", "receiver", LOAD_PHASES),
        )
    }
    details = {
        "transport": transport,
        "replicas": settings.replicas,
        "create_seconds": create_s,
        "phases": list(PHASES),
        "trace_phase_map": mapping,
        "sides": sides,
    }
    return {"targets": {"pool": summary}, "pool": details}
