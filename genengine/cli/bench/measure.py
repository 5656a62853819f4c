"""The measurements of ``genengine bench``: settings, memory probe, and the run that fills the report.

Memory is what the trainer would see: on a GPU the device-wide use from ``torch.cuda.mem_get_info``
(engines that keep memory in another process, like SGLang's scheduler, are counted); on CPU the resident
set size of this process, after returning freed heap to the OS (``malloc_trim``), so memory an engine
freed counts as freed even when the allocator would have kept it for the next tensor.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from genengine.errors import ConfigError, GenEngineError, InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["TINY_MODEL", "BenchSettings", "MemoryProbe", "random_weights", "run_bench"]

GB = 1e9
TINY_MODEL = {"num_params": 20_000_000, "vocab_size": 4096, "dtype": "float32"}
"""The model ``genengine bench`` builds on a CPU when no ``--model`` is given: big enough that copies and
frees are visible above allocator noise, small enough for the whole run to take well under a minute on two
cores. On a GPU it builds the tiny model's default shapes in bfloat16 (the engines' kernel caches know them,
and vLLM takes no float32); real numbers there need a real-sized ``--model``."""


@dataclass
class BenchSettings:
    """What to measure. The defaults finish in well under two minutes on a two-core CPU."""

    backend: Any = "transformers"
    model: str | None = None
    tp_size: int = 1
    options: Mapping[str, Any] = field(default_factory=dict)
    dtype: str | None = None
    mem_util: float | None = None
    batch_size: int = 8
    prompt_len: int = 32
    max_new_tokens: int = 32
    repeats: int = 3
    bucket_bytes: int | None = None
    sleep_levels: tuple[int, ...] = (1, 2)
    raw: bool = True
    pair_samples: int = 10
    """Paired rounds of ours and the raw engine (a plugin's ``raw_engine``; genengine.cli.bench.p1), >= 10."""
    per_parameter: bool = True
    progress: bool = True
    seed: int = 0

    def check(self) -> None:
        """Reject bad settings before anything is built or loaded."""
        for name, low in (("batch_size", 1), ("prompt_len", 1), ("max_new_tokens", 1), ("repeats", 1), ("tp_size", 1),
                          ("pair_samples", 10)):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgumentError(f"{name}={value!r} must be an integer >= {low}")
        if self.bucket_bytes is not None and (not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1):
            raise InvalidArgumentError(f"bucket_bytes={self.bucket_bytes!r} must be a positive integer or None")
        bad = [lvl for lvl in self.sleep_levels if lvl not in (1, 2)]
        if bad:
            raise InvalidArgumentError(f"sleep level {bad[0]!r}: allowed are 1 and 2")
        if self.model is not None and not os.path.isdir(self.model):
            raise ConfigError(
                f"model={self.model!r} is not a local model folder: the benchmark reads the checkpoint's "
                "safetensors to play the trainer's weights"
            )


# ---- memory ----------------------------------------------------------------------------------------------
class MemoryProbe:
    """Used memory as the trainer sees it: device-wide on GPU, resident set size on CPU."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.kind = "torch.cuda.mem_get_info" if device.startswith("cuda") else "process RSS (anonymous)"
        self._libc: Any = None
        if not device.startswith("cuda") and platform.system() == "Linux":
            with contextlib.suppress(OSError):
                self._libc = ctypes.CDLL("libc.so.6")

    def used(self) -> int | None:
        gc.collect()
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            return _all_ranks_sum(int(total - free))
        if self._libc is not None:
            with contextlib.suppress(AttributeError):
                self._libc.malloc_trim(0)
        try:
            # Anonymous pages only: file-backed ones (shared libraries, a checkpoint mmapped by the loader)
            # are not memory a trainer could get back.
            with open("/proc/self/status", encoding="ascii") as fh:
                for line in fh:
                    if line.startswith("RssAnon:"):
                        return _all_ranks_sum(int(line.split()[1]) * 1024)
        except (OSError, ValueError):
            pass
        try:
            import psutil  # type: ignore[import-untyped]
        except ImportError:
            return None
        return _all_ranks_sum(int(psutil.Process().memory_info().rss))


def _dist_initialized() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return bool(dist.is_available() and dist.is_initialized())


def _all_ranks_sum(value: int) -> int:
    """Memory summed over the world's ranks (each measures its own device), so a TP engine counts whole."""
    if not _dist_initialized():
        return value
    import torch.distributed as dist

    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return int(sum(values))


def _rank() -> int:
    if not _dist_initialized():
        return 0
    import torch.distributed as dist

    return int(dist.get_rank())


def _world_size() -> int:
    if not _dist_initialized():
        return 1
    import torch.distributed as dist

    return int(dist.get_world_size())


def _sub(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


# ---- helpers ---------------------------------------------------------------------------------------------
def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def _model_config(model: str) -> dict[str, Any]:
    with open(os.path.join(model, "config.json"), encoding="utf-8") as fh:
        data: dict[str, Any] = json.load(fh)
    return data


def model_vocab_size(model: str) -> int:
    cfg = _model_config(model)
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int):
        raise ConfigError(f"cannot find vocab_size in {model}/config.json")
    return vocab


def trainer_weights(model: str, device: str, dtype: str | None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors on the trainer's device, in the engine's dtype: what a trainer would send."""
    import torch
    from safetensors.torch import load_file

    files = sorted(Path(model).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model={model!r} has no *.safetensors files to play the trainer's weights")
    cast = getattr(torch, dtype) if dtype in ("bfloat16", "float16", "float32") else None
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f), device=device).items():
            tensors[name] = t.to(cast) if cast is not None and t.is_floating_point() else t
    return tensors


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not enabled, leave=False, dynamic_ncols=True)


def device_for(settings: BenchSettings) -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return f"cuda:{local}"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({os.cpu_count()} cores)"


def _maybe_init_distributed(device: str) -> bool:
    """Under torchrun the benchmark plays the trainer: it owns the default process group."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or _dist_initialized():
        return False
    import torch
    import torch.distributed as dist

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return True


def resolve_backend(given: Any) -> tuple[Any, str, str | None, Any]:
    """(backend for the config, display name, distribution, raw runner); imports the engine's module now,
    so a bad name fails before any model is built and imports do not count as engine memory."""
    from genengine.plugins.registry import get_backend, resolve_ref

    backend = given
    if isinstance(backend, str) and ":" in backend:
        try:
            backend = resolve_ref(backend)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"backend={given!r} cannot be imported: {exc}") from exc
        return backend, f"{backend.__module__}.{backend.__qualname__}", None, None
    if isinstance(backend, str):
        info = get_backend(backend)
        if isinstance(info.factory, str):
            importlib.import_module(info.factory.partition(":")[0])
        return backend, backend, info.distribution, info.raw_runner
    return backend, getattr(backend, "__qualname__", type(backend).__name__), None, None


# ---- the benchmark ---------------------------------------------------------------------------------------
def run_bench(settings: BenchSettings) -> dict[str, Any]:
    """Run every measurement and return the report (plain JSON-able data)."""
    settings.check()
    if settings.tp_size > 1 and int(os.environ.get("WORLD_SIZE", "1")) < settings.tp_size:
        raise ConfigError(
            f"tp_size={settings.tp_size} needs a torch.distributed world of at least {settings.tp_size} ranks: "
            f"run `torchrun --nproc-per-node {settings.tp_size} -m genengine.cli bench ...`"
        )
    resolved = resolve_backend(settings.backend)
    with contextlib.ExitStack() as stack:
        model = settings.model
        built = False
        if model is None:
            from genengine.models.tiny_model import build_tiny_model

            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="genengine-bench-"))
            import torch

            on_gpu = torch.cuda.is_available()
            kwargs: dict[str, Any] = {"dtype": "bfloat16"} if on_gpu else dict(TINY_MODEL)
            model = str(build_tiny_model(Path(tmp) / "model", **kwargs))
            built = True
            if settings.dtype is None:
                settings.dtype = kwargs["dtype"]
        return _run(settings, model, built, resolved)


def _run(
    settings: BenchSettings, model: str, built: bool, resolved: tuple[Any, str, str | None, Any]
) -> dict[str, Any]:
    import torch

    from genengine.config import EngineConfig
    from genengine.plugins.registry import create_engine, resolve_ref
    from genengine.plugins.versions import genengine_version
    from genengine.protocol import SamplingParams

    t_total = time.perf_counter()
    device = device_for(settings)
    owns_group = _maybe_init_distributed(device)
    show = settings.progress and _rank() == 0
    backend, name, distribution, raw_runner = resolved

    from genengine.cli.bench import p1

    raw_engine = p1.raw_engine_ref(backend) if settings.raw and settings.tp_size == 1 else None
    fields: dict[str, Any] = {"backend": backend, "model": model, "tp_size": settings.tp_size}
    if settings.dtype is not None:
        fields["dtype"] = settings.dtype
    if settings.mem_util is not None:
        fields["mem_util"] = settings.mem_util
    elif raw_engine is not None and device.startswith("cuda"):  # both engines at once on the GPU
        fields["mem_util"] = p1.PAIRED_GPU_MEM_UTIL
    config = EngineConfig(options=dict(settings.options), seed=settings.seed, **fields)

    vocab = model_vocab_size(model)
    gen = torch.Generator().manual_seed(settings.seed)
    low = min(10, vocab - 1)
    prompts = torch.randint(low, vocab, (settings.batch_size, settings.prompt_len), generator=gen).tolist()
    probe = MemoryProbe(device)
    report: dict[str, Any] = {
        "genengine_version": genengine_version(),
        "backend": name,
        "distribution": distribution,
        "model": "tiny (built by genengine bench)" if built else model,
        "model_config": {
            k: _model_config(model).get(k)
            for k in ("architectures", "hidden_size", "num_hidden_layers", "vocab_size", "torch_dtype", "dtype")
            if k in _model_config(model)
        },
        "device": device_name(device),
        "memory_probe": probe.kind,
        "tp_size": settings.tp_size,
        "rank": _rank(),
        "world_size": _world_size(),
        "dtype": config.dtype,
        "options": dict(config.options),
        "settings": {
            "batch_size": settings.batch_size,
            "prompt_len": settings.prompt_len,
            "max_new_tokens": settings.max_new_tokens,
            "repeats": settings.repeats,
            "bucket_bytes": settings.bucket_bytes,
            "sleep_levels": list(settings.sleep_levels),
        },
    }

    steps = 3 + settings.repeats + 2 * settings.repeats + 2 * len(settings.sleep_levels) + 1
    steps += 1 if settings.raw and raw_runner is not None else 0
    pair = {"vocab": vocab, "batch_size": settings.batch_size, "prompt_len": settings.prompt_len,
            "max_new_tokens": settings.max_new_tokens, "threads": torch.get_num_threads()}  # fmt: skip
    raw_child = None
    with _progress(steps, f"bench {name}", show) as bar, contextlib.ExitStack() as children:
        if raw_engine is not None:  # up before ours: its memory is in the baseline, the profiles do not overlap
            bar.set_postfix_str("raw engine (child process)")
            raw_child = p1.start_raw_child(config, pair)
            children.callback(raw_child.close)
        # The trainer's weights exist before the engine does (and until after it is gone), so on a GPU they
        # are part of the baseline, not of the engine's memory.
        bar.set_postfix_str("reading checkpoint")
        weights = trainer_weights(model, device, config.dtype)
        num_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        report["weights"] = {"num_tensors": len(weights), "num_bytes": num_bytes}
        bar.set_postfix_str("creating engine")
        baseline = probe.used()
        create_s, engine = _timed(lambda: create_engine(config))
        bar.update(1)
        try:
            greedy = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=0.0, ignore_eos=True)
            probe_params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
            bar.set_postfix_str("warm-up")
            engine.generate(prompt_token_ids=prompts[:1], sampling_params=probe_params)
            reference = [
                o.token_ids
                for r in engine.generate(prompt_token_ids=prompts[:2], sampling_params=probe_params)
                for o in r.outputs
            ]
            bar.update(1)
            awake = probe.used()
            report["create_seconds"] = create_s
            report["start_memory_bytes"] = _sub(awake, baseline)

            # --- generation throughput ---------------------------------------------------------------------
            if raw_child is not None:
                bar.set_postfix_str(f"generate, paired with raw ({settings.pair_samples} rounds)")
                report["generate"] = p1.run_pair(
                    p1.OursSide(engine, pair), raw_child, samples=settings.pair_samples, warmup=1
                )
                report["generate"]["tokens"] = settings.batch_size * settings.max_new_tokens
                bar.update(settings.repeats)
            else:
                report["generate"] = p1.generate_runs(engine, prompts, greedy, settings.repeats, bar)

            # --- load_weights ------------------------------------------------------------------------------
            report["load_weights"] = {
                "bucketed": _load_bucketed(engine, weights, num_bytes, settings, prompts, probe_params, bar),
                "per_parameter": _load_per_parameter(engine, weights, num_bytes, settings, show, bar),
            }
            after = [
                o.token_ids
                for r in engine.generate(prompt_token_ids=prompts[:2], sampling_params=probe_params)
                for o in r.outputs
            ]
            report["load_weights"]["greedy_unchanged"] = after == reference
            loaded = probe.used()  # steady state of an RL step: awake, holding weights it was sent

            # --- sleep / wake ------------------------------------------------------------------------------
            report["sleep"] = [
                _sleep_cycle(engine, level, weights, probe, prompts, probe_params, reference, bar)
                for level in settings.sleep_levels
            ]
        finally:
            bar.set_postfix_str("shutdown")
            shutdown_s, _ = _timed(engine.shutdown)
            bar.update(1)
        left = probe.used()
        del weights
        report["shutdown"] = {"seconds": shutdown_s, "memory_left_bytes": _sub(left, baseline)}
        # The engine's memory, the denominator of "share freed by sleep": what it holds awake with loaded
        # weights, above the baseline on a GPU (device-wide, exact). On CPU the first model load also imports
        # code and fills caches that stay resident, and a loader may map the checkpoint's file instead of
        # copying it, so there it is what shutdown gave back.
        engine_memory = _sub(loaded, baseline if not probe.kind.startswith("process RSS") else left)
        report["engine_memory_bytes"] = engine_memory
        for cycle in report["sleep"]:
            freed = cycle.get("freed_bytes")
            cycle["freed_share"] = freed / engine_memory if freed is not None and engine_memory else None

        # --- the raw engine, alone (ours is shut down: a GPU holds one engine at a time) ------------------
        raw: dict[str, Any] = {"available": raw_runner is not None and settings.raw}
        if raw_child is not None:  # paired above: the raw engine's figures are in report["generate"]
            pass
        elif settings.raw and raw_runner is not None:
            bar.set_postfix_str("raw engine")
            try:
                raw["tokens_per_s"] = float(resolve_ref(raw_runner)(config, prompts, settings.max_new_tokens))
            except Exception as exc:
                raw["error"] = f"{type(exc).__name__}: {exc}"
            bar.update(1)
        if raw_child is None:
            raw_tps = raw.get("tokens_per_s")
            report["generate"]["raw_tokens_per_s"] = raw_tps
            report["generate"]["raw_error"] = raw.get("error")
            report["generate"]["vs_raw"] = report["generate"]["tokens_per_s"] / raw_tps if raw_tps else None
    report["total_seconds"] = time.perf_counter() - t_total
    if owns_group:
        import torch.distributed as dist

        dist.destroy_process_group()
    return report


def _barrier(engine: Any, prompts: list[list[int]], *, flush: bool = False) -> None:
    """A one-token generate: an engine that answers before its copies land is timed until it can serve.

    Its own cost is measured with a flushed prefix cache, as it runs after a load (which flushes).
    """
    if flush:
        engine.flush_cache()
    engine.generate(prompt_token_ids=prompts[:1], sampling_params={"max_new_tokens": 1, "temperature": 0.0})


def _load_bucketed(
    engine: Any,
    weights: dict[str, Any],
    num_bytes: int,
    settings: BenchSettings,
    prompts: list[list[int]],
    probe_params: Any,
    bar: Any,
) -> dict[str, Any]:
    engine.load_weights(list(weights.items()), bucket_bytes=settings.bucket_bytes)  # first touch is not steady state
    barrier_s = min(_timed(lambda: _barrier(engine, prompts, flush=True))[0] for _ in range(2))
    runs = []
    for i in range(settings.repeats):
        bar.set_postfix_str(f"load_weights bucketed {i + 1}/{settings.repeats}")
        secs, rep = _timed(lambda: engine.load_weights(list(weights.items()), bucket_bytes=settings.bucket_bytes))
        visible, _ = _timed(lambda: _barrier(engine, prompts))
        runs.append((secs, secs + visible - barrier_s, rep))
        bar.update(1)
    secs = statistics.median(r[0] for r in runs)
    visible_s = statistics.median(r[1] for r in runs)
    return {
        "seconds": secs,
        "until_visible_seconds": max(visible_s, secs),
        "gb_per_s": num_bytes / secs / GB,
        "calls": 1,
        "num_buckets": runs[0][2].num_buckets,
        "bucket_bytes": settings.bucket_bytes,
        "num_tensors": runs[0][2].num_tensors,
    }


def _load_per_parameter(
    engine: Any, weights: dict[str, Any], num_bytes: int, settings: BenchSettings, show: bool, bar: Any
) -> dict[str, Any] | None:
    if not settings.per_parameter:
        for _ in range(settings.repeats):
            bar.update(1)
        return None
    runs = []
    for i in range(settings.repeats):
        bar.set_postfix_str(f"load_weights per parameter {i + 1}/{settings.repeats}")
        with _progress(len(weights), "one call per tensor", show) as inner:
            start = time.perf_counter()
            for item in weights.items():
                engine.load_weights([item])
                inner.update(1)
            runs.append(time.perf_counter() - start)
        bar.update(1)
    secs = statistics.median(runs)
    return {
        "seconds": secs,
        "gb_per_s": num_bytes / secs / GB,
        "calls": len(weights),
        "seconds_per_call": secs / len(weights),
    }


def _sleep_cycle(
    engine: Any,
    level: int,
    weights: dict[str, Any],
    probe: MemoryProbe,
    prompts: list[list[int]],
    probe_params: Any,
    reference: list[list[int]],
    bar: Any,
) -> dict[str, Any]:
    """One sleep(level) and the staged wake a trainer does: weights → (level 2: load_weights) → the rest."""
    bar.set_postfix_str(f"sleep level {level}")
    before = probe.used()
    cycle: dict[str, Any] = {"level": level}
    try:
        sleep_s, _ = _timed(lambda: engine.sleep(level))
    except GenEngineError as exc:
        cycle["error"] = f"{type(exc).__name__}: {exc}"
        bar.update(2)
        return cycle
    asleep = probe.used()
    freed = _sub(before, asleep)
    cycle.update(
        {
            "sleep_seconds": sleep_s,
            "memory_awake_bytes": before,
            "memory_asleep_bytes": asleep,
            "freed_bytes": freed,
            "wake": [],
        }
    )
    bar.update(1)
    for tag in engine.supported_tags:
        bar.set_postfix_str(f"wake {tag} (level {level})")
        start = time.perf_counter()
        engine.wake([tag])
        secs = time.perf_counter() - start
        cycle["wake"].append({"tag": tag, "seconds": secs, "memory_after_bytes": probe.used()})
        if tag == "weights" and level == 2:
            cycle["reload_seconds"], _ = _timed(lambda: engine.load_weights(list(weights.items())))
    got = [
        o.token_ids
        for r in engine.generate(prompt_token_ids=prompts[:2], sampling_params=probe_params)
        for o in r.outputs
    ]
    cycle["greedy_unchanged"] = got == reference
    bar.update(1)
    return cycle


def random_weights(model_dir: str, version: int, device: str) -> list[tuple[str, Any]]:
    """Every weight ``model_dir`` takes (its checkpoint's names and shapes, or the HF model's for a folder with
    config.json alone), random with seed ``version``: norms at 1, the rest N(0, 0.02); bf16 on a GPU,
    float32 on the CPU. Each tensor is its own allocation, as a trainer's parameters are."""
    import torch

    from genengine.engine.checkpoint import read_model_config, weight_spec

    config = read_model_config(model_dir)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    gen = torch.Generator(device=device).manual_seed(version)
    out = []
    for name, info in sorted(weight_spec(model_dir, config, "auto").items()):
        if not info.required:
            continue
        tensor = torch.empty(info.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=gen)
        out.append((name, tensor))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out
