"""A trainer actor for the colocated Ray tests: it owns the pool (as a real trainer would) and runs RL steps."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


class ColocatedTrainer:
    """Creates an ``EnginePool`` colocated in its own placement group and drives generate/sleep/wake/load."""

    def __init__(self, model: str, placement_group: Any, num_cpus: float, transport: str | None = None) -> None:
        from genengine.ray import EnginePool

        self.pool = EnginePool(
            backend="transformers",
            model=model,
            dtype="float32",
            num_replicas=2,
            placement="colocated",
            placement_group=placement_group,
            bundle_indices=[0, 1],
            num_gpus=0,
            num_cpus=num_cpus,
            transport=transport,
        )

    def step(self, prompts: list[str], weights_dir: str, version: int) -> dict[str, Any]:
        """generate, sleep, wake weights, load the weights of ``weights_dir`` as ``version``, wake KV, generate."""
        import ray

        from genengine import SamplingParams
        from genengine.testing.conformance import load_checkpoint

        params = SamplingParams(temperature=0, max_new_tokens=8)
        before = [r.outputs[0].token_ids for r in self.pool.generate(prompts, params)]
        self.pool.sleep(1)
        asleep = sorted(self.pool.state.released_tags)
        self.pool.wake(["weights"])
        report = self.pool.load_weights(load_checkpoint(weights_dir).items(), version=version)
        self.pool.wake(["kv_cache"])
        after = self.pool.generate(prompts, params)
        infos = [ray.get(ray.get_actor(r.name).info.remote()) for r in self.pool.replicas]
        return {
            "before": before,
            "after": [r.outputs[0].token_ids for r in after],
            "after_versions": [r.outputs[0].weight_versions for r in after],
            "asleep": asleep,
            "replica_versions": [i["weight_version"] for i in infos],
            "replica_bundles": [r.bundle_index for r in self.pool._replicas.values()],
            "trainer_pg": ray.get_runtime_context().current_placement_group_id,
            "trainer_pid": os.getpid(),
            "replica_pids": [i["pid"] for i in infos],
            "sync": (report.num_tensors, report.num_buckets),
            "transport_group": self.pool.transport_group,
        }

    def shutdown(self) -> None:
        self.pool.shutdown()


class GpuTrainer:
    """The GPU test's trainer actor (one fraction of the GPU); it measures an engine in-process and through a
    colocated pool in the same bundle, one after the other, so that both see the same GPU."""

    def __init__(self, placement_group: Any) -> None:
        self.pg = placement_group

    def _engine_kwargs(self, backend: str, model: str) -> dict[str, Any]:
        return {"backend": backend, "model": model, "mem_util": 0.3, "dtype": "bfloat16"}

    def _pool(self, backend: str, model: str, num_gpus: float, **options: Any) -> Any:
        """A one-replica pool colocated in this actor's bundle."""
        from genengine.ray import EnginePool

        return EnginePool(
            **self._engine_kwargs(backend, model),
            placement="colocated",
            placement_group=self.pg,
            bundle_indices=[0],
            num_gpus=num_gpus,
            num_cpus=1,
            **options,
        )

    def _both(self, backend: str, model: str, num_gpus: float, measure: Callable[[Any], Any]) -> dict[str, Any]:
        """``measure(engine)`` in-process, then through a one-replica colocated pool."""
        from genengine import create_engine

        with create_engine(**self._engine_kwargs(backend, model)) as engine:
            local = measure(engine)
        with self._pool(backend, model, num_gpus) as pool:
            pooled = measure(pool)
        return {"in_process": local, "pool": pooled}

    def throughput(self, backend: str, model: str, prompts: list[list[int]], num_gpus: float) -> dict[str, float]:
        """Tokens/s of one greedy batch, in-process and through a one-replica colocated pool."""
        import time

        from genengine import SamplingParams

        params = SamplingParams(temperature=0, max_new_tokens=128, ignore_eos=True)

        def rate(engine: Any) -> float:
            engine.generate(prompt_token_ids=prompts[:4], sampling_params=params)  # warm up
            start = time.perf_counter()
            out = engine.generate(prompt_token_ids=prompts, sampling_params=params)
            return sum(len(o.token_ids) for r in out for o in r.outputs) / (time.perf_counter() - start)

        return self._both(backend, model, num_gpus, rate)

    def sleep_frees(self, backend: str, model: str, num_gpus: float) -> dict[str, int]:
        """Device-wide free bytes gained by a level-1 sleep, in-process and through the pool."""
        from support.gpu_checks import free_gpu_memory

        def freed(engine: Any) -> int:
            before = free_gpu_memory()
            engine.sleep(1)
            gained = free_gpu_memory() - before
            engine.wake()
            return gained

        return self._both(backend, model, num_gpus, freed)

    def sync_seconds(self, backend: str, model: str, num_gpus: float, transport: str) -> list[float]:
        """Seconds of five syncs of the trainer's CUDA tensors (7B-shaped) through the pool's transport."""
        import time

        import _bench_7b as bench

        state = bench.trainer_state()
        with self._pool(backend, model, num_gpus, transport=transport) as pool:
            times = []
            for version in range(1, 6):
                start = time.perf_counter()
                pool.load_weights(state, version=version)
                times.append(time.perf_counter() - start)
        return times
