"""``PoolStream``: one request submitted through an ``EnginePool``, read from its replica as a Ray streaming
generator; the same calls as ``genengine.engine.aio.RequestStream`` (both are a ``StreamBase``).

A replica that refuses the request as restarted (it never ran) has it sent to another; one that dies under
it ends the stream with ``ReplicaDiedError``. Importing this module imports neither Ray nor torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from genengine.engine.aio import StreamChunk
from genengine.engine.aio.stream import StreamBase
from genengine.errors import InvalidArgumentError
from genengine.protocol import GenerationResult
from genengine.ray.dispatch import Dispatch
from genengine.ray.errors import ReplicaError, ReplicaTimeoutError, StaleReplicaError
from genengine.ray.fanout import Outcome, translate
from genengine.ray.fleet import Fleet
from genengine.ray.handle import Replica
from genengine.requests import Request

__all__ = ["PoolStream", "StreamRegistry"]


class PoolStream(StreamBase):
    """One request submitted through an ``EnginePool``: the same calls as ``genengine.engine.aio.RequestStream``."""

    def __init__(
        self,
        fleet: Fleet,
        dispatch: Dispatch,
        request: Request,
        request_id: str,
        key: str | None,
        abort: Callable[[str], Awaitable[Any]],
    ) -> None:
        self._fleet = fleet
        self._dispatch = dispatch
        self._request = request
        self._request_id = request_id
        self._key = key
        self._abort_call = abort
        self._replica: Replica | None = None
        self._gen: Any = None
        self._yielded = False
        self._done = False
        self._final: GenerationResult | None = None
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        self._charge: tuple[Replica, str] | None = None
        """The replica (and its incarnation) whose router load counts this request until it ends there."""

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def done(self) -> bool:
        return self._done

    @property
    def running(self) -> bool:
        """Its request has not ended on its replica (it may have ended there with chunks left unread)."""
        return self._charge is not None and not self._done

    @property
    def replica_index(self) -> int | None:
        """The replica serving it (None before it is submitted)."""
        return self._replica.index if self._replica is not None else None

    def submit(self) -> None:
        """Route the request and start it on that replica."""
        request = self._request
        ((index, _),) = self._dispatch.route([(self._key, request.params.n)], [0]).items()
        replica = self._fleet.replicas[index]
        self._replica = replica
        charge = self._charge = (replica, replica.incarnation)
        self._gen = replica.stream(request, self._request_id)
        # The load is the replica's work, not the reader's: it ends when the replica's generator does (finished,
        # aborted, or the actor gone), whether or not anybody reads the chunks left.
        self._gen.completed().future().add_done_callback(lambda _: self._release(charge))

    def _release(self, charge: tuple[Replica, str] | None = None) -> None:
        """Take this request's ``n`` off its replica's router load, once per submission (``charge``: only if it
        is still the current one). A replica restored since (a new incarnation, its load counted afresh) is left
        alone."""
        with self._lock:
            if self._charge is None or (charge is not None and charge is not self._charge):
                return
            (replica, incarnation), self._charge = self._charge, None
        self._fleet.release(replica, incarnation, self._request.params.n)

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._release()

    def __aiter__(self) -> PoolStream:
        return self

    async def __anext__(self) -> StreamChunk:
        timeout = self._fleet.options.request_timeout_s
        while True:
            if self._done:
                if self._failure is not None:
                    raise self._failure
                raise StopAsyncIteration
            assert self._replica is not None
            replica = self._replica
            try:
                ref = await asyncio.wait_for(self._gen.__anext__(), timeout)
                item = await ref
            except StopAsyncIteration:
                self._fail(ReplicaError(f"{replica.where}: the stream of {self._request_id!r} ended without a result"))
                continue
            except asyncio.TimeoutError:
                self._fail(
                    ReplicaTimeoutError(f"{replica.where}: stream {self._request_id!r} got nothing for {timeout:g} s")
                )
                continue
            except Exception as exc:
                error = translate(replica, exc, f"stream {self._request_id!r}")
                self._fleet.apply([Outcome(replica, error=error)])  # a replica restarted or gone: no traffic
                if isinstance(error, StaleReplicaError) and not self._yielded:
                    self._release()
                    await asyncio.to_thread(self.submit)  # it never ran: send it elsewhere
                    continue
                self._fail(error)
                continue
            if isinstance(item, GenerationResult):
                self._final = item
                self._finish()
                continue
            self._yielded = True
            return item  # type: ignore[no-any-return]

    def _fail(self, error: BaseException) -> None:
        self._failure = error
        self._finish()

    def _error(self) -> BaseException | None:
        return self._failure

    def _result(self) -> GenerationResult | None:
        return self._final

    async def _abort(self, *, cancelled: bool) -> None:
        if cancelled:
            with contextlib.suppress(Exception):
                await self._abort_call(self._request_id)
        else:
            await self._abort_call(self._request_id)

    async def _close(self) -> None:
        """Read the (aborted) stream to its end: the replica's generator finishes and the router is told."""
        with contextlib.suppress(Exception):
            async for _ in self:
                pass


class StreamRegistry:
    """The streams a pool submitted, by request id (finished ones are dropped as new ones come)."""

    def __init__(self) -> None:
        self._streams: dict[str, PoolStream] = {}

    def check_new(self, request_id: str) -> None:
        known = self._streams.get(request_id)
        if known is not None and known.running:
            raise InvalidArgumentError(f"request_id={request_id!r} is already in flight")

    def add(self, stream: PoolStream) -> None:
        for rid in [rid for rid, s in self._streams.items() if not s.running]:
            del self._streams[rid]
        self._streams[stream.request_id] = stream

    def by_replica(self, request_ids: Sequence[str] | None = None) -> dict[int, list[str]]:
        """The ids of the streams whose request has not ended on its replica (of ``request_ids``, else all), by
        that replica."""
        chosen = list(self._streams.values()) if request_ids is None else [self._streams.get(r) for r in request_ids]
        out: dict[int, list[str]] = {}
        for stream in chosen:
            if stream is not None and stream.running and stream.replica_index is not None:
                out.setdefault(stream.replica_index, []).append(stream.request_id)
        return out
