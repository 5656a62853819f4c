"""EnginePool on one GPU (marker gpu): a trainer actor holding an engine in-process and a one-replica pool in
its placement-group bundle, the replica synced over ``cuda_ipc`` (genengine/cli/bench/pool.py, at the tiny model's
size). Every engine importable here is measured (``GENENGINE_RAY_BACKENDS=sglang,vllm`` to choose).

Checked: three syncs (checksums on) of new weights from the trainer actor's CUDA tensors, which the replica
reads in place by the CUDA driver's IPC handles (the default) and torch's in turn, reach the replica, whose
greedy outputs then equal the in-process engine's on the same weights and differ from the previous version's,
labelled with the sync's version. At the tiny scale a third of the tensors are views at an odd offset of a larger
allocation (read in place at that offset) and a third transposed in memory (packed into checksummed buckets):
``support.transport_workers.awkward_weights``, so each engine reads both kinds by both ways of sharing;
a sleep through the pool frees about what the in-process sleep frees (level 1; level 2 at 7B);
generate through the pool is not far off in-process speed (a loose sanity bound: the figure itself is
``benchmarks/bench_pool.py``'s, at 7B).

With ``GENENGINE_RAY_GPU_SCALE=7b`` (verify.sh's default) the same checks run on the pool benchmark's settings
(benchmarks/bench_pool.py: 7B shapes, CUDA graphs, 5 interleaved repeats, 6 syncs of 339 tensors read in place,
one bucket each, the driver's handles and torch's in turn) and the report is also the benchmark's
(``$OUT/bench_pool_ENGINE.json``): one run, one Ray cluster and two engine starts fewer than the test and the
benchmark apart.

    bash tools/gpu/run_tests.sh ENGINE tests/gpu/test_ray_gpu.py
    GENENGINE_RAY_GPU_SCALE=7b bash tools/gpu/run_tests.sh ENGINE tests/gpu/test_ray_gpu.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu
ray = pytest.importorskip("ray")

BACKENDS = [
    b
    for b in os.environ.get("GENENGINE_RAY_BACKENDS", "sglang,vllm").split(",")
    if b and importlib.util.find_spec(b) is not None
]
MEM_UTILS = {"sglang": (0.3, 0.6), "vllm": (0.3, 0.3)}
"""(in-process, replica): SGLang's share is of the whole GPU, checked against what is free when it starts."""
OPTIONS: dict[str, dict[str, Any]] = {
    "sglang": {"disable_cuda_graph": True, "log_level": "warning"},
    "vllm": {"max_model_len": 1024, "disable_cuda_graph": True},
}
"""No CUDA graphs on either side: what is checked here is the transport and the pool, and two engine starts without
compiling and capturing save half a minute of the one-call GPU check (the figures are bench_pool.py's, at 7B)."""


SCALE = os.environ.get("GENENGINE_RAY_GPU_SCALE", "tiny")
"""``tiny`` (the test alone) or ``7b`` (the pool benchmark's settings and report)."""
HANDLES = tuple(os.environ.get("GENENGINE_RAY_GPU_HANDLES", "driver,torch").split(","))
"""``cuda_ipc``'s ways of sharing the syncs take in turn (``PoolBenchSettings.handles``)."""


def _settings(backend: str) -> Any:
    from genengine.cli.bench.pool import PoolBenchSettings

    if SCALE == "7b":
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
        from bench_pool import bench_settings

        # Level 2 at 7B: as much device memory freed as level 1, without vLLM's copy of the weights to pinned
        # host memory (17-19 s per engine; the one-call GPU check has 9 minutes). Level 1 is the tiny scale's.
        return bench_settings(backend, sleep=True, sleep_level=2, handles=HANDLES)
    if SCALE != "tiny":
        raise ValueError(f"GENENGINE_RAY_GPU_SCALE={SCALE!r}: allowed are 'tiny' and '7b'")
    in_process, replica = MEM_UTILS[backend]
    return PoolBenchSettings(
        backend=backend,
        options=OPTIONS[backend],
        dtype="bfloat16",
        mem_util=in_process,
        pool_mem_util=replica,
        batch_size=32,
        prompt_len=64,
        max_new_tokens=64,
        repeats=2,
        min_seconds=1.0,
        syncs=3,
        transport="cuda_ipc",
        handles=HANDLES,
        bucket_bytes=256 << 10,
        checksum=True,
        weights="support.transport_workers:awkward_weights",
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_colocated_replica_synced_over_cuda_ipc_serves_the_trainers_weights(backend: str) -> None:
    from genengine.cli.bench.pool import format_pool_report, run_pool_bench

    settings = _settings(backend)
    assert settings.checksum and settings.syncs >= 3 and settings.sleep
    report = run_pool_bench(settings)
    print(format_pool_report(report))
    if SCALE == "7b":  # the benchmark's report line and JSON file (BENCH_POOL_RESULT), read by verify.sh
        from bench_pool import MODEL_LABEL, write_report

        write_report({"model": MODEL_LABEL, **report}, backend)
    else:
        print("RAY_GPU_REPORT " + json.dumps(report, default=str))
    rows = report["sync"]["rows"]
    assert len(rows) == settings.syncs and report["transport"] == "cuda_ipc"
    for row in rows:
        assert row["outputs_equal"], f"after sync v{row['version']} the replica's outputs differ from in-process"
        assert row["changed"], f"sync v{row['version']} left the replica's outputs as they were"
        assert row["labels_ok"], f"sync v{row['version']}: the pool's results carry another weight version"
    # Loose: each bucket is one engine.load_weights call on the replica (one check and cache flush each: vLLM's
    # tiny-model load took 0.13-0.18 s in-process on the H200, 12 buckets 2.0 s through the pool).
    buckets = max(row["buckets"]["pool"] or 1 for row in rows)
    assert report["sync"]["pool_median_s"] <= 1.0 + 1.5 * buckets * report["sync"]["in_process_median_s"], (
        buckets,
        report["sync"],
    )
    sleep = report["sleep"]
    assert sleep["pool"]["freed_bytes"] >= 0.9 * sleep["in_process"]["freed_bytes"] > 0, sleep
    assert report["ratio"] >= 0.7, report["tokens_per_s"]  # loose: benchmarks/bench_pool.py gives the figure
