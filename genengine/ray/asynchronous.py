"""``AsyncPoolCalls``: the async half of ``EnginePool`` (``stream``, ``generate_async``, ``abort``, pause and
resume, ``in_flight``): the same calls as ``genengine.engine.aio.AsyncEngineBase``, each request on the replica
the router picks. ``EnginePool`` inherits them; they act on the pool's parts (the fleet, its lifecycle and
dispatch, the streams submitted) as the synchronous calls do. Importing this module imports neither Ray nor
torch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from genengine.engine.aio import PauseMode, normalize_async_request, normalize_request_ids
from genengine.errors import InvalidArgumentError
from genengine.protocol import GenerationResult
from genengine.ray.dispatch import Dispatch
from genengine.ray.errors import ReplicaDiedError
from genengine.ray.fleet import Fleet
from genengine.ray.handle import Replica
from genengine.ray.lifecycle import Lifecycle
from genengine.ray.options import PoolOptions, ray_module
from genengine.ray.stream import PoolStream, StreamRegistry

__all__ = ["AsyncPoolCalls"]

_log = logging.getLogger("genengine.ray.pool")  # one logger for the pool and its parts


class _GivenUp(Exception):
    """Ends a cancelled pause's worker thread before it sends anything more (nobody awaits it any longer)."""


class AsyncPoolCalls:
    """The pool's async calls (``EnginePool`` sets the parts they use)."""

    _options: PoolOptions
    _fleet: Fleet
    _life: Lifecycle
    _dispatch: Dispatch
    _streams: StreamRegistry

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished, on every replica up (each answers at once, within ``timeout_s``):
        running, held by a ``keep`` pause, or queued during a pause."""
        fleet = self._fleet
        if fleet.closed:
            return 0
        mine = self._streams.by_replica()
        active = fleet.active()
        outcomes = fleet.call("in_flight", lambda r: r.in_flight(mine.get(r.index, [])), active, errors="return")
        return sum(int(o.value) for o in outcomes if o.error is None)

    @property
    def paused(self) -> PauseMode | None:
        paused = self._fleet.paused
        return paused[0] if paused is not None else None

    def stream(
        self,
        prompt: str | None = None,
        sampling_params: Any = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        image_data: Any = None,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> PoolStream:
        """``AsyncEngineBase.stream`` through the pool: one prompt, on the replica the router picks."""
        self._fleet.check_open()
        request, request_id = normalize_async_request(
            prompt,
            sampling_params,
            prompt_token_ids,
            image_data,
            request_id,
            vocab_size=self._options.vocab_size,
            supports_images=True,
        )
        if session_id is not None and not isinstance(session_id, str):
            raise InvalidArgumentError(f"session_id={session_id!r} must be a string or None")
        self._streams.check_new(request_id)
        self._fleet.check_can_generate()
        (key,) = self._dispatch.keys([request], session_id)
        handle = PoolStream(self._fleet, self._dispatch, request, request_id, key, self.abort)
        self._streams.add(handle)
        handle.submit()
        return handle

    async def generate_async(
        self,
        prompt: str | None = None,
        sampling_params: Any = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        image_data: Any = None,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> GenerationResult:
        """One prompt's completions; a replica dying under it raises ``ReplicaDiedError`` unless the pool's
        ``request_retries`` allows submitting it again (from scratch) to another replica."""
        retries = self._options.request_retries
        for attempt in range(retries + 1):
            stream = self.stream(
                prompt,
                sampling_params,
                prompt_token_ids=prompt_token_ids,
                image_data=image_data,
                request_id=request_id,
                session_id=session_id,
            )
            try:
                return await stream.collect()
            except ReplicaDiedError as exc:
                if attempt == retries:
                    raise
                _log.warning("%s; retrying request %s elsewhere", exc, stream.request_id)
        raise AssertionError("unreachable")

    async def abort(self, request_ids: str | Sequence[str] | None = None) -> list[str]:
        """Abort requests (every one in flight when None) on the replicas serving them; returns the ids aborted."""
        fleet = self._fleet
        fleet.check_open()
        ids = normalize_request_ids(request_ids)
        targets: Mapping[int, list[str] | None] = (
            {r.index: None for r in fleet.active()} if ids is None else self._streams.by_replica(ids)
        )
        replicas = [fleet.replicas[i] for i in targets if i in fleet.replicas]
        if not replicas:
            return []
        outcomes = await asyncio.to_thread(fleet.call, "abort", lambda r: r.abort(targets[r.index]), replicas)
        return [rid for o in outcomes for rid in o.value]

    async def pause_generation(self, mode: PauseMode = "keep", *, clear_cache: bool = True) -> None:
        """``AsyncEngineBase.pause_generation`` on every replica (a replica restarted meanwhile is paused too).
        Cancelled (``wait_for`` giving up on a ``"wait"`` drain), it cancels the replicas' pauses: none is left
        paused, not even one the worker thread had yet to send (it sends nothing after the cancellation)."""
        refs: list[Any] = []
        gate = threading.Lock()  # a pause is either sent before the cancellation (and cancelled) or never
        given_up = False
        before = self._fleet.set_paused((mode, clear_cache))  # at once, as an engine sets it

        def submit(r: Replica) -> Any:
            with gate:
                if given_up:
                    raise _GivenUp("pause_generation was cancelled before it reached this replica")
                refs.append(r.pause_generation(mode, clear_cache))
                return refs[-1]

        try:
            await asyncio.to_thread(self._life.each, "pause_generation", submit)
        except BaseException as exc:
            self._fleet.set_paused(before)
            if isinstance(exc, asyncio.CancelledError):
                with gate:
                    given_up, sent = True, list(refs)
                ray = ray_module()
                for ref in sent:
                    ray.cancel(ref)
            raise

    async def resume_generation(self) -> None:
        await asyncio.to_thread(self._life.each, "resume_generation", Replica.resume_generation)
        self._fleet.set_paused(None)
