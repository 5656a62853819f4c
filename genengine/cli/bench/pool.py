"""``genengine bench --pool``: a one-replica colocated ``EnginePool`` against the same engine in-process (P7).

A Ray trainer actor holds the trainer's weights, an engine built in its own process, and a pool whose one
replica shares the trainer's placement-group bundle (its GPU, when there is one), as a colocated RL job
runs. Both engines stay up for the whole run, so their measurements interleave:

* **generate**: greedy batches of random prompt ids until ``min_seconds`` have passed, tokens/s, in-process
  and through the pool in alternating order, ``repeats`` times each; the medians' ratio (goal >= 0.95).
* **weight sync**: ``syncs`` syncs of freshly made weights (a new version each), timed in-process
  (``load_weights``) and through the pool (over ``transport``: ``cuda_ipc`` on a GPU, ``gloo`` on the CPU);
  after each, both engines' greedy outputs must be equal (the replica serves the trainer's new weights) and
  differ from the previous version's.
* **sleep**: device-wide memory freed by ``sleep(sleep_level)`` in-process and through the pool, each beside
  what the engine took at start.

Nothing here runs at import; Ray, torch and the engines are imported in :func:`run_pool_bench`.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from genengine.cli.bench.measure import random_weights
from genengine.engine.environ import scoped_environ
from genengine.engine.ipc import HANDLES, HANDLES_ENV
from genengine.errors import ConfigError, InvalidArgumentError

__all__ = ["PoolBenchSettings", "format_pool_report", "random_weights", "run_pool_bench", "source_root"]

GOALS = {"ratio": 0.95, "sync_seconds": 0.1}


@dataclass
class PoolBenchSettings:
    """What to measure. The defaults are the issue's (5 interleaved repeats of >= 3 s each)."""

    backend: str = "transformers"
    model: str | None = None
    """An HF model folder (config.json alone with ``options={"load_format": "dummy"}``); None: the tiny model."""
    options: Mapping[str, Any] = field(default_factory=dict)
    dtype: str | None = None
    mem_util: float | None = None
    """The in-process engine's share (the backend's default when None)."""
    pool_mem_util: float | None = None
    """The replica's share (default: ``mem_util``). SGLang's is a fraction of the whole GPU that it checks
    against what is free when it starts, so a second SGLang on one GPU needs a larger value than the first."""
    batch_size: int = 32
    prompt_len: int = 64
    max_new_tokens: int = 64
    repeats: int = 5
    min_seconds: float = 3.0
    """Each repeat generates for at least this long."""
    syncs: int = 3
    transport: str | None = None
    """None: ``cuda_ipc`` on a GPU, ``gloo`` on the CPU."""
    bucket_bytes: int | None = None
    checksum: bool = True
    handles: tuple[str, ...] = HANDLES[:1]
    """``cuda_ipc``'s ways of sharing (``GENENGINE_CUDA_IPC_HANDLES``), taken in turn by the syncs (version v
    uses ``handles[v % len(handles)]``): two give both ways' sync times side by side in one run."""
    sleep: bool = True
    sleep_level: int = 1
    """The level both sides sleep at. Level 2 frees as much device memory as level 1 (vLLM's level 1 copies the
    weights to pinned host memory first: 17-19 s per engine at 7B on the H200)."""
    weights: str = "genengine.cli.bench.pool:random_weights"
    """``module:function`` called in the trainer actor as ``fn(model_dir, version, device)``: the trainer's
    (name, tensor) pairs for that version."""
    num_cpus: float = 1.0
    """Ray CPUs of the trainer actor and of the replica each (their bundle holds both)."""
    seed: int = 0

    def check(self) -> None:
        """Refuse bad values before Ray or an engine starts."""
        for name in ("batch_size", "prompt_len", "max_new_tokens", "repeats", "syncs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name}={value!r} must be an integer >= 1")
        if (
            isinstance(self.min_seconds, bool)
            or not isinstance(self.min_seconds, (int, float))
            or self.min_seconds <= 0
        ):
            raise InvalidArgumentError(f"min_seconds={self.min_seconds!r} must be a number > 0")
        for name in ("mem_util", "pool_mem_util"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1
            ):
                raise InvalidArgumentError(
                    f"{name}={value!r} must be a number in (0, 1] or None (the backend's default)"
                )
        if self.bucket_bytes is not None and (
            isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1
        ):
            raise InvalidArgumentError(f"bucket_bytes={self.bucket_bytes!r} must be an integer >= 1 or None")
        if isinstance(self.num_cpus, bool) or not isinstance(self.num_cpus, (int, float)) or self.num_cpus <= 0:
            raise InvalidArgumentError(f"num_cpus={self.num_cpus!r} must be a number > 0")
        if not self.handles or not all(h in HANDLES for h in self.handles):
            raise InvalidArgumentError(
                f"handles={self.handles!r}: allowed are {' and '.join(map(repr, HANDLES))}, at least one"
            )
        if self.sleep_level not in (1, 2) or isinstance(self.sleep_level, bool):
            raise InvalidArgumentError(f"sleep_level={self.sleep_level!r}: allowed are 1 and 2")
        if not isinstance(self.weights, str) or ":" not in self.weights:
            raise InvalidArgumentError(f"weights={self.weights!r} must be 'module:function'")
        if self.model is not None and not os.path.isdir(self.model):
            raise ConfigError(f"model={self.model!r} is not a local model folder")
        if not isinstance(self.backend, str):
            raise InvalidArgumentError(
                f"backend={self.backend!r} must be a registered backend's name (a pool's replicas build it)"
            )
        from genengine.plugins.registry import get_backend

        get_backend(self.backend)  # an unknown name raises, listing the registered ones
        if self.transport is not None:
            from genengine.transport import get_transport

            get_transport(self.transport)  # an unknown name raises, listing the registered ones


class PoolBenchTrainer:
    """The trainer actor (``ray.remote`` is applied by :func:`run_pool_bench`): it owns both engines."""

    def __init__(self, settings: PoolBenchSettings, placement_group: Any) -> None:
        self.s = settings
        self.pg = placement_group

    def run(self) -> dict[str, Any]:
        import torch

        from genengine.engine.checkpoint import read_model_config, vocab_size
        from genengine.plugins.registry import create_engine
        from genengine.protocol import SamplingParams
        from genengine.ray import EnginePool

        s = self.s
        gpu = torch.cuda.is_available()
        device = "cuda" if gpu else "cpu"
        model = s.model
        if model is None:
            from genengine.models.tiny_model import tiny_model_dir

            model = str(tiny_model_dir())
        from genengine.plugins.registry import resolve_ref

        make = resolve_ref(s.weights)
        if not callable(make):
            raise ConfigError(f"weights={s.weights!r} is not callable")

        def free() -> int | None:
            """Device-wide free bytes, the trainer's own cached blocks returned first: vLLM's in-process sleep
            empties this process's cache, so without it the old weight versions' blocks (22 GB at 7B on the
            H200) counted as freed by the engine."""
            if not gpu:
                return None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            return int(torch.cuda.mem_get_info()[0])

        def diff(a: int | None, b: int | None) -> int | None:
            return None if a is None or b is None else a - b

        base: dict[str, Any] = {"backend": s.backend, "model": model, **dict(s.options)}
        if s.dtype is not None:
            base["dtype"] = s.dtype
        mem: dict[str, Any] = {} if s.mem_util is None else {"mem_util": s.mem_util}
        pool_mem_util = s.pool_mem_util if s.pool_mem_util is not None else s.mem_util
        pool_mem: dict[str, Any] = {} if pool_mem_util is None else {"mem_util": pool_mem_util}
        transport = s.transport or ("cuda_ipc" if gpu else "gloo")
        topts: dict[str, Any] = {"checksum": s.checksum}
        if s.bucket_bytes is not None:
            topts["bucket_bytes"] = s.bucket_bytes
        report: dict[str, Any] = {
            "backend": s.backend,
            "model": model,
            "device": torch.cuda.get_device_name() if gpu else f"cpu ({os.cpu_count()} cores)",
            "transport": transport,
            "settings": asdict(s),
            "goals": GOALS,
        }
        held = [make(model, 1, device)]  # a trainer holds its parameters before it builds an engine
        t0 = free()
        start = time.perf_counter()
        engine = create_engine(**base, **mem)
        report["start_seconds"] = {"in_process": time.perf_counter() - start}
        t1 = free()
        pool = None
        try:
            start = time.perf_counter()
            pool = EnginePool(
                **base,
                **pool_mem,
                placement="colocated",
                placement_group=self.pg,
                bundle_indices=[0],
                num_gpus=0.4 if gpu else 0,
                num_cpus=s.num_cpus,
                transport=transport,
                transport_options=topts,
            )
            report["start_seconds"]["pool"] = time.perf_counter() - start
            t2 = free()
            report["taken_bytes"] = {"in_process": diff(t0, t1), "pool": diff(t1, t2)}
            targets = {"in_process": engine, "pool": pool}
            rng = random.Random(s.seed)
            vocab = vocab_size(read_model_config(model)) or 100
            prompts = [[rng.randrange(1, vocab) for _ in range(s.prompt_len)] for _ in range(s.batch_size)]
            params = SamplingParams(temperature=0.0, max_new_tokens=s.max_new_tokens, ignore_eos=True)
            for target in targets.values():  # warm-up: first-call compiles, Ray's first round trips
                target.generate(prompt_token_ids=prompts[:4], sampling_params=params)

            def rate(target: Any) -> float:
                tokens, begin = 0, time.perf_counter()
                while True:
                    out = target.generate(prompt_token_ids=prompts, sampling_params=params)
                    tokens += sum(len(o.token_ids) for r in out for o in r.outputs)
                    elapsed = time.perf_counter() - begin
                    if elapsed >= s.min_seconds:
                        return tokens / elapsed

            rates: dict[str, list[float]] = {"in_process": [], "pool": []}
            for i in range(s.repeats):  # ABBA: neither side always runs first
                for which in ("in_process", "pool") if i % 2 == 0 else ("pool", "in_process"):
                    rates[which].append(rate(targets[which]))
            medians = {k: statistics.median(v) for k, v in rates.items()}
            # How far the machine moved during the run: each side's (max - min) / median, and the median of the
            # ratios of repeat i's two runs, which ran back to back (a drift shared by both cancels in it).
            spread = {k: (max(v) - min(v)) / medians[k] for k, v in rates.items()}
            paired = statistics.median(p / q for p, q in zip(rates["pool"], rates["in_process"], strict=True))
            report["tokens_per_s"] = {"all": rates, "median": medians, "spread": spread}
            report["ratio"] = medians["pool"] / medians["in_process"]
            report["paired_ratio"] = paired
            report["sync"] = self._syncs(targets, held, make, model, device)
            if s.sleep:
                report["sleep"] = {}
                for which, target in targets.items():
                    before = free()
                    target.sleep(s.sleep_level)
                    report["sleep"][which] = {"freed_bytes": diff(free(), before)}
                    target.wake()
        finally:
            if pool is not None:
                pool.shutdown()
            engine.shutdown()
        report["verdicts"] = {
            "ratio": report["ratio"] >= GOALS["ratio"],
            "sync_seconds": report["sync"]["pool_median_s"] <= GOALS["sync_seconds"],
            "outputs_equal": all(row["outputs_equal"] for row in report["sync"]["rows"]),
        }
        return report

    def _syncs(
        self, targets: dict[str, Any], held: list[Any], make: Callable[..., Any], model: str, device: str
    ) -> dict[str, Any]:
        """``held``: the trainer's first weights, handed over (a list emptied here) so that only one version is
        alive at a time, as a trainer's step overwrites its parameters."""
        import torch

        from genengine.protocol import SamplingParams

        s = self.s
        rng = random.Random(s.seed + 1)
        probe = [[rng.randrange(1, 100) for _ in range(16)] for _ in range(4)]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)

        def outputs(target: Any) -> tuple[list[list[int]], list[Any]]:
            got = target.generate(prompt_token_ids=probe, sampling_params=greedy)
            return [o.token_ids for r in got for o in r.outputs], [o.weight_versions for r in got for o in r.outputs]

        from genengine.cli.bench.sync import one_sync, split_traced, summarize_phases
        from genengine.transport import TRACE_ENV

        trace_dir = os.environ.get(TRACE_ENV)
        phases: dict[str, list[dict[str, Any]]] = {"in_process": [], "pool": []}
        rows: list[dict[str, Any]] = []
        previous: list[list[int]] | None = None
        weights: list[Any] = []
        for version in range(1, s.syncs + 1):
            if version > 1:
                weights = []  # the old version's tensors go first
                weights = make(model, version, device)
            else:
                weights = held.pop()
            seconds, buckets = {}, {}
            handles = s.handles[version % len(s.handles)]
            for which in ("in_process", "pool"):
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                with scoped_environ({HANDLES_ENV: handles} if which == "pool" else {}):
                    # pause, gather, load_weights, resume (genengine bench --sync's phases), the call timed alone
                    since = time.time() - 1.0  # file times are coarse; the files of this sync are newer still
                    times = one_sync(targets[which], weights, version=version)
                    seconds[which] = times["load"]
                if which == "pool" and trace_dir:
                    times.update(split_traced(times["load"], trace_dir, version, since=since) or {})
                phases[which].append(times)
                buckets[which] = times["num_buckets"]
            local, _ = outputs(targets["in_process"])
            pooled, labels = outputs(targets["pool"])
            rows.append(
                {
                    "version": version,
                    "handles": handles,
                    "seconds": seconds,
                    "buckets": buckets,
                    "outputs_equal": pooled == local,
                    "changed": previous is None or pooled != previous,
                    "labels_ok": all(label == ((0, version),) for label in labels),
                }
            )
            previous = pooled
        local_s = [r["seconds"]["in_process"] for r in rows]
        later = rows[1:] or rows  # the first sync forms the group
        by_handles = {
            h: statistics.median(r["seconds"]["pool"] for r in later if r["handles"] == h)
            for h in s.handles
            if any(r["handles"] == h for r in later)
        }
        return {
            "rows": rows,
            # each sync's phases after the first (which forms the group), as genengine bench --sync reports them
            "phases": {k: summarize_phases(v[1:] or v) for k, v in phases.items()},
            "pool_median_s": by_handles.get(s.handles[0], statistics.median(r["seconds"]["pool"] for r in later)),
            "pool_median_s_by_handles": by_handles,
            "in_process_median_s": statistics.median(local_s[1:] or local_s),
            "num_tensors": len(weights),
            "num_bytes": sum(t.numel() * t.element_size() for _, t in weights),
        }


def source_root() -> str:
    """The folder that holds the ``genengine`` package, for the Ray workers' ``PYTHONPATH``: never the package
    folder itself, whose ``ray`` subpackage would then shadow Ray in every worker."""
    return str(Path(__file__).resolve().parents[__name__.count(".")])


def run_pool_bench(settings: PoolBenchSettings) -> dict[str, Any]:
    """Start (or join) Ray, put the trainer actor in a one-bundle placement group and run the measurements
    there; returns the report (plain JSON-able data)."""
    settings.check()
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError as exc:
        raise ConfigError(f"bench --pool needs Ray (pip install 'genengine[ray]'): {exc}") from exc
    import torch

    gpu = torch.cuda.is_available()
    started = not ray.is_initialized()
    if started:
        here = source_root()
        module = sys.modules.get(settings.weights.partition(":")[0])
        paths = [here, *([os.path.dirname(module.__file__)] if module and module.__file__ else [])]
        path = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])
        ray.init(include_dashboard=False, num_cpus=4, runtime_env={"env_vars": {"PYTHONPATH": path}})
    cpus = 2 * settings.num_cpus
    pg = placement_group([{"GPU": 1, "CPU": cpus}] if gpu else [{"CPU": cpus}])
    actor: Any = None
    try:
        ray.get(pg.ready(), timeout=120)
        strategy = PlacementGroupSchedulingStrategy(pg, 0)
        trainer: Any = ray.remote(PoolBenchTrainer)
        options = {"num_gpus": 0.2 if gpu else 0, "num_cpus": settings.num_cpus, "scheduling_strategy": strategy}
        actor = trainer.options(**options).remote(settings, pg)
        report: dict[str, Any] = ray.get(actor.run.remote())
        return report
    finally:
        if actor is not None:
            ray.kill(actor)
        remove_placement_group(pg)
        if started:
            ray.shutdown()


def format_pool_report(report: Mapping[str, Any]) -> str:
    """The report as a small table."""
    gib = float(1 << 30)

    def mem(n: Any) -> str:
        return "n/a (CPU)" if n is None else f"{n / gib:.2f} GiB"

    t, sync, cfg = report["tokens_per_s"], report["sync"], report["settings"]
    rows = [
        ("backend", f"{report['backend']} on {report['device']}; transport {report['transport']}"),
        (
            "generate",
            f"{cfg['batch_size']} prompts x {cfg['prompt_len']} ids -> {cfg['max_new_tokens']} tokens, greedy; "
            f"{cfg['repeats']} interleaved repeats of >= {cfg['min_seconds']:g} s each",
        ),
        (
            "in-process tokens/s",
            f"median {t['median']['in_process']:.0f} (all {[round(x) for x in t['all']['in_process']]})",
        ),
        ("pool tokens/s", f"median {t['median']['pool']:.0f} (all {[round(x) for x in t['all']['pool']]})"),
        (
            "pool / in-process",
            f"{report['ratio']:.3f} (goal >= {GOALS['ratio']}); paired {report['paired_ratio']:.3f}; spread "
            f"in-process {t['spread']['in_process']:.0%}, pool {t['spread']['pool']:.0%}",
        ),
        (
            "weight sync",
            f"{sync['num_tensors']} tensors, {sync['num_bytes'] / gib:.2f} GiB: in-process median "
            f"{sync['in_process_median_s']:.4f} s, pool median {sync['pool_median_s']:.4f} s "
            f"(goal <= {GOALS['sync_seconds']}; the first sync, which forms the group, left out)"
            + (
                "; by cuda_ipc handles: "
                + ", ".join(f"{h} {v:.4f} s" for h, v in sync["pool_median_s_by_handles"].items())
                if len(sync.get("pool_median_s_by_handles", {})) > 1
                else ""
            ),
        ),
        (
            "after each sync",
            ", ".join(
                f"v{r['version']}: {'equal' if r['outputs_equal'] else 'DIFFERENT'}"
                f"{'' if r['changed'] else ' (unchanged!)'}{'' if r['labels_ok'] else ' (bad labels)'}"
                for r in sync["rows"]
            ),
        ),
    ]
    if "sleep" in report and report.get("taken_bytes", {}).get("pool") is not None:  # device memory: GPUs only
        taken = report.get("taken_bytes", {})
        rows.append(
            (
                f"sleep({report['settings'].get('sleep_level', 1)}) frees",
                "; ".join(
                    f"{k}: {mem(v['freed_bytes'])} of {mem(taken.get(k))} taken" for k, v in report["sleep"].items()
                ),
            )
        )
    width = max(len(k) for k, _ in rows)
    table = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
    if "phases" in sync:  # the same syncs by phase (genengine bench --sync's table)
        from genengine.cli.bench.sync import format_sync_report

        table += "\n" + format_sync_report(pool_sync_phases(report))
    return table


def pool_sync_phases(report: Mapping[str, Any]) -> dict[str, Any]:
    """The pool report's sync phases in the shape of ``run_sync_bench``'s report (for the table and chart)."""
    sync = report["sync"]
    return {
        "backend": f"{report['backend']} (pool over {report['transport']})",
        "device": report["device"],
        "num_tensors": sync["num_tensors"],
        "num_bytes": sync["num_bytes"],
        "settings": {"syncs": max(len(sync["rows"]) - 1, 1)},
        "targets": sync["phases"],
    }
