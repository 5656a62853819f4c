"""A stand-in for verl's trainer worker (verl/workers/engine_workers.py) in tests/integrations/test_verl.py: a Ray
actor that builds the rollout the way the worker does (``get_rollout_class(name, mode)`` on verl's
``RolloutConfig``) and makes the worker's calls on it: ``release()``, ``resume(["weights"])``,
``update_weights(...)``, ``resume(["kv_cache"])``. Only the FSDP model is missing: the weights come from a
checkpoint on disk."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from typing import Any


class VerlTrainerStandIn:
    def __init__(self, rollout_config: Any, model_config: Any) -> None:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("RAY_LOCAL_WORLD_SIZE", "1")
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import RolloutConfig
        from verl.workers.rollout.base import get_rollout_class

        import genengine.integrations.verl.plugin  # noqa: F401  (what `import verl` does through the entry point)

        config: RolloutConfig = omega_conf_to_dataclass(rollout_config)
        self.rollout = get_rollout_class(config.name, config.mode)(
            config=config, model_config=model_config, device_mesh=None
        )

    def rollout_class(self) -> str:
        return type(self.rollout).__qualname__

    async def release(self) -> None:
        await self.rollout.release()

    async def resume(self, tags: list[str]) -> None:
        await self.rollout.resume(tags=tags)

    async def update_weights(self, checkpoint: str, global_steps: int | None, kind: str = "sync") -> Any:
        """What the worker's naive sync does, from a sync or an async generator over ``checkpoint``'s tensors."""
        from genengine.testing.conformance import load_checkpoint

        tensors = load_checkpoint(checkpoint)

        def sync_gen() -> Iterator[tuple[str, Any]]:
            yield from tensors.items()

        async def async_gen() -> AsyncIterator[tuple[str, Any]]:
            for item in tensors.items():
                yield item

        weights = sync_gen() if kind == "sync" else async_gen()
        await self.rollout.update_weights(weights, peft_config=None, base_sync_done=True, global_steps=global_steps)
        report = self.rollout.last_report
        return None if report is None else (report.version, report.num_tensors)

    async def naive_sync(self, checkpoint: str, global_steps: int) -> None:
        """The worker's ``update_weights(global_steps, mode="naive")`` (what verl's CheckpointEngineManager calls
        on the actor worker group for colocated training): resume(weights), update_weights, resume(kv_cache)."""
        await self.resume(["weights"])
        await self.update_weights(checkpoint, global_steps)
        await self.resume(["kv_cache"])
