"""The claims every engine's GPU tests make, written once so that their measurements and thresholds agree.

Sleep gives back >= 99 % of what the engine holds; a load in each weight-sync mode gives what a fresh engine on
the new weights gives; logprobs stay at transformers parity over weight syncs and do not drift. What differs
between engines (the engine, its options, its mode names, how a test steps the weights, how close wake must
come) stays in the test modules and comes in as arguments. Importable without a GPU: torch only inside.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from genengine.protocol import GenerationEngine, GenerationResult, LoadReport
from genengine.testing.conformance import GREEDY, PROMPTS
from genengine.testing.parity import bf16_copy, mean_logprob_gap, parity_bound

__all__ = [
    "DRIFT_SLACK",
    "GIB",
    "CacheDrift",
    "ParityOverSyncs",
    "SleepReading",
    "assert_loads_like_fresh",
    "assert_sleep_freed",
    "current_gpu_uuid",
    "free_gpu_memory",
    "gpu_memory_by_process",
    "gpu_memory_by_process_per_gpu",
    "installed_engine",
    "prefix_cache_drift",
    "sleep_and_wake",
    "token_ids",
    "weight_sync_mode",
]

GIB = 1 << 30
DRIFT_SLACK = 0.003
"""How much the mean gap of the last five syncs may exceed the first five's before it counts as drift."""


def installed_engine(override_env: str) -> str | None:
    """The GPU engine a test module drives: ``$override_env`` if set, else SGLang if importable, else vLLM.

    The GPU kit installs one engine per run (they cannot share an environment); None when neither is there.
    """
    import importlib.util
    import os

    chosen = os.environ.get(override_env)
    if chosen:
        return chosen
    for name in ("sglang", "vllm"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def free_gpu_memory() -> int:
    """Free bytes on the current CUDA device after this process returns its cached blocks: what a trainer
    could allocate now, so engine memory is read the way the trainer sees it."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0])


def who_holds_gpu_memory() -> str:
    """For a failed "memory is back" check: how much of this process's GPU memory torch's caching allocator
    still has allocated (live tensors: someone keeps a reference), its largest live blocks, and the rest
    (outside torch: CUDA context, cuBLAS/NCCL workspaces, a foreign allocator such as vLLM's cumem pool)."""
    import torch

    allocated = torch.cuda.memory_allocated()
    blocks = sorted(
        (b["size"] for seg in torch.cuda.memory_snapshot() for b in seg["blocks"] if b["state"] == "active_allocated"),
        reverse=True,
    )
    return (
        f"torch allocator: {allocated / 2**20:.1f} MiB allocated in {len(blocks)} live blocks "
        f"(largest, MiB: {[round(b / 2**20, 1) for b in blocks[:8]]}), "
        f"{torch.cuda.memory_reserved() / 2**20:.1f} MiB reserved"
    )


def current_gpu_uuid() -> str:
    """NVML's name of the current CUDA device (``GPU-<uuid>``), the same under any ``CUDA_VISIBLE_DEVICES``."""
    import torch

    return f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"


def gpu_memory_by_process_per_gpu() -> dict[str, dict[int, float]]:
    """GiB that NVML charges to each process on every GPU of the host, keyed by ``current_gpu_uuid``'s
    names: which GPU each of an engine's processes landed on. {} where NVML is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
        usage: dict[str, dict[int, float]] = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            usage[uuid.decode() if isinstance(uuid, bytes) else str(uuid)] = {
                int(p.pid): round((p.usedGpuMemory or 0) / GIB, 3) for p in procs
            }
    except Exception:  # a reading for the failure message, never a failure of its own
        return {}
    return usage


def gpu_memory_by_process() -> dict[int, float]:
    """GiB that NVML charges to each process on the current device: when a sleep leaves memory behind,
    this says whether the trainer's process or an engine process keeps it. {} where NVML is missing."""
    try:
        uuid = current_gpu_uuid()
    except Exception:
        return {}
    return gpu_memory_by_process_per_gpu().get(uuid, {})


def token_ids(results: Sequence[GenerationResult]) -> list[list[list[int]]]:
    """Each result's sampled token ids: what greedy comparisons compare (logprobs differ in the last bits)."""
    return [[o.token_ids for o in r.outputs] for r in results]


# ---- sleep and wake ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SleepReading:
    """Free GPU bytes around one sleep/wake cycle, and what the engine held before it."""

    level: int
    held: int
    awake: int
    asleep: int
    woke: int
    detail: str = ""

    @property
    def freed(self) -> int:
        """Bytes sleep gave back."""
        return self.asleep - self.awake

    def describe(self) -> str:
        """One line for logs and failure messages: the share freed, then which process kept what."""
        return (
            f"level {self.level}: sleep freed {self.freed / GIB:.2f} of the {self.held / GIB:.2f} GiB held "
            f"({self.freed / self.held:.2%}), wake left {self.not_taken_back / GIB:.2f} GiB free; {self.detail}"
        )

    @property
    def not_taken_back(self) -> int:
        """Bytes free after wake beyond those free before sleep: 0 when wake took back exactly what sleep freed."""
        return self.woke - self.awake


def sleep_and_wake(engine: GenerationEngine, level: int, free_before_start: int) -> SleepReading:
    """Sleep ``engine`` at ``level``, read the memory, wake it; assert it holds > 1 GiB.

    What the engine holds is read now against ``free_before_start`` (free memory before it started), not at
    start-up: an engine can keep allocating after it returns, and an early reading made the share meaningless.
    The engine is awake again before anything about the share is asserted (``assert_sleep_freed``), so a
    failed claim leaves it usable; how close wake must come back differs between engines: the caller's check.
    """
    import os

    import torch

    awake = free_gpu_memory()
    held = free_before_start - awake
    assert held > GIB, f"the engine holds only {held / GIB:.2f} GiB"
    awake_by_process = gpu_memory_by_process()
    engine.sleep(level)
    asleep = free_gpu_memory()
    ours = f"pid {os.getpid()} is this process: torch allocated {torch.cuda.memory_allocated() / GIB:.3f} GiB"
    by_process = f"GiB per process awake {awake_by_process}, asleep {gpu_memory_by_process()} ({ours})"
    engine.wake()
    reading = SleepReading(
        level=level, held=held, awake=awake, asleep=asleep, woke=free_gpu_memory(), detail=by_process
    )
    print(reading.describe())
    return reading


def assert_sleep_freed(reading: SleepReading, share: float = 0.99) -> None:
    """The claim every backend makes: sleep gives back at least ``share`` of what the engine held."""
    assert reading.freed >= share * reading.held, reading.describe()


# ---- weight-sync modes -------------------------------------------------------------------------------------
@contextmanager
def weight_sync_mode(engine: Any, mode: str) -> Iterator[None]:
    """Run a block with ``engine.weight_sync_mode = mode``, and the engine's previous mode back afterwards,
    so one mode's test cannot leave the class engine loading another way."""
    previous = engine.weight_sync_mode
    engine.weight_sync_mode = mode
    try:
        yield
    finally:
        engine.weight_sync_mode = previous


def assert_loads_like_fresh(
    engine: Any, weights: Mapping[str, Any], fresh: Sequence[GenerationResult], *, bucket_bytes: int | None = None
) -> LoadReport:
    """Load ``weights`` in the engine's current mode; assert every tensor arrived and greedy output equals
    ``fresh`` (the suite's engine started on those weights): a load must be as good as a restart.

    Returns the report for the caller's mode-specific checks (bucket counts); restoring the weights is the
    caller's too (the suite's ``restoring`` block), since where that sits decides which mode restores them.
    """
    mode = engine.weight_sync_mode
    report: LoadReport = engine.load_weights(weights.items(), bucket_bytes=bucket_bytes)
    assert report.num_tensors == len(weights), f"weight_sync_mode={mode}: {report}"
    assert token_ids(engine.generate(PROMPTS, GREEDY)) == token_ids(fresh), f"weight_sync_mode={mode}"
    return report


# ---- logprob parity over weight syncs ----------------------------------------------------------------------
@dataclass
class ParityOverSyncs:
    """Per-sync mean |Δlogprob| of an engine against transformers, with transformers' own bf16 gap beside it.

    The test steps the weights its own way and calls ``measure`` after each sync; ``check`` then holds every
    sync to ``parity_bound`` of the largest floor and fails drift that grows with the syncs (the error SGLang
    users report), which a per-sync bound alone would miss until it crossed the bound.
    """

    engine_name: str
    gaps: list[float] = field(default_factory=list)
    floors: list[float] = field(default_factory=list)

    def measure(self, engine: GenerationEngine, model: Any) -> None:
        """Greedy rollout of the suite's prompts; record the engine's gap to ``model`` and ``model``'s bf16 gap."""
        results = engine.generate(PROMPTS, GREEDY)
        self.gaps.append(mean_logprob_gap(results, model))
        self.floors.append(mean_logprob_gap(results, model, bf16_copy(model)))

    def check(self) -> None:
        """Print both series for the record; assert the bound at every sync and no drift (last 5 vs first 5)."""
        gaps = ", ".join(f"{g:.4f}" for g in self.gaps)
        floors = ", ".join(f"{f:.4f}" for f in self.floors)
        print(f"mean |Δlogprob| {self.engine_name} vs transformers float32, per sync: {gaps}")
        print(f"transformers bf16 vs float32 on the same tokens: {floors}")
        bound = parity_bound(max(self.floors))
        assert max(self.gaps) <= bound, f"mean |Δlogprob| per sync: {gaps} (bound {bound:.4f}; bf16 floors: {floors})"
        first, last = statistics.mean(self.gaps[:5]), statistics.mean(self.gaps[-5:])
        assert last <= first + DRIFT_SLACK, f"drift grows with syncs: {gaps}"


@dataclass(frozen=True)
class CacheDrift:
    """Greedy logprobs of the same prompts: a prefix-cache miss, a hit right after it, a miss after a flush."""

    tokens_equal: bool
    hit: float
    """Largest |Δlogprob| between the miss and the hit."""
    flushed: float
    """Largest |Δlogprob| between the two misses (the floor: the kernels' own run-to-run noise)."""

    def describe(self) -> str:
        return (
            f"tokens equal: {self.tokens_equal}; max |Δlogprob| hit vs miss {self.hit:.4g}, "
            f"miss vs miss {self.flushed:.4g}"
        )


def prefix_cache_drift(engine: GenerationEngine, prompts: list[str], params: Any) -> CacheDrift:
    """Measure what a prefix-cache hit does to greedy logprobs (RL losses consume them)."""

    def logprobs(results: list[GenerationResult]) -> list[float]:
        return [lp for r in results for o in r.outputs for lp in (o.logprobs or [])]

    engine.flush_cache()
    miss = engine.generate(prompts, params)
    hit = engine.generate(prompts, params)
    engine.flush_cache()
    again = engine.generate(prompts, params)

    def gap(a: list[GenerationResult], b: list[GenerationResult]) -> float:
        return max((abs(x - y) for x, y in zip(logprobs(a), logprobs(b), strict=True)), default=0.0)

    return CacheDrift(token_ids(miss) == token_ids(hit) == token_ids(again), gap(miss, hit), gap(miss, again))
