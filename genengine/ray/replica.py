"""One engine replica: the Ray actor that owns an engine, built by ``create_engine`` inside the actor.

The pool wraps :class:`EngineReplica` with ``ray.remote`` when it starts one (so importing this module
imports no Ray). Every method is ``async`` so the actor's event loop stays free while an engine call runs in
a worker thread: a health ping, an ``abort`` or a ``pause_generation`` is answered while ``generate`` runs.
Engine calls that are synchronous in-process stay one at a time, as a trainer's thread would make them.

Each incarnation of the actor (Ray restarts a dead one by running ``__init__`` again, which builds a fresh
engine from the checkpoint on disk) has its own id. The pool passes the id it expects with every call, and a
restarted replica refuses (``StaleReplicaError``, before any work) until the pool has given it the current
weights: a replica never serves the disk checkpoint in place of the trainer's weights.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from genengine.protocol import EngineState, GenerationEngine, is_async_engine
from genengine.ray.errors import StaleReplicaError

__all__ = ["EngineReplica", "Reply"]

_REMEMBERED = 4096
"""Stream ids a replica remembers having passed to its engine (``in_flight`` asks for the pool's newest)."""


@dataclass(frozen=True)
class Reply:
    """What every engine call on a replica returns (``generate``, ``sleep``, ``wake``, ``flush_cache``,
    ``load_weights``, ``transport_receive``, ``abort``, ``pause_generation``, ``resume_generation``): the call's
    value and the engine's state and weight version right after it, which the pool records per replica."""

    value: Any
    state: EngineState
    version: int


def _version(engine: GenerationEngine) -> int:
    """The engine's weight version: an async engine has one; a synchronous one labels nothing (0)."""
    return engine.weight_version if is_async_engine(engine) else 0


class EngineReplica:
    """An engine in a Ray actor; only ``EnginePool`` talks to it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.incarnation = uuid.uuid4().hex
        self.engine: GenerationEngine | None = None
        self._lock = asyncio.Lock()
        self._receiver: Any = None
        self._submitted: dict[str, None] = {}  # ids of the last streams that reached the engine, oldest first

    async def start(self, expect: str, config: Any) -> None:
        """Build the engine (in a thread: the actor answers pings meanwhile). Not in ``__init__``: a bad option
        then reaches the pool as the backend's own ``ConfigError``, and a restart by Ray (which re-runs
        ``__init__`` only) gives an engine-less replica that the pool must start and refill before use."""
        from genengine.plugins.registry import create_engine

        if expect != self.incarnation:
            raise StaleReplicaError(f"replica {self.index} restarted before it was started")
        async with self._lock:
            if self.engine is None:
                self.engine = await asyncio.to_thread(create_engine, config)

    # ---- identity -----------------------------------------------------------------------------------------
    def _check(self, expect: str | None) -> None:
        if self.engine is None or expect != self.incarnation:
            raise StaleReplicaError(
                f"replica {self.index} restarted (incarnation {self.incarnation[:8]}, the pool expected "
                f"{(expect or '?')[:8]}) and has not been started and given the current weights yet"
            )

    async def info(self) -> dict[str, Any]:
        """Who this replica is and what its engine takes; answered at once, whatever the engine is doing."""
        import ray

        engine = self.engine
        context = ray.get_runtime_context()
        where = {
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "actor_id": context.get_actor_id(),
            "genengine_file": sys.modules["genengine"].__file__,  # the package this actor runs (loaded first)
            "started": engine is not None,
        }
        if engine is None:
            return where
        return {
            **where,
            "supported_tags": tuple(engine.supported_tags),
            "supports_async": is_async_engine(engine),
            "state": engine.state,
            "weight_version": _version(engine),
        }

    def _engine(self) -> Any:
        assert self.engine is not None, "checked by _check"
        return self.engine

    def _reply(self, value: Any) -> Reply:
        engine = self._engine()
        return Reply(value, engine.state, _version(engine))

    # ---- synchronous engine calls (one typed method each) ------------------------------------------------------
    async def _run(self, expect: str | None, call: Callable[[Any], Any]) -> Reply:
        """``call(engine)`` in a worker thread, one at a time; its value with the engine's state right after."""
        self._check(expect)
        engine = self._engine()
        async with self._lock:
            value = await asyncio.to_thread(call, engine)
            return self._reply(value)

    async def generate(
        self,
        expect: str | None,
        prompts: list[str] | None,
        sampling_params: list[Any],
        prompt_token_ids: list[list[int]] | None,
        image_data: list[Any] | None,
    ) -> Reply:
        """``engine.generate`` of one batch (the prompts the pool routed here)."""
        return await self._run(
            expect,
            lambda e: e.generate(prompts, sampling_params, prompt_token_ids=prompt_token_ids, image_data=image_data),
        )

    async def sleep(self, expect: str | None, level: int) -> Reply:
        return await self._run(expect, lambda e: e.sleep(level))

    async def wake(self, expect: str | None, tags: str | list[str] | None) -> Reply:
        return await self._run(expect, lambda e: e.wake(tags))

    async def flush_cache(self, expect: str | None) -> Reply:
        return await self._run(expect, lambda e: e.flush_cache())

    async def load_weights(
        self,
        expect: str | None,
        names: Sequence[str],
        refs: Sequence[Any],
        version: int | None,
        bucket_bytes: int | None,
        check_finite: bool,
    ) -> Reply:
        """Load tensors the pool put in Ray's object store, one ``ray.get`` a tensor as the buckets need them."""
        import ray

        def load(engine: Any) -> Any:
            pairs = ((name, ray.get(ref)) for name, ref in zip(names, refs, strict=True))
            return engine.load_weights(pairs, bucket_bytes=bucket_bytes, check_finite=check_finite, version=version)

        return await self._run(expect, load)

    # ---- the async capability -------------------------------------------------------------------------------
    async def stream(
        self,
        expect: str | None,
        prompt: str | None,
        sampling_params: Any,
        prompt_token_ids: Sequence[int] | None,
        image_data: Any,
        request_id: str,
    ) -> AsyncGenerator[Any, None]:
        """The engine's ``stream``: yields its ``StreamChunk``s, then its ``GenerationResult`` (a Ray
        streaming generator: the pool reads each item as it is yielded)."""
        self._check(expect)
        self._submitted[request_id] = None
        while len(self._submitted) > _REMEMBERED:
            del self._submitted[next(iter(self._submitted))]
        stream = self._async().stream(
            prompt, sampling_params, prompt_token_ids=prompt_token_ids, image_data=image_data, request_id=request_id
        )
        try:
            async for chunk in stream:
                yield chunk
            yield stream.result()
        finally:
            await stream.aclose()  # aborts the request if the pool stopped reading before its end

    def _async(self) -> Any:
        engine = self._engine()
        if not is_async_engine(engine):
            raise TypeError(f"replica {self.index}: its engine {type(engine).__name__} has no async calls")
        return engine

    async def in_flight(self, request_ids: Sequence[str] = ()) -> int:
        """The engine's requests submitted and not finished, plus those of ``request_ids`` (streams the pool
        submitted here) whose call has not reached the engine yet: Ray starts an async actor's calls in no set
        order. Answered at once."""
        engine = self.engine
        count = engine.in_flight if engine is not None and is_async_engine(engine) else 0
        return count + sum(1 for rid in request_ids if rid not in self._submitted)

    async def abort(self, expect: str | None, request_ids: Sequence[str] | None) -> Reply:
        """The ids aborted."""
        self._check(expect)
        return self._reply(list(await self._async().abort(request_ids)))

    async def pause_generation(self, expect: str | None, mode: str, clear_cache: bool) -> Reply:
        self._check(expect)
        await self._async().pause_generation(mode, clear_cache=clear_cache)  # type: ignore[arg-type]
        return self._reply(None)

    async def resume_generation(self, expect: str | None) -> Reply:
        self._check(expect)
        await self._async().resume_generation()
        return self._reply(None)

    # ---- weight transports (genengine.transport) ------------------------------------------------------------
    async def transport_join(self, expect: str | None, spec: Any, rank: int) -> None:
        """Join a weight-sync group as ``rank`` (the transport's receiver, into the engine's load sessions); blocks
        (in a thread) until every rank joined or the group's timeout."""
        from genengine.transport import open_receiver

        self._check(expect)
        await self.transport_close()
        self._receiver = await asyncio.to_thread(open_receiver, spec, rank)

    async def transport_receive(self, expect: str | None, check_finite: bool = False) -> Reply:
        """Receive one sync from the group's sender into the engine (one load session: a write per bucket,
        checked with ``check_finite``, and one commit)."""
        self._check(expect)
        receiver = self._receiver
        if receiver is None:
            raise RuntimeError(f"replica {self.index} is in no weight-sync group (the pool forms one before a sync)")
        return await self._run(expect, lambda e: receiver.receive(e, check_finite=check_finite))

    async def transport_close(self) -> None:
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            await asyncio.to_thread(receiver.close)

    # ---- end ---------------------------------------------------------------------------------------------------
    async def shutdown(self) -> None:
        await self.transport_close()
        async with self._lock:
            if self.engine is not None:
                await asyncio.to_thread(self.engine.shutdown)
