"""EnginePool on one GPU (marker gpu): a trainer actor and engine actors sharing the GPU through one
placement group bundle. Run by the lead on an H200; every engine importable here is measured
(``GENENGINE_RAY_BACKENDS=sglang,vllm`` to choose).

Thresholds (issue 18): generate through the pool >= 0.95 of in-process; a 7B-shaped sync through the pool
(CUDA IPC between actors) <= 0.1 s; a sleep through the pool frees what an in-process sleep frees.
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu
ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = [
    b
    for b in os.environ.get("GENENGINE_RAY_BACKENDS", "sglang,vllm").split(",")
    if b and importlib.util.find_spec(b) is not None
]
ENGINE_GPUS = 0.4
"""The engine actor's share of the GPU (the trainer actor takes 0.2)."""


@pytest.fixture(scope="module")
def trainer() -> Iterator[Any]:
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from support.ray_trainer import GpuTrainer

    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])
    ray.init(num_gpus=1, num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    pg = placement_group([{"GPU": 1, "CPU": 4}])
    ray.get(pg.ready(), timeout=120)
    actor = (
        ray.remote(GpuTrainer)
        .options(num_gpus=0.2, num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0))
        .remote(pg)
    )
    yield actor
    ray.kill(actor)
    remove_placement_group(pg)
    ray.shutdown()


@pytest.fixture(scope="module")
def model() -> str:
    from genengine.testing.tiny_model import tiny_model_dir

    return str(tiny_model_dir())


@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_through_the_pool_keeps_in_process_speed(trainer: Any, model: str, backend: str) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 500) for _ in range(128)] for _ in range(64)]
    rates = ray.get(trainer.throughput.remote(backend, model, prompts, ENGINE_GPUS), timeout=900)
    print(backend, rates)
    assert rates["pool"] / rates["in_process"] >= 0.95, rates


@pytest.mark.parametrize("backend", BACKENDS)
def test_sleep_through_the_pool_frees_what_in_process_does(trainer: Any, model: str, backend: str) -> None:
    freed = ray.get(trainer.sleep_frees.remote(backend, model, ENGINE_GPUS), timeout=900)
    print(backend, freed)
    assert freed["pool"] >= 0.95 * freed["in_process"] > 0, freed


@pytest.mark.parametrize("backend", BACKENDS)
def test_7b_sync_through_the_pool_over_cuda_ipc(trainer: Any, tmp_path_factory: Any, backend: str) -> None:
    pytest.importorskip("genengine.transport")
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _bench_7b as bench

    model = bench.make_model_dir(str(tmp_path_factory.mktemp("qwen2-7b")), tokenizer=True)
    times = ray.get(trainer.sync_seconds.remote(backend, model, ENGINE_GPUS, "cuda_ipc"), timeout=1800)
    print(backend, times)
    assert min(times[1:]) <= 0.1, times
