"""``AsyncDriver``: the async capability on SGLang 0.5.17, through SGLang's own calls.

:class:`AsyncDriver` maps :class:`genengine.backend.AsyncEngineBase`'s hooks onto SGLang's calls (docs/async.md,
"SGLang"), on the loop :class:`genengine_sglang._loop.LoopThread` keeps running while requests are live; the
SGLang source lines they rely on are listed in docs/upstream.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from genengine.errors import EngineStateError, InvalidArgumentError
from genengine_sglang._loop import LoopThread
from genengine_sglang.compat import incremental_streaming, request_prompt_ids
from genengine_sglang.errors import SGLangEngineError
from genengine_sglang.mapping import SglEntry, finish_from_sglang, sampling_to_sglang, stream_delta

if TYPE_CHECKING:
    from genengine.backend import AsyncRequest

__all__ = ["ABORT_ANSWER_TIMEOUT_S", "WATCH_INTERVAL_S", "AsyncDriver"]

ABORT_ANSWER_TIMEOUT_S = 30.0
"""How long SGLang may take to end the requests we aborted (its scheduler answers at its next step)."""
WATCH_INTERVAL_S = 1.0
"""How often, while async requests live, SGLang's processes are checked. SGLang's own watchdog reports a dead
scheduler with SIGQUIT to a handler on its loop (``SubprocessWatchdog``, ``TokenizerManager.auto_create_handle_loop``),
and uvloop delivers signals only while the main thread runs the loop: with our thread running it, a
crash would leave every stream waiting forever."""


@dataclasses.dataclass(eq=False)
class _InFlight:
    """One completion of one async request, as one SGLang request (or, after a clear-cache hold, several)."""

    handle: AsyncRequest
    index: int
    entry: SglEntry
    tokens: list[int] = dataclasses.field(default_factory=list)
    """What the caller was sent."""
    segments: int = 0
    seen: int = 0
    """Tokens of the current SGLang request taken (sent on, or dropped)."""
    rid: str | None = None
    submitted: bool = False
    want: str | None = None
    """None; "drop": finished here, SGLang's answers are ignored; "park": held for a clear-cache resume."""
    parked: bool = False
    finished: bool = False
    retold: bool = False
    """The abort of the current SGLang request was told again (see ``AsyncDriver._tell_again``)."""


class AsyncDriver:
    """The hooks of :class:`genengine.engine.aio.AsyncEngineBase` on one ``sgl.Engine``; lives on the TP leader only.

    * a request: one ``TokenizerManager.generate_request(GenerateReqInput(stream=True, rid=...))`` per sample,
      with our own rids (uuid hex: ``Scheduler.abort_request`` aborts by rid *prefix*, so no rid may be a
      prefix of another);
    * abort: the sample finishes "abort" at once with the tokens the caller was sent, and
      ``TokenizerManager.abort_request(rid)`` stops it in SGLang; what SGLang sends after that is dropped;
    * ``keep`` with ``clear_cache=False``: ``pause_generation(mode="in_place")`` (the requests stay in the
      running batch with their KV) and ``continue_generation``;
    * ``keep`` with ``clear_cache=True``: each sample is aborted in SGLang and, at resume, continued from its
      prompt and the tokens it has (the remaining ``max_new_tokens``), so its whole KV is computed again with
      the weights then in force; SGLang's ``retract`` mode would prefill against a radix cache that still
      holds the prompt's KV from the old weights. The last token of SGLang's abort chunk is not sent on: the
      abort wins over that step's finish checks (``Req.update_finish_state``), so it was never checked for
      EOS, stop strings or length; the continuation samples that position again.
    """

    def __init__(
        self,
        loop: LoopThread,
        tokenizer_manager: Any,
        *,
        deterministic: bool,
        processor: str | None,
        extra_key: Callable[[], str | None],
        timeout_s: float,
        answer_timeout_s: float = ABORT_ANSWER_TIMEOUT_S,
        dead: Callable[[], str | None] | None = None,
        watch_interval_s: float = WATCH_INTERVAL_S,
    ) -> None:
        self._loop = loop
        self._dead = dead
        self._watch_interval_s = watch_interval_s
        self._watching = False  # a check of SGLang's processes is scheduled on the loop
        self._tm = tokenizer_manager
        self._deterministic = deterministic
        self._processor = processor
        self._extra_key = extra_key
        self._timeout_s = timeout_s
        self._answer_timeout_s = min(answer_timeout_s, timeout_s)
        self._lock = threading.Lock()
        self._samples: dict[int, list[_InFlight]] = {}  # id(handle) → its samples
        self._in_place = False
        self._resumed: asyncio.Event | None = None  # made and used on the loop's thread

    # ---- the hooks ---------------------------------------------------------------------------------------------
    def start(self, handle: AsyncRequest, entries: list[SglEntry]) -> None:
        samples = [_InFlight(handle, e.sample, e) for e in entries]
        with self._lock:
            self._forget_done()
            self._samples[id(handle)] = samples
        for sample in samples:
            self._loop.spawn(self._segment(sample))
        if self._dead is not None:
            self._loop.soon(self._arm)

    def abort(self, handles: list[AsyncRequest]) -> None:
        """Each unfinished sample ends now with the tokens it was sent; SGLang is told to stop it."""
        with self._lock:
            for handle in handles:
                for sample in self._samples.get(id(handle), ()):
                    self._finish_here(sample, "abort")

    def hold(self, clear_cache: bool) -> None:
        with self._lock:
            running = [s for group in self._samples.values() for s in group if not s.finished]
            if clear_cache and any(s.handle.request.image is not None for s in running):
                raise EngineStateError(
                    "pause_generation('keep', clear_cache=True) cannot carry image requests over on SGLang (their "
                    "continuation would process the image again): use clear_cache=False, 'wait' or 'abort'"
                )
            if clear_cache:
                for sample in running:
                    sample.want = "park"
                    self._tell_abort(sample)
        if clear_cache:
            # Every sample ends in SGLang (parked here), so SGLang is idle for the load and its cache flush.
            self._wait_idle("pause_generation('keep')")
        elif self._loop.live:
            self._loop.run(self._pause_in_place(), "SGLang's pause_generation(mode='in_place')")

    def release(self) -> None:
        if self._in_place:
            self._loop.run(self._continue(), "SGLang's continue_generation")
        with self._lock:
            parked = [s for group in self._samples.values() for s in group if s.parked and not s.finished]
            for sample in parked:
                sample.parked = False
                sample.want = None
        for sample in parked:
            self._loop.spawn(self._segment(sample))

    # ---- what the engine asks before SGLang calls that need it idle ------------------------------------------
    def keeps_kv(self) -> bool:
        """Requests are held in SGLang with their KV (an in-place pause): its cache cannot be flushed now."""
        return self._in_place and self._unfinished()

    def quiesce(self, what: str) -> None:
        """Make SGLang idle before ``what``: the requests left in it were finished here and are only being
        stopped (an in-place pause would keep them there: SGLang is let go on, it has nothing else to run)."""
        if self._in_place and not self._unfinished():
            self._loop.run(self._continue(), "SGLang's continue_generation")
        self._wait_idle(what)

    def _unfinished(self) -> bool:
        with self._lock:
            return any(not s.finished for group in self._samples.values() for s in group)

    def check_not_paused_in_place(self, what: str) -> None:
        if self._in_place:
            raise EngineStateError(
                f"cannot {what} during pause_generation('keep', clear_cache=False): SGLang holds every new request "
                "until resume_generation() (call it first)"
            )

    def close(self) -> None:
        """For shutdown: every unfinished sample ends "abort" with its tokens; the loop's thread stops."""
        with self._lock:
            for group in self._samples.values():
                for sample in group:
                    self._finish_here(sample, "abort")
        self._loop.close()

    # ---- internals -----------------------------------------------------------------------------------------------
    def _arm(self) -> None:
        """On the loop's thread: check SGLang's processes in ``watch_interval_s`` (a timer, not a task: it does
        not keep the loop's thread alive)."""
        if not self._watching:
            self._watching = True
            self._loop.loop.call_later(self._watch_interval_s, self._watch)

    def _watch(self) -> None:
        self._watching = False
        if not self._unfinished() or self._dead is None:
            return
        problem = self._dead()
        if problem is None:
            self._arm()
            return
        error = SGLangEngineError(f"{problem}: the async requests in flight fail; shut the engine down")
        with self._lock:
            for group in self._samples.values():
                if any(not s.finished for s in group):
                    for sample in group:
                        sample.finished, sample.want = True, "drop"
                    group[0].handle.fail(error)
        self._loop.cancel_tasks()  # their generate_request would never end

    def _wait_idle(self, what: str) -> None:
        """Until SGLang has ended every request of ours (they were aborted: its scheduler answers at its next
        step), bounded by ``answer_timeout_s``; the error names the requests it did not end."""
        if self._loop.wait_idle(self._answer_timeout_s):
            return
        with self._lock:
            pending = [s for group in self._samples.values() for s in group if s.submitted]
        states = getattr(self._tm, "rid_to_state", {})
        rows = [
            f"{s.rid} (request {s.handle.request_id!r} sample {s.index}, "
            f"{'known to' if s.rid in states else 'not in'} the tokenizer manager)"
            for s in pending[:8]
        ]
        paused = getattr(self._tm, "is_pause", None)
        raise SGLangEngineError(
            f"SGLang did not end {len(pending)} aborted request(s) within {self._answer_timeout_s:g} s before {what}: "
            f"{', '.join(rows) or 'none submitted'}; SGLang paused: {paused}, in-place pause of ours: "
            f"{self._in_place}; {self._loop.describe()}"
        )

    def _forget_done(self) -> None:
        for key in [k for k, group in self._samples.items() if all(s.finished for s in group)]:
            del self._samples[key]

    def _finish_here(self, sample: _InFlight, reason: str, **kwargs: Any) -> None:
        """Under ``_lock``: end ``sample`` with what it has; SGLang's later answers for it are dropped."""
        if sample.finished:
            return
        sample.finished = True
        sample.want = "drop"
        sample.handle.finish(sample.index, reason, **kwargs)  # type: ignore[arg-type]
        self._tell_abort(sample)

    def _tell_abort(self, sample: _InFlight) -> None:
        rid = sample.rid
        if sample.submitted and rid is not None:
            self._loop.soon(lambda: self._tm.abort_request(rid))

    def _tell_again(self, sample: _InFlight) -> None:
        """Under ``_lock``: SGLang still streams a request we told to stop; tell it once more (aborts are
        idempotent). Before 0.5.17 an abort that came while the request was between the tokenizer manager and
        the scheduler (tokenized, or waiting for a weight update's lock) reached the scheduler first, which
        did not have it yet, and was lost: the request ran to its end. Its chunks come from the scheduler, so
        the second abort finds it."""
        if sample.submitted and not sample.retold:
            sample.retold = True
            self._tell_abort(sample)

    async def _pause_in_place(self) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        # SGLang's own pause, not merely ours: a weight update while SGLang is not paused waits for its writer
        # lock, which every request in flight holds a reader side of (``model_update_lock``, taken in
        # ``update_weights_from_tensor`` and ``generate_request``): the held requests would never let it through.
        self._in_place = True
        if self._resumed is None:
            self._resumed = asyncio.Event()
        self._resumed.clear()
        try:
            await self._tm.pause_generation(PauseGenerationReqInput(mode="in_place"))
        except BaseException:
            self._in_place = False  # not paused: the caller's pause fails, nothing is held
            self._resumed.set()
            raise

    async def _continue(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        await self._tm.continue_generation(ContinueGenerationReqInput())
        self._in_place = False
        if self._resumed is not None:
            self._resumed.set()

    def _request(self, sample: _InFlight) -> Any:
        """Under ``_lock``: SGLang's request for the rest of ``sample``."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        request = sample.handle.request
        params = request.params
        sgl, use_filter = sample.entry.params, sample.entry.use_filter
        kwargs: dict[str, Any] = {"return_logprob": params.logprobs}
        if sample.tokens:
            prompt = sample.handle.prompt_token_ids
            if prompt is None:
                raise SGLangEngineError("cannot continue a sample whose prompt token ids SGLang never returned")
            rest = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - len(sample.tokens))
            sgl, use_filter = sampling_to_sglang(
                rest, deterministic=self._deterministic, sample=sample.index, drawn_seed=sample.entry.drawn_seed
            )
            kwargs["input_ids"] = [*prompt, *sample.tokens]
        elif request.prompt is not None:
            kwargs["text"] = request.prompt
        else:
            kwargs["input_ids"] = list(request.prompt_token_ids or ())
        if request.image is not None:
            kwargs["image_data"] = request.image
        if use_filter:
            kwargs["custom_logit_processor"] = self._processor
        if request.lora is not None:
            kwargs["lora_path"] = request.lora.handle  # the adapter bound at submission, also when resubmitted
        key = self._extra_key()
        if key is not None:
            kwargs["extra_key"] = key  # GenerateReqInput.extra_key: the radix cache's namespace
        ids = request_prompt_ids(kwargs, getattr(self._tm, "tokenizer", None))  # SGLang's flag, or ours (< 0.5.13)
        if ids is not None and sample.handle.prompt_token_ids is None:
            sample.handle.prompt_token_ids = tuple(ids[0])
        sample.rid = uuid.uuid4().hex
        sample.segments += 1
        sample.seen = 0
        sample.retold = False
        sample.submitted = True
        return GenerateReqInput(rid=sample.rid, stream=True, sampling_params=sgl, **kwargs)

    async def _segment(self, sample: _InFlight) -> None:
        """One SGLang request of ``sample``, from submission to its last chunk (on the loop's thread)."""
        try:
            if self._in_place and self._resumed is not None:
                await self._resumed.wait()  # admitted as the in-place pause began: it starts after the resume
            with self._lock:
                if sample.finished:
                    return
                if sample.want == "park":
                    sample.parked = True
                    return
                obj = self._request(sample)
            async for out in self._tm.generate_request(obj, None):
                with self._lock:
                    self._take(sample, out)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            with self._lock:
                self._failed(sample, exc)
        finally:
            sample.submitted = False

    def _failed(self, sample: _InFlight, exc: Exception) -> None:
        """Under ``_lock``: ``generate_request`` raised (SGLang refused the request, or it was aborted before
        it reached the scheduler: ``RequestAbortedError``, a ``ValueError``)."""
        if sample.finished:
            return
        if sample.want == "park":
            sample.parked = True
            return
        if type(exc).__name__ == "RequestAbortedError":  # a ValueError: SGLang aborted it before scheduling
            exc = SGLangEngineError(f"SGLang aborted the request before it was scheduled: {exc}")
        elif isinstance(exc, ValueError):
            exc = InvalidArgumentError(f"SGLang rejected the request: {exc}")
        sample.handle.fail(exc)
        for other in self._samples.get(id(sample.handle), ()):
            other.finished, other.want = True, "drop"
            self._tell_abort(other)

    def _take(self, sample: _InFlight, out: Mapping[str, Any]) -> None:
        """Under ``_lock``: one streamed chunk of ``sample``'s current SGLang request."""
        if sample.finished or sample.want == "drop":
            self._tell_again(sample)
            return
        handle, params = sample.handle, sample.handle.params
        if sample.segments == 1 and handle.prompt_token_ids is None and out.get("prompt_token_ids") is not None:
            handle.prompt_token_ids = tuple(int(t) for t in out["prompt_token_ids"])
        meta = out.get("meta_info") or {}
        reason = meta.get("finish_reason")
        if isinstance(reason, Mapping) and reason.get("type") == "abort":
            if sample.want == "park":
                sample.parked = True  # the tokens of this last chunk are not sent on (see the module docstring)
                return
            status = reason.get("status_code")
            message = reason.get("message") or "aborted"
            error: Exception = (
                InvalidArgumentError(f"SGLang rejected the request: {message}")
                if status == 400
                else SGLangEngineError(f"SGLang aborted the request: {message}")
            )
            self._failed(sample, error)
            return
        if sample.want == "park":
            self._tell_again(sample)
        ids, logprobs, sample.seen = stream_delta(out, sample.seen, logprobs=params.logprobs)
        if params.ignore_eos and params.stop_token_ids:
            # SGLang's ignore_eos disables stop_token_ids too (mapping.sampling_to_sglang): cut here, as the sync
            # path does (mapping._cut_at_stop_id).
            for k, token in enumerate(ids):
                if token in params.stop_token_ids:
                    self._emit(sample, ids[: k + 1], None if logprobs is None else logprobs[: k + 1])
                    text = self._decode(sample.tokens[:-1])
                    self._finish_here(sample, "stop", stop_reason=token, text=text)
                    return
        self._emit(sample, ids, logprobs)
        if reason is not None:
            finish, stop_reason = finish_from_sglang(reason, params)
            if sample.segments == 1 and not incremental_streaming(self._tm):  # cumulative chunks: the whole text
                text = out.get("text")  # the whole text, as the sync path gets it
            else:
                text = self._decode(sample.tokens)
                if text is not None and isinstance(stop_reason, str) and stop_reason in text:
                    text = text[: text.find(stop_reason)]  # as detokenizer_manager.py trim_matched_stop
            sample.finished = True
            handle.finish(sample.index, finish, stop_reason=stop_reason, text=text)

    def _emit(self, sample: _InFlight, ids: list[int], logprobs: list[float] | None) -> None:
        if ids:
            sample.tokens.extend(ids)
            sample.handle.emit(sample.index, ids, logprobs)

    def _decode(self, ids: list[int]) -> str | None:
        tokenizer = getattr(self._tm, "tokenizer", None)
        return None if tokenizer is None else str(tokenizer.decode(ids, skip_special_tokens=True))
