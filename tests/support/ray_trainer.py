"""A trainer actor for the colocated Ray tests: it owns the pool (as a real trainer would) and runs RL steps."""

from __future__ import annotations

import os
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
            "replica_bundles": [r.bundle_index for r in self.pool._fleet.replicas.values()],
            "trainer_pg": ray.get_runtime_context().current_placement_group_id,
            "trainer_pid": os.getpid(),
            "replica_pids": [i["pid"] for i in infos],
            "sync": (report.num_tensors, report.num_buckets),
            "transport_group": self.pool.transport_group,
        }

    def shutdown(self) -> None:
        self.pool.shutdown()
