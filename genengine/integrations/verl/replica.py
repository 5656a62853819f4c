"""verl's ``RolloutReplica`` for ``rollout.name=genengine``: launches one :class:`GenEngineServer` per replica.

The config is checked when the replica is built (in the driver, before any server or engine starts): verl's
rollout fields and ``engine_kwargs.genengine`` (backend registered and importable, its options known). In the
hybrid mode the server goes on the node of the replica's first trainer worker, with that worker's GPUs visible
from the server process's start; the server actor itself takes no Ray GPU: it shares the trainer's.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from verl.workers.rollout.replica import RolloutReplica

from genengine.errors import ConfigError
from genengine.integrations.verl.config import engine_settings
from genengine.integrations.verl.server import GenEngineServer, server_name

__all__ = ["GenEngineReplica"]


def _worker_where(worker: Any) -> tuple[str, list[str]]:
    """(node id, GPU ids) of a trainer worker actor."""
    context = ray.get_runtime_context()
    return context.get_node_id(), [str(i) for i in context.get_accelerator_ids().get("GPU", [])]


class GenEngineReplica(RolloutReplica):
    """One genengine server per replica (genengine's engine leader runs its TP group itself)."""

    def __init__(
        self,
        replica_rank: int,
        config: Any,
        model_config: Any,
        gpus_per_node: int = 8,
        is_reward_model: bool = False,
        is_teacher_model: bool = False,
        name_suffix: str = "",
    ) -> None:
        super().__init__(
            replica_rank, config, model_config, gpus_per_node, is_reward_model, is_teacher_model, name_suffix
        )
        self.settings = engine_settings(self.config, self.model_config)  # every refusal before anything starts
        if self.nnodes != 1:
            raise ConfigError(
                f"a genengine replica runs on one node: tensor_model_parallel_size={self.world_size} exceeds "
                f"n_gpus_per_node={gpus_per_node}; multi-node replicas are not supported yet"
            )
        self.server_class: Any = ray.remote(GenEngineServer)

    def _name(self) -> str:
        if self.is_reward_model:
            return f"genengine_server_reward_{self.replica_rank}_0{self.name_suffix}"
        if self.is_teacher_model:
            return f"genengine_server_teacher_{self.replica_rank}_0{self.name_suffix}"
        return server_name(self.replica_rank) + self.name_suffix

    async def launch_servers(self) -> None:
        if len(self.workers) != self.world_size:
            raise ConfigError(
                f"replica {self.replica_rank} got {len(self.workers)} trainer workers for a rollout world size of "
                f"{self.world_size} (tensor_model_parallel_size)"
            )
        calls = [w.__ray_call__.remote(_worker_where) for w in self.workers]
        where: list[tuple[str, list[str]]] = await asyncio.gather(*calls)
        node_id = where[0][0]
        gpus = ",".join(g for _, ids in where for g in ids[:1])
        options: dict[str, Any] = {}
        if gpus:
            # The trainer worker's GPUs, visible from the server process's start: verl's objects among the
            # actor's arguments are unpickled before __init__ runs, and importing verl calls
            # torch.cuda.is_available() (verl/utils/device.py), which fixes the visible GPUs for the process.
            # Set in __init__ (as verl's vLLM server does, whose engine runs in child processes), the value
            # would reach the engine's children but not an engine in the server's own process (vLLM's).
            env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": gpus}
            options["runtime_env"] = {"env_vars": env}
        server: Any = self.server_class.options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=node_id, soft=False
            ),
            name=self._name(),
            max_concurrency=self.max_concurrency,
            num_cpus=0,
            **options,
        ).remote(
            config=self.config,
            model_config=self.model_config,
            rollout_mode=self.rollout_mode,
            workers=self.workers,
            replica_rank=self.replica_rank,
            node_rank=0,
            gpus_per_node=self.gpus_per_replica_node,
            nnodes=1,
            cuda_visible_devices=gpus or None,
        )
        self.servers = [server]
        await server.launch_server.remote()
        host, key = await server.get_server_address.remote()
        self._server_handle = server
        self._server_address = f"{host}:{key}"

    async def sleep(self) -> None:
        await self.servers[0].wait_for_requests_to_drain.remote()
        await asyncio.gather(*[server.sleep.remote() for server in self.servers])
