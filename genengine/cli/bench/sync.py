"""``genengine bench --sync``: one weight sync split into the phases a trainer waits on, so that the slowest is
visible at a glance.

A sync as an RL loop does it, with requests in flight: ``pause`` (``pause_generation("keep")``, async engines;
the requests stay where they are), ``gather`` (the trainer's parameters as (name, tensor) pairs in the
engine's dtype: the cast a trainer that keeps other precision pays; on one device no all-gather),
``transfer`` (moving the bytes to the engine: none in-process, where the engine reads the trainer's tensors;
through a pool, the transport's part from ``$GENENGINE_SYNC_TRACE``), ``load`` (the engine writing its
weights, synchronized on a GPU) and ``resume`` (``resume_generation``). The requests then finish under the new
weights.

:func:`one_sync` times one sync of any target (an engine or an ``EnginePool``); :func:`split_traced` splits a
pool's call by the trace files of its two ends; :func:`run_sync_bench` runs the in-process measurement (and
``then`` the same syncs through an ``EnginePool``: :mod:`genengine.cli.bench.pool_sync`);
:func:`format_sync_report` and :func:`plot_sync_report` render a report (the pool benchmark's
``sync_phases`` too).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genengine.errors import ConfigError, InvalidArgumentError

__all__ = [
    "PHASES",
    "SyncBenchSettings",
    "format_sync_report",
    "one_sync",
    "plot_sync_report",
    "run_sync_bench",
    "split_traced",
    "summarize_phases",
]

PHASES = ("pause", "gather", "transfer", "load", "resume")
LOAD_PHASES = frozenset({"session", "write", "write_sync", "commit"})
"""The receiver's trace phases that are the engine's own load (``begin_load``, the writes, the commit); the
rest moved or waited for the bytes."""


@dataclass
class SyncBenchSettings:
    """What to measure. The defaults take a few seconds on a two-core CPU with the tiny model."""

    backend: Any = "transformers"
    model: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    dtype: str | None = None
    mem_util: float | None = None
    syncs: int = 5
    """Timed syncs, after one untimed warm-up sync."""
    in_flight: int = 4
    """Requests generating while each sync happens (async engines; 0: an idle engine)."""
    prompt_len: int = 16
    max_new_tokens: int = 64
    bucket_bytes: int | None = None
    trainer_dtype: str | None = None
    """The trainer's parameters' dtype (default: the engine's). Another one makes ``gather`` cast."""
    seed: int = 0
    replicas: int = 2
    """``run_pool_sync_bench``: the ``EnginePool``'s replicas on a local Ray cluster, synced the same way after
    the in-process engine."""
    transport: str | None = None
    """The pool's weight transport (default: ``cuda_ipc`` on a GPU, ``gloo`` on the CPU)."""
    pool_mem_util: float | None = None
    """Each replica's ``mem_util`` (default: ``mem_util``)."""
    pool_options: Mapping[str, Any] = field(default_factory=dict)
    """Engine options each replica takes on top of ``options`` (several on one GPU: a capped KV cache)."""

    def check(self) -> None:
        """Refuse bad values before a model is built or an engine started."""
        for name, low in (("syncs", 1), ("in_flight", 0), ("prompt_len", 1), ("max_new_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgumentError(f"{name}={value!r} must be an integer >= {low}")
        if self.bucket_bytes is not None and (
            isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1
        ):
            raise InvalidArgumentError(f"bucket_bytes={self.bucket_bytes!r} must be an integer >= 1 or None")
        allowed = ("bfloat16", "float16", "float32")
        if self.trainer_dtype is not None and self.trainer_dtype not in allowed:
            raise InvalidArgumentError(f"trainer_dtype={self.trainer_dtype!r}: allowed are {', '.join(allowed)}")
        if self.model is not None and not os.path.isdir(self.model):
            raise ConfigError(f"model={self.model!r} is not a local model folder")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise InvalidArgumentError(f"replicas={self.replicas!r} must be an integer >= 1")
        transports = ("gloo", "nccl", "cuda_ipc")
        if self.transport is not None and self.transport not in transports:
            raise InvalidArgumentError(
                f"transport={self.transport!r}: allowed are {', '.join(transports)} (the ones that trace a sync's "
                "phases; the object store does not)"
            )


# ---- one sync ------------------------------------------------------------------------------------------------
def _cuda_sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def one_sync(
    target: Any,
    params: Iterable[tuple[str, Any]],
    *,
    dtype: Any = None,
    prompts: Sequence[Sequence[int]] = (),
    max_new_tokens: int = 64,
    bucket_bytes: int | None = None,
    version: int | None = None,
) -> dict[str, Any]:
    """One sync of ``target`` from the trainer's ``params``, phase by phase (seconds; None: the target has no
    such phase). With ``prompts`` and an async target, those requests are in flight during the sync and must
    finish after it (``requests_finished``)."""
    from genengine.protocol import is_async_engine

    if is_async_engine(target):
        return asyncio.run(_one_sync_async(target, params, dtype, prompts, max_new_tokens, bucket_bytes, version))
    start = time.perf_counter()
    times: dict[str, Any] = {"pause": None, "resume": None}
    times.update(_gather_load(target, params, dtype, bucket_bytes, version))
    times["whole"] = time.perf_counter() - start
    return times


def _gather_load(
    target: Any, params: Iterable[tuple[str, Any]], dtype: Any, bucket_bytes: int | None, version: int | None
) -> dict[str, Any]:
    _cuda_sync()
    start = time.perf_counter()
    pairs = [(name, t.detach() if dtype is None or t.dtype == dtype else t.detach().to(dtype)) for name, t in params]
    _cuda_sync()
    gathered = time.perf_counter()
    kwargs: dict[str, Any] = {"bucket_bytes": bucket_bytes}
    if version is not None:
        kwargs["version"] = version
    report = target.load_weights(pairs, **kwargs)
    _cuda_sync()
    loaded = time.perf_counter()
    return {
        "gather": gathered - start,
        "transfer": None,
        "load": loaded - gathered,
        "num_buckets": getattr(report, "num_buckets", None),
        "num_bytes": getattr(report, "num_bytes", None),
    }


async def _one_sync_async(
    target: Any,
    params: Iterable[tuple[str, Any]],
    dtype: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    bucket_bytes: int | None,
    version: int | None,
) -> dict[str, Any]:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    tasks = [
        asyncio.create_task(target.generate_async(prompt_token_ids=list(p), sampling_params=sampling)) for p in prompts
    ]
    await asyncio.sleep(0.01)  # the requests reach the engine and start
    start = time.perf_counter()
    await target.pause_generation("keep")
    paused = time.perf_counter()
    times: dict[str, Any] = {"pause": paused - start}
    times.update(_gather_load(target, params, dtype, bucket_bytes, version))
    resume_start = time.perf_counter()
    await target.resume_generation()
    times["resume"] = time.perf_counter() - resume_start
    times["whole"] = time.perf_counter() - start  # from the pause's start to the resume's end
    results = await asyncio.gather(*tasks)
    times["requests_finished"] = sum(
        1 for r in results for o in r.outputs if o.finish_reason in ("length", "stop") and o.token_ids
    )
    times["requests"] = len(tasks)
    return times


def split_traced(
    call_seconds: float, trace_dir: str | os.PathLike[str], seq: int, since: float | None = None
) -> dict[str, float] | None:
    """A pool's ``load_weights`` call (``call_seconds``) split by the trace files of sync ``seq`` (both ends,
    ``$GENENGINE_SYNC_TRACE``): ``load`` is the receiver's own write (``write``, ``write_sync``, ``commit``),
    ``transfer`` the rest of the call (planning, sharing, packing, the bytes moving, the round trips). Only files
    written at or after ``since`` (``time.time()``) count: other pools of the same run trace into the same folder.
    None when that sync left no receiver trace (a transport that does not trace)."""
    files = glob.glob(os.path.join(trace_dir, f"sync-{seq}-receiver-*"))
    if since is not None:
        files = [f for f in files if os.path.getmtime(f) >= since]
    receivers = [json.loads(Path(f).read_text()) for f in files]
    if not receivers:
        return None
    load = max(sum(v for k, v in r["totals"].items() if k in LOAD_PHASES) for r in receivers)
    load = min(load, call_seconds)
    return {"transfer": call_seconds - load, "load": load}


# ---- the in-process run ----------------------------------------------------------------------------------------
Then = Callable[[SyncBenchSettings, dict[str, Any], Mapping[str, Any], Any, list[list[int]]], dict[str, Any]]
"""What measures more targets after the in-process engine is shut down: called with the settings, the engine's
``EngineConfig`` fields (its ``options`` among them), the trainer's weights, the engine's torch dtype and the
prompts in flight; returns the report's entries to add (``genengine.cli.bench.pool_sync``: the pool's)."""


def run_sync_bench(settings: SyncBenchSettings, then: Then | None = None) -> dict[str, Any]:
    """Create the engine in this process and time ``settings.syncs`` syncs (after a warm-up one) with
    ``settings.in_flight`` requests generating; then ``then`` with the same trainer and prompts (the pool's
    row). Returns the report (plain JSON-able data)."""
    settings.check()
    from genengine.cli.bench.measure import resolve_backend

    resolve_backend(settings.backend)  # a bad name fails before the model is built
    import torch

    from genengine.cli.bench.measure import device_for, device_name, model_vocab_size, trainer_weights
    from genengine.config import EngineConfig
    from genengine.plugins.registry import create_engine

    with contextlib.ExitStack() as stack:
        model = settings.model
        if model is None:  # the session's tiny model (bf16 on disk), built once per process
            from genengine.models.tiny_model import tiny_model_dir

            model = str(tiny_model_dir())
            if settings.dtype is None:
                settings.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
        fields: dict[str, Any] = {"backend": settings.backend, "model": model, "seed": settings.seed}
        if settings.dtype is not None:
            fields["dtype"] = settings.dtype
        if settings.mem_util is not None:
            fields["mem_util"] = settings.mem_util
        config = EngineConfig(options=dict(settings.options), **fields)
        device = device_for(settings)  # type: ignore[arg-type]
        if any(Path(model).glob("*.safetensors")):
            trainer = trainer_weights(model, device, settings.trainer_dtype or config.dtype)
        else:  # config.json alone (the engines' load_format="dummy"): random weights under the model's names
            from genengine.cli.bench.measure import random_weights

            cast = getattr(torch, settings.trainer_dtype or config.dtype or "bfloat16", None)
            trainer = {n: t.to(cast) if cast is not None else t for n, t in random_weights(model, 1, device)}
        engine_dtype = getattr(torch, config.dtype) if config.dtype in ("bfloat16", "float16", "float32") else None
        gen = torch.Generator().manual_seed(settings.seed)
        vocab = model_vocab_size(model)
        prompts = torch.randint(
            min(10, vocab - 1), vocab, (settings.in_flight, settings.prompt_len), generator=gen
        ).tolist()
        start = time.perf_counter()
        engine = create_engine(config)
        stack.callback(engine.shutdown)
        create_s = time.perf_counter() - start

        def sync() -> dict[str, Any]:
            return one_sync(
                engine,
                trainer.items(),
                dtype=engine_dtype,
                prompts=prompts,
                max_new_tokens=settings.max_new_tokens,
                bucket_bytes=settings.bucket_bytes,
            )

        sync()  # warm-up: first-touch allocations, kernels
        rows = [sync() for _ in range(settings.syncs)]
        stack.close()  # the engine's memory back before a pool's replicas take theirs
        report: dict[str, Any] = {
            "backend": str(settings.backend),
            "engine": type(engine).__name__,
            "device": device_name(device),
            "dtype": config.dtype,
            "trainer_dtype": settings.trainer_dtype or config.dtype,
            "num_tensors": len(trainer),
            "num_bytes": sum(t.numel() * t.element_size() for t in trainer.values()),
            "create_seconds": create_s,
            "settings": {
                "syncs": settings.syncs,
                "in_flight": settings.in_flight,
                "max_new_tokens": settings.max_new_tokens,
                "bucket_bytes": settings.bucket_bytes,
            },
            "targets": {"in_process": summarize_phases(rows)},
        }
        if then is not None:
            more = then(settings, {**fields, "options": dict(settings.options)}, trainer, engine_dtype, prompts)
            report["targets"].update(more.pop("targets", {}))
            report.update(more)
        return report


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Every value, their median, min, max and ``spread`` (max - min)."""
    got = [float(v) for v in values]
    return {
        "all": got,
        "median": statistics.median(got),
        "min": min(got),
        "max": max(got),
        "spread": max(got) - min(got),
    }


def summarize_phases(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per phase: every sync's seconds, their median and spread (None: not a phase of this target); the
    total's median (the phases summed), the whole sync's as measured end to end (``whole``) and the slowest
    phase."""
    if not rows:
        raise InvalidArgumentError("summarize_phases: no syncs")
    phases: dict[str, Any] = {}
    for phase in PHASES:
        got = [float(v) for v in (r.get(phase) for r in rows) if v is not None]
        phases[phase] = spread(got) if got else None
    totals = [sum(float(r[p]) for p in PHASES if r.get(p) is not None) for r in rows]
    measured = {p: v["median"] for p, v in phases.items() if v is not None}
    out: dict[str, Any] = {
        "phases": phases,
        "total_median": statistics.median(totals),
        "slowest": max(measured, key=lambda p: measured[p]) if measured else None,
    }
    if all(r.get("whole") is not None for r in rows):
        out["whole"] = spread([r["whole"] for r in rows])
    if any("requests" in r for r in rows):
        out["requests_finished"] = f"{sum(r.get('requests_finished', 0) for r in rows)}/" + str(
            sum(r.get("requests", 0) for r in rows)
        )
    return out


# ---- output ------------------------------------------------------------------------------------------------------
def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1000:.2f} ms" if s < 0.1 else f"{s * 1000:.0f} ms"


def _cell(phase: Mapping[str, Any] | None) -> str:
    if phase is None:
        return "n/a"
    half = phase.get("spread")
    return _ms(phase["median"]) + ("" if half is None else f" ±{_ms(half / 2)}")


def format_sync_report(report: Mapping[str, Any]) -> str:
    """A table: one row per phase, one column per target (medians), the total and the slowest phase; a
    pool's two sides (from their own traces) as columns of their own."""
    targets: dict[str, Any] = dict(report["targets"])
    for side, phases in (report.get("pool") or {}).get("sides", {}).items():
        targets[f"pool: {side}"] = phases
    names = list(targets)
    rows = [("phase", *names)]
    for phase in PHASES:
        rows.append((phase, *[_cell(t["phases"][phase]) for t in targets.values()]))
    rows.append(("total", *[_ms(t["total_median"]) for t in targets.values()]))
    if any("whole" in t for t in targets.values()):  # end to end, beside the phases' sum
        rows.append(("whole sync", *[_ms(t.get("whole", {}).get("median")) for t in targets.values()]))
    rows.append(("slowest", *[str(t["slowest"]) for t in targets.values()]))
    if any("requests_finished" in t for t in targets.values()):
        rows.append(("requests finished", *[t.get("requests_finished", "-") for t in targets.values()]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    head = (
        f"sync phases: {report.get('backend')} on {report.get('device')}, {report.get('num_tensors')} tensors, "
        f"{report.get('num_bytes', 0) / 1e9:.3f} GB, medians of {report.get('settings', {}).get('syncs')} syncs "
        "(± half their min-max range)"
    )
    lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def plot_sync_report(report: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Bars of each phase's median per target (ms), one group of bars per target (in-process, pool), with the
    min-max range of the syncs as error bars: the slowest phase is the tallest bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets: Mapping[str, Any] = report["targets"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(targets), 1)
    colors = ["#3b6fb6", "#e08a3c", "#6aa84f"]
    for i, (name, t) in enumerate(targets.items()):
        got = [t["phases"][p] or {} for p in PHASES]
        values = [(g.get("median") or 0.0) * 1000 for g in got]
        low = [v - g.get("min", g.get("median") or 0.0) * 1000 for v, g in zip(values, got, strict=True)]
        high = [g.get("max", g.get("median") or 0.0) * 1000 - v for v, g in zip(values, got, strict=True)]
        xs = [j + (i - (len(targets) - 1) / 2) * width for j in range(len(PHASES))]
        bars = ax.bar(xs, values, width=width, label=name, color=colors[i % len(colors)], yerr=[low, high], capsize=3)
        ax.bar_label(bars, labels=[_ms((t["phases"][p] or {}).get("median")) for p in PHASES], fontsize=8, rotation=0)
    ax.set_xticks(range(len(PHASES)), list(PHASES))
    ax.set_ylabel("ms (median; bars: min-max)")
    ax.set_title(f"weight sync by phase: {report.get('backend')} on {report.get('device')}")
    ax.legend()
    ax.margins(y=0.15)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_plot(report: Mapping[str, Any], path: str, say: Callable[[str], None]) -> None:
    """The PNG, or one line saying why not (matplotlib is optional)."""
    try:
        say(f"wrote {plot_sync_report(report, path)}")
    except ImportError as exc:
        say(f"no chart ({path}): matplotlib is missing ({exc}); pip install 'genengine[plot]'")
