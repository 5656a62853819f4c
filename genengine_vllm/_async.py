"""The async capability on vLLM 0.24.0 - 0.26.0: one driver thread steps the in-process engine for streamed requests.

vLLM's ``LLM.generate`` steps its ``LLMEngine`` until *every* request it knows is finished, so streamed
requests cannot share it; they go through the same v1 ``LLMEngine`` one level down, as ``LLM`` itself does:
``add_request`` (``RequestOutputKind.DELTA``: each step's new tokens), ``step``, ``abort_request``; the pause
is the engine core's own ``pause_scheduler(mode="keep")`` / ``resume_scheduler``. The vLLM source lines
these rely on are listed in docs/upstream.md.

vLLM's engine is not thread-safe: every call into it, from the driver or from a caller's thread (a submit,
an abort, a pause, a weight load, a sleep, a synchronous ``generate``), runs under one
:class:`~genengine.engine.aio.DriverLock`. The driver takes it for one step at a time and lets waiting callers in first.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from genengine.backend import DriverLock
from genengine.errors import EngineClosedError, EngineStateError, InvalidArgumentError
from genengine_vllm.mapping import completion_delta

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from genengine.backend import AsyncRequest

__all__ = ["AsyncDriver", "SyncBatch", "cached_block_ids", "engine_stream"]

_DRAIN_STEPS = 16
"""Steps a pause may take to collect the batch still in flight (async scheduling keeps at most 2)."""
_IDLE_STEPS = 4
"""Steps the driver takes with nothing of its own left, so that a batch of aborted requests comes back."""
_COALESCE_S = 0.002
"""The driver's pause before stepping again after idling: a burst of submissions lands in one batch."""


@contextlib.contextmanager
def engine_stream(cuda: tuple[int, Any] | None) -> Iterator[None]:
    """Run vLLM work from any thread on ``cuda``: the device and CUDA stream of the thread that started vLLM.

    vLLM gives each thread its own current stream (PyTorch's pool streams do not wait for each other), so a
    weight write or a generate from another thread (a Ray replica's worker threads, say) could overlap a step
    on the driver's stream. On the thread that started vLLM this is that thread's stream already and nothing
    changes; elsewhere the engine's stream first waits for the caller's (the trainer's tensors are ready) and
    the caller's waits for it after (they may be freed)."""
    if cuda is None:
        yield
        return
    import torch

    device, stream = cuda
    caller = torch.cuda.current_stream(device)
    if caller == stream:
        yield
        return
    stream.wait_stream(caller)
    try:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield
    finally:
        caller.wait_stream(stream)


@dataclass
class _InFlight:
    """One vLLM request (always ``n=1``): completion ``index`` of an async request."""

    request: AsyncRequest
    index: int
    text: list[str] = field(default_factory=list)


@dataclass
class SyncBatch:
    """A synchronous ``generate``'s vLLM requests, served by the driver while async requests are live."""

    outputs: list[Any]
    remaining: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def wait(self, alive: Callable[[], bool] | None = None) -> list[Any]:
        """The outputs; raises the batch's error. ``alive``: whether the driver still runs (checked each
        second, so a driver thread that died fails the wait instead of leaving it forever)."""
        while not self.done.wait(1.0):
            if alive is not None and not alive() and not self.done.is_set():
                raise EngineStateError("vLLM's driver thread ended while a generate() was served by it")
        if self.error is not None:
            raise self.error
        return self.outputs


class AsyncDriver:
    """Steps vLLM's ``LLMEngine`` on its own thread while streamed (or driver-served sync) requests live.

    Every method but :meth:`wake` and :meth:`close` is called with the :class:`~genengine.engine.aio.DriverLock` held.
    """

    def __init__(self, llm: Any, lock: DriverLock, *, detokenize: bool, cuda: tuple[int, Any] | None) -> None:
        self.llm = llm
        self.engine = llm.llm_engine  # the v1 LLMEngine
        self.core = llm.llm_engine.engine_core.engine_core  # InprocClient's EngineCore
        self.lock = lock
        self.detokenize = detokenize
        self._cuda = cuda
        self.samples: dict[str, _InFlight] = {}
        self.by_request: dict[int, list[str]] = {}  # id(AsyncRequest) -> its vLLM request ids
        self.sync: dict[str, tuple[SyncBatch, int]] = {}
        self.held = False
        self.kept_kv = False
        """Held with ``clear_cache=False``: the held requests keep KV blocks computed with the old weights."""
        self._stopping = False
        self.broken: BaseException | None = None
        """Why a step failed, or the thread died: vLLM's own process mode treats either as fatal,
        so nothing is handed to it any more."""
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, args=(cuda,), daemon=True, name="genengine-vllm-driver")
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def check_usable(self) -> None:
        if self.broken is not None:
            raise EngineStateError(
                f"vLLM failed earlier ({type(self.broken).__name__}: {self.broken}); shut this engine down"
            )
        if not self._thread.is_alive() and not self._stopping:
            raise EngineStateError("vLLM's driver thread is not running; shut this engine down")

    @property
    def busy(self) -> bool:
        """Requests of ours are in vLLM (a synchronous ``generate`` must then go through the driver)."""
        return bool(self.samples or self.sync)

    # ---- requests ----------------------------------------------------------------------------------------
    def start(self, request: AsyncRequest, inputs: list[tuple[dict[str, Any], Any]]) -> None:
        """Hand vLLM one single-sample request per completion; a refusal adds none of them. A request that
        ended meanwhile (aborted from another thread before it got here) is not handed over."""
        from vllm.sampling_params import RequestOutputKind

        self.check_usable()
        if request.done:
            return

        ids = self._add(inputs, "a", RequestOutputKind.DELTA, request)
        for index, vid in enumerate(ids):
            self.samples[vid] = _InFlight(request, index)
        self.by_request[id(request)] = ids

    def submit_sync(
        self, prompts: list[dict[str, Any]], params: list[Any], loras: list[Any] | None = None
    ) -> SyncBatch:
        """A synchronous ``generate``'s requests (``loras``: each one's ``LoRARequest``); their final outputs come back
        in ``prompts``' order."""
        from vllm.sampling_params import RequestOutputKind

        self.check_usable()
        ids = self._add(list(zip(prompts, params, strict=True)), "s", RequestOutputKind.FINAL_ONLY, None, loras)
        batch = SyncBatch(outputs=[None] * len(ids), remaining=len(ids))
        for position, vid in enumerate(ids):
            self.sync[vid] = (batch, position)
        if not ids:
            batch.done.set()
        return batch

    def _add(
        self,
        inputs: list[tuple[dict[str, Any], Any]],
        kind: str,
        output_kind: Any,
        request: AsyncRequest | None,
        loras: list[Any] | None = None,
    ) -> list[str]:
        ids: list[str] = []
        adding: list[str] = []
        bound = None if request is None or request.request.lora is None else request.request.lora.handle
        try:
            for k, (prompt, params) in enumerate(inputs):
                params.output_kind = output_kind  # as LLM._add_request sets FINAL_ONLY
                # Rendered as LLM.generate renders: the same prompt token ids.
                engine_input = self.llm._preprocess_cmpl_one(prompt)
                vid = f"genengine-{kind}{next(self._ids)}"
                # LLMEngine.add_request registers the id with the output processor before the engine core
                # takes it: if the core refuses, that state must go too, or
                # has_unfinished_requests() stays True and LLM.generate loops forever.
                adding = [vid]
                lora = bound if loras is None else loras[k]
                extra = {} if lora is None else {"lora_request": lora}  # the adapter's LoRARequest
                self.engine.add_request(vid, engine_input, params, **extra)
                ids.append(vid)
                adding = []
                if request is not None and request.prompt_token_ids is None:
                    token_ids = engine_input.get("prompt_token_ids") if isinstance(engine_input, dict) else None
                    if token_ids is not None:
                        request.prompt_token_ids = tuple(int(t) for t in token_ids)
        except BaseException as exc:
            if ids or adding:
                self.engine.abort_request([*ids, *adding])  # an id vLLM does not know is ignored
            if isinstance(exc, ValueError) and not isinstance(exc, InvalidArgumentError):
                raise InvalidArgumentError(f"vLLM refused the request: {exc}") from exc
            raise
        return ids

    def abort(self, requests: list[AsyncRequest]) -> None:
        """vLLM forgets them and frees their KV (``LLMEngine.abort_request``); each keeps the tokens it
        was told of (a token sampled in the batch still in flight is dropped with the request)."""
        ids = [vid for r in requests for vid in self.by_request.pop(id(r), [])]
        try:
            if ids:
                self.engine.abort_request(ids)
        finally:
            for vid in ids:
                self.samples.pop(vid, None)
            for request in requests:
                for index in request.unfinished():
                    request.finish(index, "abort")

    # ---- stepping ----------------------------------------------------------------------------------------
    def step(self) -> None:
        """One engine-core step (on the driver's thread, or a caller's while nothing of ours runs). A failure
        fails every request of ours and leaves the driver broken: vLLM's batch queue may be out of step."""
        try:
            outputs = self.engine.step()  # one engine-core step, outputs as RequestOutputs
        except BaseException as exc:
            self.broken = exc
            self._fail_all(exc)
            raise
        for out in outputs:
            sample = self.samples.get(out.request_id)  # the id we gave
            if sample is not None:
                self._report(out.request_id, sample, out)
                continue
            entry = self.sync.get(out.request_id)
            if entry is not None and out.finished:
                del self.sync[out.request_id]
                batch, position = entry
                batch.outputs[position] = out
                batch.remaining -= 1
                if not batch.remaining:
                    batch.done.set()

    def _report(self, vid: str, sample: _InFlight, out: Any) -> None:
        request = sample.request
        try:
            for completion in out.outputs:  # one: every request here has n=1
                delta = completion_delta(completion, request.params, detokenize=self.detokenize)
                if delta.token_ids:
                    request.emit(sample.index, delta.token_ids, delta.logprobs)
                sample.text.append(delta.text)
                if delta.finish_reason is not None:
                    self._forget(vid, request)
                    text = "".join(sample.text) if self.detokenize else None
                    request.finish(sample.index, delta.finish_reason, stop_reason=delta.stop_reason, text=text)
        except EngineStateError as exc:
            self.abort([request])  # its other completions too: the request has no result
            request.fail(exc)

    def _forget(self, vid: str, request: AsyncRequest) -> None:
        self.samples.pop(vid, None)
        ids = self.by_request.get(id(request))
        if ids is not None:
            with contextlib.suppress(ValueError):
                ids.remove(vid)
            if not ids:
                del self.by_request[id(request)]

    def _core_busy(self) -> bool:
        """The engine core has work: a batch in flight (async scheduling's ``batch_queue``) or requests its
        scheduler has not returned yet."""
        return bool(self.core.batch_queue) or bool(self.core.scheduler.has_requests())

    def quiesce(self) -> None:
        """Step until the engine core is idle. Only while nothing of ours can be scheduled (held, or none
        live): the steps then only bring back the batch in flight."""
        with engine_stream(self._cuda):  # a step from a caller's thread runs where the driver's do
            for _ in range(_DRAIN_STEPS):
                if not self._core_busy():
                    return
                self.step()
        raise EngineStateError(f"vLLM's engine core did not go idle within {_DRAIN_STEPS} steps")

    def settle(self) -> None:
        """Before a weight write or a sleep: collect a batch of finished or aborted requests still in flight."""
        if self.held or not self.busy:
            self.quiesce()

    # ---- pause --------------------------------------------------------------------------------------------
    def hold(self, clear_cache: bool) -> None:
        """vLLM's ``pause_scheduler(mode="keep")``: nothing is scheduled any more (``PAUSED_ALL``); the batch
        in flight comes back first, so every token sampled with the old weights is reported before they
        change. ``clear_cache``: then ``EngineCore._reset_caches``, whose
        ``reset_prefix_cache(reset_running_requests=True)`` preempts every running request to the waiting queue
        with its KV freed, so at resume vLLM recomputes prompt + tokens so far with the weights then loaded;
        without it each keeps its KV blocks and goes on from them."""
        if self.sync:
            raise EngineStateError(
                "a synchronous generate() is being served with the async requests: pause after it returned"
            )
        self.core.pause_scheduler(mode="keep", clear_cache=False)  # in-process: no "wait"
        try:
            self.quiesce()
            if clear_cache:
                # The engine core's reset clears the receiver's multimodal cache only; the sender's (the
                # renderer's) must go with it, as AsyncLLM.pause_generation does, else a later request with
                # an image seen before fails the core's "Expected a cached item".
                self.engine.renderer.clear_mm_cache()
                self.core.pause_scheduler(mode="keep", clear_cache=True)
        except BaseException:
            self.core.resume_scheduler()
            raise
        self.held, self.kept_kv = True, not clear_cache

    def release(self) -> None:
        self.core.resume_scheduler()
        self.held = self.kept_kv = False

    def evict_prefix_cache(self) -> None:
        """Take every block out of vLLM's prefix cache, blocks in use included (they stay allocated to their
        requests): ``KVCacheManager.evict_blocks``. After a weight load
        under requests that keep their KV, no new request may hit KV computed with the old weights."""
        manager = self.core.scheduler.kv_cache_manager
        cached = cached_block_ids(manager.block_pool)
        if cached:
            manager.evict_blocks(cached)

    # ---- the thread ---------------------------------------------------------------------------------------
    def wake(self) -> None:
        self._wake.set()

    def _run(self, cuda: tuple[int, Any] | None) -> None:
        try:
            self._loop(cuda)
        except BaseException as exc:  # outside a step (the stream setup, the lock): nobody steps any more
            self.broken = self.broken or exc
            _log.error("vLLM's driver thread stopped: %s: %s", type(exc).__name__, exc, exc_info=exc)
            with contextlib.suppress(BaseException):
                self._fail_all(exc)

    def _loop(self, cuda: tuple[int, Any] | None) -> None:
        if cuda is not None:
            import torch

            # The device and CUDA stream of the thread that started vLLM (vLLM keeps its stream per thread
            # and would make a new one here): kernels launched from any
            # thread then run in one order on the GPU, a weight write never overlaps a step.
            torch.cuda.set_device(cuda[0])
            torch.cuda.set_stream(cuda[1])
        idle = 0
        while True:
            self._wake.clear()
            with self.lock.for_driver():
                if self._stopping:
                    return
                mine = self.busy
                stepping = not self.held and (mine or (idle < _IDLE_STEPS and self._core_busy()))
                if stepping:
                    idle = 0 if mine else idle + 1
                    with contextlib.suppress(BaseException):  # step() failed every request and is broken
                        self.step()
            if not stepping:
                self._wake.wait()
                idle = 0
                time.sleep(_COALESCE_S)

    def _fail_all(self, exc: BaseException) -> None:
        # The callers keep the error: its traceback must not keep vLLM's frames (the model, the KV cache) alive.
        traceback.clear_frames(exc.__traceback__)
        requests = {id(s.request): s.request for s in self.samples.values()}
        batches = {id(b): b for b, _ in self.sync.values()}
        ids = [*self.samples, *self.sync]
        self.samples.clear()
        self.by_request.clear()
        self.sync.clear()
        with contextlib.suppress(Exception):
            self.engine.abort_request(ids)
        for request in requests.values():
            request.fail(exc)
        for batch in batches.values():
            batch.error = exc
            batch.done.set()

    def close(self) -> None:
        """Abort every request (streams end with "abort", keeping their tokens), fail a driver-served
        ``generate`` with ``EngineClosedError``, and end the thread."""
        with self.lock():
            self._stopping = True
            requests = list({id(s.request): s.request for s in self.samples.values()}.values())
            with contextlib.suppress(Exception):
                self.abort(requests)
            batches = {id(b): b for b, _ in self.sync.values()}
            with contextlib.suppress(Exception):
                if self.sync:
                    self.engine.abort_request(list(self.sync))
            self.sync.clear()
            for batch in batches.values():
                batch.error = EngineClosedError("the engine was shut down while generate() was running")
                batch.done.set()
        self._wake.set()
        self._thread.join(timeout=60)
        # Let go of vLLM: a request's error (kept by whoever holds its stream) has tracebacks through this
        # driver's frames, and must not keep the model and the KV cache alive after shutdown.
        self.llm = self.engine = self.core = None


def cached_block_ids(pool: Any) -> set[int]:
    """The ids of the blocks in vLLM's prefix cache, read from its hash index (what is cached: a few blocks)
    rather than by walking ``pool.blocks`` (every KV block of the pool: millions for a small model on a large
    GPU, 0.3 s of Python a weight sync). The index's table is private (vLLM 0.24-0.26 all keep it as
    ``BlockHashToBlockMap._cache``: a block or a {block_id: block} dict per hash); without it, the walk."""
    entries = getattr(getattr(pool, "cached_block_hash_to_block", None), "_cache", None)
    if not isinstance(entries, dict):
        return {block.block_id for block in pool.blocks if block.block_hash is not None}
    ids: set[int] = set()
    for blocks in entries.values():
        if isinstance(blocks, dict):
            ids.update(blocks)
        else:
            ids.add(blocks.block_id)
    return ids
