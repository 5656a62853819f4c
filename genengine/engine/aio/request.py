"""What one async request is made of: the ``AsyncRequest`` a backend reports tokens into (its caller reads
them as ``genengine.protocol.StreamChunk``s), and the argument checks every async call makes before it
submits anything.

Kept apart from the engine base so that code that only carries requests (the Ray pool, a backend's driver)
imports no engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

from genengine.errors import InvalidArgumentError
from genengine.protocol import FinishReason, GenerationOutput, GenerationResult, SamplingParams, StreamChunk
from genengine.requests import Request, normalize_requests

__all__ = ["AsyncRequest", "normalize_async_request", "normalize_request_ids"]


@dataclass
class _Sample:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)
    finish: FinishReason | None = None
    stop_reason: str | int | None = None
    text: str | None = None


class AsyncRequest:
    """One request in flight: the backend reports into it, the caller's stream reads from it.

    ``emit``/``finish``/``fail`` may be called from any thread; chunks reach the caller's event loop in order.
    """

    def __init__(self, request_id: str, request: Request, version: int, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.request = request
        self.params: SamplingParams = request.params
        self.prompt_token_ids: tuple[int, ...] | None = request.prompt_token_ids
        self.samples = [_Sample(versions=[(0, version)]) for _ in range(request.params.n)]
        self.error: BaseException | None = None
        self._loop = loop
        self._queue: asyncio.Queue[StreamChunk | BaseException | None] = asyncio.Queue()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    # ---- what a backend calls ------------------------------------------------------------------------------
    def emit(self, index: int, token_ids: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
        """Completion ``index`` sampled ``token_ids`` (with their processed logprobs when asked for)."""
        with self._lock:
            sample = self.samples[index]
            if sample.finish is not None:
                return
            sample.tokens.extend(token_ids)
            if logprobs is not None:
                sample.logprobs.extend(logprobs)
            chunk = StreamChunk(
                self.request_id,
                index,
                list(token_ids),
                list(logprobs) if logprobs is not None and self.params.logprobs else None,
                sample.versions[-1][1],
            )
        self._put(chunk)

    def finish(
        self, index: int, reason: FinishReason, *, stop_reason: str | int | None = None, text: str | None = None
    ) -> None:
        """Completion ``index`` ended; an aborted one keeps the tokens it had."""
        with self._lock:
            sample = self.samples[index]
            if sample.finish is not None:
                return
            sample.finish, sample.stop_reason, sample.text = reason, stop_reason, text
            logprobs: list[float] | None = [] if self.params.logprobs else None
            chunk = StreamChunk(self.request_id, index, [], logprobs, sample.versions[-1][1], reason)
            last = all(s.finish is not None for s in self.samples)
        if last:
            self._set_done()  # before the stream ends, so that a reader at its end sees the request done
        self._put(chunk)
        if last:
            self._put(None)

    def fail(self, exc: BaseException) -> None:
        """The engine failed this request: its stream raises ``exc``."""
        with self._lock:
            if self._done.is_set():
                return
            self.error = exc
        self._set_done()
        self._put(exc)

    # ---- what the core uses ------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    def unfinished(self) -> list[int]:
        with self._lock:
            return [i for i, s in enumerate(self.samples) if s.finish is None]

    def new_version(self, version: int) -> None:
        """Tokens from here on come from weight version ``version``."""
        with self._lock:
            for sample in self.samples:
                if sample.finish is None and sample.versions[-1][1] != version:
                    start = len(sample.tokens)
                    if sample.versions[-1][0] == start:
                        sample.versions[-1] = (start, version)
                    else:
                        sample.versions.append((start, version))

    async def wait(self) -> None:
        """Until the request is done, on the caller's loop (which need not be the submitter's)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._done.is_set():
                return
            self._waiters.append((loop, future))
        await future

    def _set_done(self) -> None:
        with self._lock:
            self._done.set()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed
                loop.call_soon_threadsafe(_resolve, future)

    def _put(self, item: StreamChunk | BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is reading any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def chunks(self) -> AsyncGenerator[StreamChunk, None]:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def result(self) -> GenerationResult:
        with self._lock:
            return GenerationResult(
                prompt_token_ids=list(self.prompt_token_ids or ()),
                outputs=[
                    GenerationOutput(
                        token_ids=list(s.tokens),
                        text=s.text,
                        finish_reason=s.finish or "abort",
                        logprobs=list(s.logprobs) if self.params.logprobs else None,
                        stop_reason=s.stop_reason,
                        weight_versions=tuple(s.versions),
                    )
                    for s in self.samples
                ],
            )


def normalize_async_request(
    prompt: str | None,
    sampling_params: Any,
    prompt_token_ids: Sequence[int] | None,
    image_data: Any,
    request_id: str | None,
    *,
    vocab_size: int | None,
    supports_images: bool,
) -> tuple[Request, str]:
    """One async call's arguments checked and normalised, before anything is submitted: the request, and its
    id (a fresh one when None). An async call takes one prompt, not a batch."""
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidArgumentError(
            f"prompt={prompt!r}: the async calls take one prompt (a string); submit a batch as several calls"
        )
    if isinstance(sampling_params, Sequence):
        raise InvalidArgumentError("the async calls take one SamplingParams (or mapping), not a list")
    (request,) = normalize_requests(
        prompt,
        sampling_params,
        prompt_token_ids=None if prompt_token_ids is None else [prompt_token_ids],
        image_data=None if image_data is None else [image_data],
        vocab_size=vocab_size,
        supports_images=supports_images,
    )
    if request_id is None:
        request_id = uuid.uuid4().hex
    elif not isinstance(request_id, str) or not request_id:
        raise InvalidArgumentError(f"request_id={request_id!r} must be a non-empty string or None")
    return request, request_id


def normalize_request_ids(request_ids: str | Sequence[str] | None) -> list[str] | None:
    """``abort``'s argument (an engine's and a pool's alike): None (every request) or the ids as strings, one id
    given alone counting as a list of it; anything else is refused, naming what is allowed."""
    if request_ids is None:
        return None
    if isinstance(request_ids, str):
        return [request_ids]
    if not isinstance(request_ids, Sequence):
        raise InvalidArgumentError(f"request_ids={request_ids!r}: allowed are None, an id, or a list of ids")
    return [str(rid) for rid in request_ids]


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
