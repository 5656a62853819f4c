"""The server adapter: the rollout object in each verl trainer worker (``_ROLLOUT_REGISTRY[("genengine",
"async")]``), which wakes and sleeps its replica's server and syncs the trainer's weights into it.

verl's trainer worker calls ``resume(["weights"])``, ``update_weights(generator, global_steps=...)`` and
``resume(["kv_cache"])`` (verl/workers/engine_workers.py). The worker of rollout rank 0 of each replica forms
a genengine weight-sync group with its server (rank 0 the trainer, rank 1 the server; ``cuda_ipc`` on one
GPU, ``gloo`` on the CPU) and streams the generator through it: one load session per sync, labelled with
``global_steps`` as the engine's weight version. The other ranks only consume the generator (FSDP gathers
each tensor collectively, so every rank must iterate it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

from verl.workers.rollout.base import BaseRollout

from genengine.errors import ConfigError
from genengine.integrations.verl.config import engine_settings
from genengine.integrations.verl.server import server_name

__all__ = ["GenEngineServerAdapter", "bridge"]

_log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


async def _result(ref: Any) -> Any:
    return await ref


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _close_quietly(sender: Any) -> None:
    with contextlib.suppress(Exception):
        sender.close()


def _full(tensor: Any) -> Any:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def bridge(weights: Any, loop: asyncio.AbstractEventLoop) -> Iterator[tuple[str, Any]]:
    """A synchronous iterator over ``weights`` (a sync or an async generator of (name, tensor)) for a sender
    running in a worker thread: an async generator's items are pulled on ``loop`` (free: it awaits the thread)."""
    if hasattr(weights, "__aiter__"):
        agen: Any = weights.__aiter__()
        while True:
            name: str
            tensor: Any
            try:
                name, tensor = asyncio.run_coroutine_threadsafe(agen.__anext__(), loop).result()
            except StopAsyncIteration:
                return
            yield name, _full(tensor)
    else:
        for name, tensor in weights:
            yield name, _full(tensor)


async def _drain(weights: Any) -> None:
    if hasattr(weights, "__aiter__"):
        async for _ in weights:
            pass
    else:
        for _ in weights:
            pass


class GenEngineServerAdapter(BaseRollout):
    """verl's ``BaseRollout`` for ``rollout.name=genengine``: a client of its replica's server actor."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        from genengine.plugins.registry import get_backend

        self.settings = engine_settings(self.config, self.model_config, check_backend=False)
        get_backend(self.settings.engine.backend)  # an unknown backend is refused here too, by name
        rank = int(os.environ.get("RANK", "0"))
        local_world_size = int(os.environ.get("RAY_LOCAL_WORLD_SIZE", "1"))
        rollout_world_size = self.settings.engine.tp_size
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size
        self.node_rank = self.rollout_rank // local_world_size
        self._has_server = self.rollout_rank == 0
        self.server_handle: Any = None
        self._sender: Any = None
        self._incarnation: str | None = None
        self.last_report: Any = None

    def _server(self) -> Any:
        if self.server_handle is None:
            import ray

            self.server_handle = ray.get_actor(server_name(self.replica_rank, self.node_rank))
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        """Wake the server's engine for ``tags`` ("weights", then "kv_cache" after the sync)."""
        if self.settings.free_cache_engine and self._has_server:
            await self._server().wake_up.remote(tags=tags)

    async def release(self) -> None:
        if self.settings.free_cache_engine and self._has_server:
            await self._server().sleep.remote()

    async def update_weights(  # type: ignore[override]  # verl's annotation names only a sync generator
        self,
        weights: Iterable[tuple[str, Any]] | AsyncIterator[tuple[str, Any]],
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        """Stream ``weights`` (a sync or async generator of (HF name, tensor)) into the server's engine as one
        load session labelled ``global_steps`` (a keyword, as verl's worker passes it; else the engine's
        version + 1); the engine flushes its prefix cache at the commit."""
        global_steps: int | None = kwargs.get("global_steps")
        if wire_format != "named_tensors":
            raise ConfigError(
                f"update_weights wire_format={wire_format!r} is not supported by rollout.name=genengine; "
                "allowed: 'named_tensors' (checkpoint_engine.backend=naive)"
            )
        if kwargs.get("peft_config") is not None:
            raise ConfigError(
                "LoRA adapters are not supported by rollout.name=genengine yet: set actor_rollout_ref.model.lora.merge"
                "=True so that the trainer syncs merged weights"
            )
        if not self._has_server:
            await _drain(weights)
            return
        server = self._server()
        incarnation, current = await server.weight_version.remote()
        version = global_steps if global_steps is not None else current + 1
        if self._sender is None or incarnation != self._incarnation:
            await self._form_group(server, incarnation)
        loop = asyncio.get_running_loop()
        sender = self._sender
        receiving = asyncio.ensure_future(_result(server.receive_weights.remote()))
        sending = asyncio.ensure_future(asyncio.to_thread(sender.send, bridge(weights, loop), version=version))
        done, _ = await asyncio.wait({receiving, sending}, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in (receiving, sending) if t in done and t.exception() is not None]
        if failed:
            # A failure on either side leaves the group out of step: the next sync forms a new one. A server that
            # failed outside the transport's protocol (e.g. its engine refused the load) is reported now, not at
            # the group's timeout; the sender's thread ends at that timeout and closes its end then.
            self._sender, self._incarnation = None, None
            sending.add_done_callback(lambda _: _close_quietly(sender))
            receiving.add_done_callback(_consume)
            if not receiving.done():  # the engine's own error usually follows the sender's within moments
                await asyncio.wait({receiving}, timeout=10)
            if sending.done():
                with contextlib.suppress(Exception):
                    await server.transport_close.remote()
            errors = [t.exception() for t in (receiving, sending) if t.done() and t.exception() is not None]
            raise errors[0] from (errors[1] if len(errors) > 1 else None)  # type: ignore[misc]
        report = sending.result()
        self.last_report = report
        if global_steps is not None:
            await server.set_global_steps.remote(global_steps)

    async def _form_group(self, server: Any, incarnation: str) -> None:
        import ray

        from genengine.transport import TransportSpec, get_transport

        await self._close_group()
        s = self.settings
        spec = TransportSpec(
            transport=s.transport,
            address=f"{ray.util.get_node_ip_address()}:{_free_port()}",
            world_size=2,
            group_name=f"genengine-verl-{self.replica_rank}-{uuid.uuid4().hex[:8]}",
            timeout_s=s.timeout_s,
            bucket_bytes=s.bucket_bytes,
            device="cpu" if s.transport == "gloo" else "cuda",
        )
        joining = server.transport_join.remote(incarnation, spec, 1)
        self._sender = await asyncio.to_thread(get_transport(spec.transport).sender, spec)
        await joining
        self._incarnation = incarnation
        _log.info("genengine: weight-sync group %r formed with %s", spec.group_name, server_name(self.replica_rank))

    async def _close_group(self) -> None:
        sender, self._sender, self._incarnation = self._sender, None, None
        if sender is not None:
            with contextlib.suppress(Exception):
                sender.close()
            with contextlib.suppress(Exception):
                await self._server().transport_close.remote()

    def generate_sequences(self, prompts: Any) -> Any:
        raise NotImplementedError(
            "rollout.name=genengine serves verl's async rollout (agent loop and LLMServerClient) only"
        )
