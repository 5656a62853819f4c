"""The async capability, written once: streamed requests, abort, pause for a weight update, resume.

A backend mixes :class:`AsyncEngineMixin` into its :class:`~genengine.base.EngineBase` subclass and fills in
four hooks that talk to its scheduler (``_async_start``, ``_async_abort``, ``_async_hold``,
``_async_release_hold``); the scheduler reports tokens through :class:`AsyncRequest` (``emit``, ``finish``,
``fail``) from whatever thread it runs on. The request registry, the pause modes, the queue of requests that
arrive while paused, weight versions per output and the errors trainers see live here, so every backend has
the same semantics and the conformance suite tests them once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from genengine.errors import EngineStateError, InvalidArgumentError
from genengine.protocol import FinishReason, GenerationOutput, GenerationResult, SamplingParams
from genengine.requests import Request, normalize_requests

if TYPE_CHECKING:
    from genengine.base import EngineBase

__all__ = [
    "PAUSE_MODES",
    "AsyncEngineMixin",
    "AsyncRequest",
    "DriverLock",
    "PauseMode",
    "RequestStream",
    "StreamChunk",
    "normalize_async_request",
]

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")


@dataclass(frozen=True)
class StreamChunk:
    """New tokens of one completion of one request, as the engine produced them."""

    request_id: str
    index: int
    """Which of the request's ``n`` completions."""
    token_ids: list[int]
    logprobs: list[float] | None
    weight_version: int
    """The weight version these tokens were sampled with."""
    finish_reason: FinishReason | None = None
    """Set on the completion's last chunk (which may carry no tokens)."""


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


class DriverLock:
    """The lock around every call into an engine that a driver thread steps (the scheduler of an async
    backend). Callers outside the driver count themselves in ``waiting``: the driver takes the lock straight
    back after each step (Python locks are not fair), so it waits while anyone else does, and an abort, a
    pause or a weight load never starves behind a long generation."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._count = threading.Lock()
        self.waiting = 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        """For a caller outside the driver."""
        with self._count:
            self.waiting += 1
        try:
            with self.lock:
                yield
        finally:
            with self._count:
                self.waiting -= 1

    def let_callers_in(self) -> None:
        """For the driver, before it takes the lock again: until no caller waits for it."""
        while self.waiting:
            time.sleep(0.0002)

    @contextlib.contextmanager
    def for_driver(self) -> Iterator[None]:
        self.let_callers_in()
        with self.lock:
            yield


class AsyncEngineMixin:
    """The async half of the protocol over a backend's scheduler; mix in before ``EngineBase``."""

    supports_async: ClassVar[bool] = True

    # ---- what a backend implements -------------------------------------------------------------------------
    def _check_async_available(self) -> None:
        """Raise if this engine object cannot serve the async calls at all (e.g. a TP rank that holds no
        engine); every async call asks, right after the closed check. Most backends can always serve them."""

    def _async_start(self, request: AsyncRequest) -> None:
        """Admit a validated request; the scheduler reports into it. The engine is awake with valid weights."""
        raise NotImplementedError

    def _async_abort(self, requests: list[AsyncRequest]) -> None:
        """Stop these requests; each unfinished completion must be ``finish``-ed with "abort" (now or soon)."""
        raise NotImplementedError

    def _async_hold(self, clear_cache: bool) -> None:
        """Stop stepping and keep every request where it is. ``clear_cache`` True: their KV is recomputed
        with the weights loaded before ``_async_release_hold``; False: the KV computed so far is reused."""
        raise NotImplementedError

    def _async_release_hold(self) -> None:
        """Step the held requests again."""
        raise NotImplementedError

    # ---- state -----------------------------------------------------------------------------------------------
    def _async_state(self) -> _AsyncState:
        state: _AsyncState | None = self.__dict__.get("_genengine_async")
        if state is None:
            state = self.__dict__.setdefault("_genengine_async", _AsyncState())
        return state

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished: running, held by a ``keep`` pause, or queued during a pause
        (what ``abort()`` with no ids ends)."""
        state = self._async_state()
        with state.lock:
            return len(state.queued) + sum(1 for r in state.live.values() if not r.done)

    def _running(self) -> int:
        """Requests admitted to the engine and not finished (held ones included): those that use its memory
        and that a weight load lands under. Queued ones are not admitted until resume."""
        state = self._async_state()
        with state.lock:
            return sum(1 for r in state.live.values() if not r.done)

    @property
    def paused(self) -> PauseMode | None:
        """The mode of the pause in force, or None."""
        return self._async_state().paused

    # ---- the async protocol --------------------------------------------------------------------------------
    def stream(
        self,
        prompt: str | None = None,
        sampling_params: Any = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        image_data: Any = None,
        request_id: str | None = None,
    ) -> RequestStream:
        """Submit one prompt; iterate the returned stream for its chunks as they come (it ends after every
        completion's last chunk), then read ``result()``. Closing the stream early aborts the request."""
        return RequestStream(self, self._submit(prompt, sampling_params, prompt_token_ids, image_data, request_id))

    async def generate_async(
        self,
        prompt: str | None = None,
        sampling_params: Any = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        image_data: Any = None,
        request_id: str | None = None,
    ) -> GenerationResult:
        """One prompt's completions once all are finished (an aborted one with its partial tokens)."""
        return await self.stream(
            prompt, sampling_params, prompt_token_ids=prompt_token_ids, image_data=image_data, request_id=request_id
        ).collect()

    async def abort(self, request_ids: str | Sequence[str] | None = None) -> list[str]:
        """Abort requests (all when None: every one submitted and not finished, running, held or queued during
        a pause; finished or unknown ids are skipped); returns the ids aborted.

        An aborted request's result keeps every token it produced, with its logprobs, and ``finish_reason
        "abort"``; requests queued during a pause finish at once with no tokens (they never start).
        """
        self._engine_base()._check_open()
        self._check_async_available()
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        elif request_ids is not None and not isinstance(request_ids, Sequence):
            raise InvalidArgumentError(f"request_ids={request_ids!r}: allowed are None, an id, or a list of ids")
        state = self._async_state()
        with state.lock:
            wanted = None if request_ids is None else {str(r) for r in request_ids}
            queued = [r for r in state.queued if wanted is None or r.request_id in wanted]
            state.queued = [r for r in state.queued if wanted is not None and r.request_id not in wanted]
            running = [r for rid, r in state.live.items() if (wanted is None or rid in wanted) and not r.done]
        for request in queued:
            for index in request.unfinished():
                request.finish(index, "abort")
        if running:
            self._async_abort(running)
        for request in running:
            await request.wait()
        # One that finished on its own while the abort reached the engine (its last token was already sampled)
        # was not aborted: the ids returned are those whose result says "abort".
        ended = [r for r in running if any(s.finish == "abort" for s in r.samples)]
        return [r.request_id for r in (*queued, *ended)]

    async def pause_generation(self, mode: PauseMode = "keep", *, clear_cache: bool = True) -> None:
        """Stop generating so that the weights can change; requests submitted meanwhile wait for resume.

        ``"abort"``: in-flight requests finish now with ``finish_reason="abort"`` and their partial tokens.
        ``"wait"``: returns once every in-flight request finished on its own.
        ``"keep"``: in-flight requests stay where they are and go on after ``resume_generation``; with
        ``clear_cache=True`` the KV computed so far is dropped and recomputed with the weights in force at
        resume, with False the old KV is reused (faster, but the tokens after the switch attend to keys and
        values computed by the old weights).
        """
        engine = self._engine_base()
        engine._check_open()
        self._check_async_available()
        if mode not in PAUSE_MODES:
            raise InvalidArgumentError(f"pause mode={mode!r}: allowed are 'abort', 'wait' and 'keep'")
        if not isinstance(clear_cache, bool):
            raise InvalidArgumentError(f"clear_cache={clear_cache!r} must be True or False")
        state = self._async_state()
        with state.lock:
            if state.paused is not None:
                if state.paused == mode:
                    return
                raise EngineStateError(
                    f"generation is already paused (mode {state.paused!r}): resume_generation() before pausing "
                    f"with mode {mode!r}"
                )
            state.paused = mode
            running = [r for r in state.live.values() if not r.done]
        try:
            if mode == "abort":
                if running:
                    self._async_abort(running)
            elif mode == "keep":
                self._async_hold(clear_cache)
                state.held = True
            for request in running if mode != "keep" else ():
                await request.wait()
        except BaseException:
            with state.lock:
                state.paused = None
            raise

    async def resume_generation(self) -> None:
        """Go on after ``pause_generation``: held requests continue, queued ones start (labelled with the weight
        version in force now). While the engine is asleep (any tag released) or its weights are incomplete it
        raises (``EngineSleepingError``, ``WeightsNotLoadedError``) and stays paused, held or queued requests
        or not: requests submitted after a resume would be admitted to an engine that cannot run them."""
        engine = self._engine_base()
        engine._check_open()
        self._check_async_available()
        state = self._async_state()
        with state.lock:
            if state.paused is None:
                return
            held = state.held
        engine._check_can_generate()
        if held:
            self._async_release_hold()
        with state.lock:
            state.paused, state.held = None, False
            queued, state.queued = state.queued, []
        for request in queued:
            self._admit(request)

    # ---- hooks EngineBase calls -------------------------------------------------------------------------------
    def _check_idle(self, what: str) -> None:
        """Refuse ``what`` (a sleep) while requests run or are held: it would free memory they use. Requests
        queued during a pause hold none (they start at resume, which needs the engine awake)."""
        count = self._running()
        if count:
            raise EngineStateError(
                f"cannot {what} with {count} request(s) running or held: abort() them or pause_generation('abort' "
                "or 'wait') first"
            )

    def _check_weights_may_change(self) -> None:
        """A weight load may not land under running requests: pause them first (``keep`` carries them over).
        Admitted requests are allowed only once a ``keep`` pause holds them: during an ``abort`` or ``wait``
        pause that has not returned (or a ``keep`` one still being set up) they still run. Queued ones do not
        count: they start at resume, with the weights then in force."""
        count = self._running()
        state = self._async_state()
        if not count or state.held:
            return
        if state.paused is None:
            raise EngineStateError(
                f"load_weights with {count} request(s) running: call pause_generation() first "
                "('keep' carries them over to the new weights)"
            )
        raise EngineStateError(
            f"load_weights with {count} request(s) still running: pause_generation({state.paused!r}) has not "
            "returned yet; await it before the load"
        )

    def _on_new_weight_version(self, version: int) -> None:
        state = self._async_state()
        with state.lock:
            live = [r for r in state.live.values() if not r.done]
        for request in live:
            request.new_version(version)

    def _after_shutdown(self) -> None:
        """No stream outlives the engine unfinished: requests the backend did not end (queued ones, or held
        ones it lost) end "abort" with what they have. The registry lets go of every request, so that an
        engine kept after shutdown holds nothing of them (their errors' tracebacks reach engine internals)."""
        state = self._async_state()
        with state.lock:
            requests = [*state.queued, *state.live.values()]
            state.queued, state.live = [], {}
            state.paused, state.held = None, False
        for request in requests:
            for index in request.unfinished():
                request.finish(index, "abort")

    # ---- internals -------------------------------------------------------------------------------------------
    def _engine_base(self) -> EngineBase:
        return self  # type: ignore[return-value]

    def _submit(
        self,
        prompt: str | None,
        sampling_params: Any,
        prompt_token_ids: Sequence[int] | None,
        image_data: Any,
        request_id: str | None,
    ) -> AsyncRequest:
        engine = self._engine_base()
        engine._check_open()
        self._check_async_available()
        request, request_id = normalize_async_request(
            prompt,
            sampling_params,
            prompt_token_ids,
            image_data,
            request_id,
            vocab_size=engine._vocab_size(),
            supports_images=engine.supports_images,
        )
        engine._check_can_generate()
        handle = AsyncRequest(request_id, request, engine.weight_version, asyncio.get_running_loop())
        state = self._async_state()
        with state.lock:
            known = state.live.get(request_id)
            if (known is not None and not known.done) or any(r.request_id == request_id for r in state.queued):
                raise InvalidArgumentError(f"request_id={request_id!r} is already in flight")
            if state.paused is not None:
                state.queued.append(handle)
                return handle
        self._admit(handle)
        return handle

    def _admit(self, handle: AsyncRequest) -> None:
        # Its tokens come from the weights in force now: a request queued during a pause that started after a
        # load (and the resume) is that load's version, not the one it was submitted under.
        handle.new_version(self._engine_base().weight_version)
        state = self._async_state()
        with state.lock:
            for rid in [rid for rid, r in state.live.items() if r.done]:
                del state.live[rid]
            state.live[handle.request_id] = handle
        try:
            self._async_start(handle)
        except BaseException as exc:
            with state.lock:  # refused: the caller gets the error, the registry keeps nothing of it
                if state.live.get(handle.request_id) is handle:
                    del state.live[handle.request_id]
            handle.fail(exc)
            raise


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


class RequestStream:
    """One submitted request: an async iterator of its chunks, then its result."""

    def __init__(self, engine: AsyncEngineMixin, request: AsyncRequest) -> None:
        self._engine = engine
        self._request = request
        self._chunks = request.chunks()

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamChunk:
        return await self._chunks.__anext__()

    async def collect(self) -> GenerationResult:
        """Read the chunks not read yet and return the result; a caller cancelled meanwhile aborts the request."""
        try:
            async for _ in self:
                pass
        except asyncio.CancelledError:
            if not self._request.done:
                self._engine._async_abort([self._request])
            raise
        return self.result()

    def result(self) -> GenerationResult:
        """Every completion with its tokens, logprobs and weight versions; only once the stream has ended."""
        if self._request.error is not None:
            raise self._request.error
        if not self._request.done:
            raise EngineStateError(f"request {self.request_id!r} is still running: read its stream to the end first")
        return self._request.result()

    async def aclose(self) -> None:
        """Stop reading: a request still running is aborted (nobody wants its tokens any more)."""
        if not self._request.done:
            await self._engine.abort(self.request_id)
        await self._chunks.aclose()


@dataclass
class _AsyncState:
    lock: threading.Lock = field(default_factory=threading.Lock)
    live: dict[str, AsyncRequest] = field(default_factory=dict)
    queued: list[AsyncRequest] = field(default_factory=list)
    paused: PauseMode | None = None
    held: bool = False


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
