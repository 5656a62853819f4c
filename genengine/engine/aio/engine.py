"""``AsyncEngineBase``: an ``EngineBase`` that serves the async calls too, over a backend's scheduler; and
``RequestStream``, the caller's handle on one of its requests.

The request registry, the pause modes, the queue of requests that arrive while paused, weight versions per
output and the errors trainers see are written here once, so that every backend has the same semantics and
the conformance suite tests them once. A backend subclasses it instead of ``EngineBase`` and fills in four
methods that talk to its scheduler (``_async_start``, ``_async_abort``, ``_async_hold``,
``_async_release_hold``); the scheduler reports tokens through :class:`~genengine.engine.aio.AsyncRequest`
(``emit``, ``finish``, ``fail``) from whatever thread it runs on. ``sleep``, ``load_weights`` (and its
load sessions) and ``shutdown`` are ``EngineBase``'s, guarded here against the requests in flight through its
hooks (``_check_weights_may_change``, ``_on_new_weight_version``): ``EngineBase`` itself knows nothing of them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from genengine.engine.aio.request import AsyncRequest, normalize_async_request, normalize_request_ids
from genengine.engine.aio.stream import StreamBase
from genengine.engine.base import EngineBase
from genengine.errors import EngineStateError, InvalidArgumentError
from genengine.protocol import PAUSE_MODES, GenerationResult, PauseMode, StreamChunk

__all__ = ["PAUSE_MODES", "AsyncEngineBase", "PauseMode", "RequestStream"]


class AsyncEngineBase(EngineBase):
    """An ``EngineBase`` with the async half of the protocol, over a backend's scheduler."""

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

    def _adapters_in_use(self) -> set[int]:
        state = self._async_state()
        with state.lock:
            return {id(r.request.lora) for r in [*state.live.values(), *state.queued] if not r.done}

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
        self._check_open()
        self._check_async_available()
        ids = normalize_request_ids(request_ids)
        state = self._async_state()
        with state.lock:
            wanted = None if ids is None else set(ids)
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
        self._check_open()
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
        self._check_open()
        self._check_async_available()
        state = self._async_state()
        with state.lock:
            if state.paused is None:
                return
            held = state.held
        self._check_no_open_load("resume_generation")
        self._check_can_generate()
        if held:
            self._async_release_hold()
        with state.lock:
            state.paused, state.held = None, False
            queued, state.queued = state.queued, []
        for request in queued:
            self._admit(request)

    # ---- EngineBase's calls, guarded against the requests in flight ---------------------------------------------
    def sleep(self, level: int = 1) -> None:
        self._check_sleep(level)  # a bad call is refused as it would be without requests
        if not self.released_tags:
            self._check_idle("sleep")
        super().sleep(level)

    def shutdown(self) -> None:
        if self.closed:
            return
        try:
            super().shutdown()
        finally:
            self._after_shutdown()

    # ---- the guards -------------------------------------------------------------------------------------------
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
            live = [r for r in state.live.values() if not r.done and r.request.lora is None]  # adapters: fixed
        for request in live:
            request.new_version(version)

    def _abort_queued(self) -> None:
        """End every request queued during a pause "abort", with no tokens (they never started): what a
        backend's ``_shutdown`` calls once the ones it runs are ended, before it stops its engine."""
        state = self._async_state()
        with state.lock:
            queued, state.queued = state.queued, []
        for request in queued:
            for index in request.unfinished():
                request.finish(index, "abort")

    def _abort_now(self, request: AsyncRequest) -> None:
        """Abort one request without awaiting its end (its caller is being cancelled): a request queued during
        a pause ends "abort" at once and never starts; one the engine runs is handed to ``_async_abort``."""
        state = self._async_state()
        with state.lock:
            queued = request in state.queued
            if queued:
                state.queued.remove(request)
        if queued:
            for index in request.unfinished():
                request.finish(index, "abort")
        elif not request.done:
            self._async_abort([request])

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
    def _submit(
        self,
        prompt: str | None,
        sampling_params: Any,
        prompt_token_ids: Sequence[int] | None,
        image_data: Any,
        request_id: str | None,
    ) -> AsyncRequest:
        self._check_open()
        self._check_async_available()
        request, request_id = normalize_async_request(
            prompt,
            sampling_params,
            prompt_token_ids,
            image_data,
            request_id,
            vocab_size=self._vocab_size(),
            supports_images=self.supports_images,
        )
        request = self._bind_adapters([request])[0]
        self._check_can_generate()
        if self.paused is None:
            self._check_no_open_load("start a request")  # queued during a pause, it starts after the commit
        version = self._version_of(request, self.weight_version)
        handle = AsyncRequest(request_id, request, version, asyncio.get_running_loop())
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
        # load (and the resume) is that load's version, not the one it was submitted under; so is its adapter.
        handle.request = self._rebind_adapter(handle.request)
        handle.new_version(self._version_of(handle.request, self.weight_version))
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


@dataclass
class _AsyncState:
    lock: threading.Lock = field(default_factory=threading.Lock)
    live: dict[str, AsyncRequest] = field(default_factory=dict)
    queued: list[AsyncRequest] = field(default_factory=list)
    paused: PauseMode | None = None
    held: bool = False


class RequestStream(StreamBase):
    """A request of an ``AsyncEngineBase``: its chunks as its scheduler makes them."""

    def __init__(self, engine: AsyncEngineBase, request: AsyncRequest) -> None:
        self._engine = engine
        self._request = request
        self._chunks = request.chunks()

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def done(self) -> bool:
        return self._request.done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamChunk:
        return await self._chunks.__anext__()

    def _error(self) -> BaseException | None:
        return self._request.error

    def _result(self) -> GenerationResult | None:
        return self._request.result() if self._request.done else None

    async def _abort(self, *, cancelled: bool) -> None:
        if cancelled:
            self._engine._abort_now(self._request)  # without awaiting: the caller is being cancelled
        else:
            await self._engine.abort(self.request_id)

    async def _close(self) -> None:
        await self._chunks.aclose()
