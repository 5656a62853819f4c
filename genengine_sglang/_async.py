"""The async capability on SGLang 0.5.17, through SGLang's own calls.

SGLang's ``sgl.Engine`` keeps its ``TokenizerManager`` in this process on one asyncio loop (``engine.loop``)
that runs only while a caller runs it: every sync ``Engine`` method is ``loop.run_until_complete(...)``.
Streamed requests need the loop to keep running between our calls, so :class:`LoopDriver` lends it to a thread
while any async request is live and gives it back when none is (the sync path is then exactly what it was).
Sync calls made meanwhile are handed to that thread as jobs: it leaves ``run_forever``, runs the job (whose
``run_until_complete`` keeps the streams going) and goes back. One thread owns the loop at any time, so
SGLang's zmq sockets are never used from two threads. :class:`AsyncSGLang` maps the async hooks onto SGLang's
calls (docs/async.md, "SGLang"); the SGLang source lines they rely on are listed in docs/upstream.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from genengine.backend import EngineClosedError, EngineStateError, InvalidArgumentError
from genengine_sglang.errors import SGLangEngineError
from genengine_sglang.mapping import SglEntry, finish_from_sglang, sampling_to_sglang, stream_delta

if TYPE_CHECKING:
    from genengine.backend import AsyncRequest

__all__ = [
    "ABORT_ANSWER_TIMEOUT_S",
    "PICKUP_TIMEOUT_S",
    "THREAD_STOP_TIMEOUT_S",
    "AsyncSGLang",
    "LoopDriver",
]

T = TypeVar("T")


PICKUP_TIMEOUT_S = 30.0
"""How long the loop's thread may take to take a call handed to it: it only has to leave ``run_forever`` (one
loop iteration), so a call not taken by then means a callback on the loop blocks it (the error shows where)."""
ABORT_ANSWER_TIMEOUT_S = 30.0
"""How long SGLang may take to end the requests we aborted (its scheduler answers at its next step)."""
THREAD_STOP_TIMEOUT_S = 10.0
"""How long the loop's thread may take to stop at shutdown, once its tasks are cancelled."""
WATCH_INTERVAL_S = 1.0
"""How often, while async requests live, SGLang's processes are checked. SGLang's own watchdog reports a dead
scheduler with SIGQUIT to a handler on its loop (``SubprocessWatchdog``, ``TokenizerManager.auto_create_handle_loop``),
and uvloop delivers signals only while the main thread runs the loop: with our thread running it, a
crash would leave every stream waiting forever."""


def _loop_running_here() -> bool:
    """Whether this thread is running an event loop (a caller inside a coroutine): SGLang's loop cannot run
    here then (``Cannot run the event loop while another loop is running``; uvloop also leaves the call's
    coroutine behind as a task on SGLang's loop, which would run at some later call)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _stack_of(thread: threading.Thread | None) -> str:
    """The innermost frames of ``thread``, for an error that says where it is stuck."""
    frame = None if thread is None or thread.ident is None else sys._current_frames().get(thread.ident)
    if frame is None:
        return "(no stack: the thread is not running)"
    return "".join(traceback.format_stack(frame)[-6:]).rstrip()


class _Job:
    def __init__(self, fn: Callable[[], Any], what: str) -> None:
        self.fn = fn
        self.what = what
        self.started = threading.Event()
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        self.started.set()
        try:
            self.value = self.fn()
        except BaseException as exc:  # handed to the caller's thread
            self.error = exc
        finally:
            self.done.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.started.set()
        self.done.set()


class LoopDriver:
    """SGLang's event loop: run by a thread of ours while tasks are live (or a caller inside a coroutine needs
    it), by the callers otherwise.

    Invariant: at most one thread runs the loop, the thread of ours (``_thread``) or one caller (``_borrower``);
    while tasks are live one of them does. Every wait here is bounded: the thread must take a call within
    ``pickup_timeout_s``, a call must return within ``call_timeout_s`` (None: as long as it takes, as SGLang's
    own sync calls), and a wait for the tasks to end takes its caller's bound.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        pickup_timeout_s: float = PICKUP_TIMEOUT_S,
        call_timeout_s: float | None = None,
    ) -> None:
        self.loop = loop
        self.pickup_timeout_s = pickup_timeout_s
        self.call_timeout_s = call_timeout_s
        self._mutex = threading.Lock()
        self._changed = threading.Condition(self._mutex)
        self._thread: threading.Thread | None = None
        self._borrower: threading.Thread | None = None  # a caller that runs the loop itself (no thread then)
        self._jobs: collections.deque[_Job] = collections.deque()
        self._running: _Job | None = None  # the job the thread runs now
        self._tasks: set[asyncio.Task[None]] = set()
        self._live = 0
        self._forever = False  # the thread is in run_forever (not in a job)
        self._stop_asked = False  # this run_forever was asked to stop (see _maybe_stop)
        self._closing = False
        self._given_up = False  # at shutdown: the tasks did not end in time after their cancellation
        self._died: BaseException | None = None  # why the last thread ended abnormally

    # ---- what callers use ------------------------------------------------------------------------------------
    def call(self, fn: Callable[[], T], what: str = "an SGLang call") -> T:
        """Run ``fn`` (a sync SGLang call: it may ``run_until_complete`` on the loop) with the loop to itself: in
        this thread when nothing else runs the loop and this thread runs no loop of its own, else on ours."""
        me = threading.current_thread()
        if me is self._thread or me is self._borrower:
            if _loop_running_here():
                raise SGLangEngineError(
                    f"{what} was called from a task or callback on SGLang's own event loop: it would have to run "
                    "the loop it is running on (make the call from another thread)"
                )
            return fn()  # inside a job, or inside the caller's own call, already
        delegate = _loop_running_here()
        deadline = None if self.call_timeout_s is None else time.monotonic() + self.call_timeout_s
        with self._changed:
            while self._borrower is not None and self._thread is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise SGLangEngineError(
                        f"{what}: another thread ({self._borrower.name}) has run SGLang's event loop for more than "
                        f"{self.call_timeout_s:g} s in its own call, which has not returned"
                    )
                self._changed.wait(left)
            if self._thread is None and not delegate:
                self._borrower = me
                job = None
            else:
                job = _Job(fn, what)
                self._jobs.append(job)
                if self._thread is None:
                    self._start()
        if job is None:
            try:
                return fn()  # today's sync path, in the caller's thread
            finally:
                with self._changed:
                    self._borrower = None
                    late = self._closing and self._live and self._thread is None
                    if self._live and self._thread is None:
                        self._start()  # tasks were spawned meanwhile: someone must run the loop now
                    self._changed.notify_all()
                if late:  # close() waits for (or gave up on) this call: cancel here too (twice is harmless)
                    self.loop.call_soon_threadsafe(self._cancel_all, THREAD_STOP_TIMEOUT_S / 2)
        self._wake()
        self._await(job, deadline)
        if job.error is not None:
            raise job.error
        return job.value  # type: ignore[no-any-return]

    def run(self, coro: Coroutine[Any, Any, T], what: str | None = None) -> T:
        """Run one SGLang coroutine to its end (as ``call``)."""
        taken = False

        def job() -> T:
            nonlocal taken
            taken = True
            return self.loop.run_until_complete(coro)

        try:
            return self.call(job, what or f"SGLang's {getattr(coro, '__qualname__', 'call')}")
        finally:
            if not taken:
                coro.close()  # never run (the call was refused): no "never awaited" warning, no task left behind

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Start ``coro`` as a task on the loop; the thread runs the loop until every task has ended."""
        with self._changed:
            if self._closing:
                coro.close()
                raise EngineClosedError("the engine was shut down")
            self._live += 1
            if self._thread is None and self._borrower is None:
                self._start()
        self.loop.call_soon_threadsafe(self._create_task, coro)

    def cancel_tasks(self) -> None:
        """On the loop's thread: cancel every live task (their samples were ended by the caller)."""
        for task in list(self._tasks):
            task.cancel()

    def soon(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` on the loop's thread soon, or drop it when no task is live (nothing of ours runs in
        SGLang then, so there is nothing to tell it)."""
        with self._mutex:
            if self._live:
                self.loop.call_soon_threadsafe(fn)

    @property
    def live(self) -> int:
        return self._live

    def wait_idle(self, timeout_s: float) -> bool:
        """Until every task has ended (False after ``timeout_s``). Not from the loop's thread nor from inside
        ``call``: this thread would be the one that has to run the loop."""
        me = threading.current_thread()
        if me is self._thread or me is self._borrower:
            raise SGLangEngineError(
                "internal error: waiting for SGLang's requests to end from the thread that runs its event loop"
            )
        with self._changed:
            if self._live and self._thread is None and self._borrower is None:
                self._start()  # nobody runs the loop (a thread that died): the tasks need one
            return self._changed.wait_for(lambda: self._live == 0, timeout_s)

    def describe(self) -> str:
        """Who runs the loop now, for errors."""
        thread, borrower, running = self._thread, self._borrower, self._running
        if thread is not None:
            where = f"our thread {thread.name!r}" + (
                f" in the call {running.what!r}" if running is not None else " in run_forever" if self._forever else ""
            )
        elif borrower is not None:
            where = f"the caller thread {borrower.name!r}"
        else:
            where = "nobody"
        died = f"; the last loop thread died: {self._died!r}" if self._died is not None else ""
        return f"{self._live} task(s) live, the loop run by {where}{died}"

    def close(self, timeout_s: float = THREAD_STOP_TIMEOUT_S) -> None:
        """Stop the thread (tasks still live are cancelled); later spawns raise ``EngineClosedError``. Raises
        ``SGLangEngineError`` when the thread has not stopped within ``timeout_s``, or stopped leaving tasks
        that did not end within half of it after their cancellation."""
        with self._changed:
            self._closing = True
            # A caller running the loop in its own sync call: its call ends first (bounded), then the tasks
            # still live are cancelled on our thread.
            if self._borrower is not threading.current_thread():
                self._changed.wait_for(lambda: self._borrower is None, timeout_s / 2)
            if self._live and self._thread is None and self._borrower is None:
                self._start()  # the cancellation needs someone to run the loop
            thread = self._thread
        if thread is None:
            return
        self.loop.call_soon_threadsafe(self._cancel_all, timeout_s / 2)
        thread.join(timeout_s)
        if thread.is_alive():
            raise SGLangEngineError(
                f"SGLang's event loop thread did not stop within {timeout_s:g} s of shutdown ({self.describe()}); "
                f"it is at:\n{_stack_of(thread)}"
            )
        if self._live:
            raise SGLangEngineError(
                f"{self._live} task(s) on SGLang's event loop did not end within {timeout_s / 2:g} s of their "
                "cancellation at shutdown: left behind"
            )

    # ---- the callers' side of a job --------------------------------------------------------------------------
    def _wake(self) -> None:
        """Ask the thread to leave run_forever for the jobs (a no-op while it runs one: it takes them after)."""
        with contextlib.suppress(RuntimeError):  # a closed loop: the thread is gone, _await says so
            self.loop.call_soon_threadsafe(self._maybe_stop)

    def _await(self, job: _Job, deadline: float | None) -> None:
        while not job.started.wait(self.pickup_timeout_s):
            with self._changed:
                if job.started.is_set():
                    break
                thread, running = self._thread, self._running
                behind = running is not None and thread is not None and thread.is_alive()
                if behind and (deadline is None or time.monotonic() < deadline):
                    continue  # another call has the loop; ours comes next
                if job in self._jobs:
                    self._jobs.remove(job)
                state = self.describe()
            if behind:
                raise SGLangEngineError(
                    f"{job.what}: not started within {self.call_timeout_s:g} s: SGLang's event loop thread is still "
                    f"in the call before it ({state}), at:\n{_stack_of(thread)}"
                )
            raise SGLangEngineError(
                f"{job.what}: SGLang's event loop thread did not take the call within {self.pickup_timeout_s:g} s "
                f"({state}); a callback on the loop blocks it, at:\n{_stack_of(thread)}"
            )
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not job.done.wait(left):
            raise SGLangEngineError(
                f"{job.what} did not return within {self.call_timeout_s:g} s on SGLang's event loop thread "
                f"({self.describe()}), at:\n{_stack_of(self._thread)}"
            )

    # ---- the loop's thread -----------------------------------------------------------------------------------
    def _start(self) -> None:
        """Under ``_mutex``: a thread of ours runs the loop from now on."""
        self._thread = threading.Thread(target=self._run, daemon=True, name="genengine-sglang-loop")
        self._thread.start()

    def _run(self) -> None:
        me = threading.current_thread()
        asyncio.set_event_loop(self.loop)
        try:
            while True:
                with self._changed:
                    if self._jobs:
                        job: _Job | None = self._jobs.popleft()
                        self._running = job
                    elif self._live == 0 or self._given_up:
                        self._thread = None  # the callers run the loop again from here on
                        self._changed.notify_all()
                        return
                    else:
                        job = None
                        self._forever, self._stop_asked = True, False
                if job is not None:
                    try:
                        job.run()
                    finally:
                        with self._mutex:
                            self._running = None
                    continue
                try:
                    self.loop.run_forever()
                finally:
                    self._forever = False
        except BaseException as exc:  # run_forever itself failed: nobody may wait on this thread any more
            with self._changed:
                self._died = exc
                if self._thread is me:
                    self._thread = None
                    self._running = None
                    jobs, self._jobs = list(self._jobs), collections.deque()
                    for job in jobs:
                        job.fail(SGLangEngineError(f"{job.what}: SGLang's event loop thread died: {exc!r}"))
                self._changed.notify_all()
            raise

    def _maybe_stop(self) -> None:
        # Only the thread's run_forever may be stopped: a stop inside a job's (or a caller's)
        # run_until_complete would end that call with "Event loop stopped before Future completed".
        # And only once: uvloop's stop() queues a handle, so a second stop asked in the pass
        # that ends run_forever would stay queued and end the next run_until_complete after one pass.
        if self._forever and not self._stop_asked:
            self._stop_asked = True
            self.loop.stop()

    def _create_task(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            task = self.loop.create_task(coro)
        except BaseException:
            coro.close()
            self._ended()
            raise
        self._tasks.add(task)
        task.add_done_callback(self._task_done)  # also for a task cancelled before it started

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._ended()

    def _ended(self) -> None:
        with self._changed:
            self._live -= 1
            idle = self._live == 0
            self._changed.notify_all()
        if idle:
            self._maybe_stop()

    def _cancel_all(self, give_up_s: float) -> None:
        # The last task to end stops the loop (_task_done); a task that does not end in time is left behind.
        for task in list(self._tasks):
            task.cancel()
        if not self._tasks:
            self._maybe_stop()
        else:
            self.loop.call_later(give_up_s, self._give_up)

    def _give_up(self) -> None:
        with self._mutex:
            self._given_up = True
        self._maybe_stop()


@dataclasses.dataclass(eq=False)
class _Sample:
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


class AsyncSGLang:
    """The hooks of :class:`genengine.aio.AsyncEngineBase` on one ``sgl.Engine``; lives on the TP leader only.

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
        driver: LoopDriver,
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
        self._driver = driver
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
        self._samples: dict[int, list[_Sample]] = {}  # id(handle) → its samples
        self._in_place = False
        self._resumed: asyncio.Event | None = None  # made and used on the loop's thread

    # ---- the hooks ---------------------------------------------------------------------------------------------
    def start(self, handle: AsyncRequest, entries: list[SglEntry]) -> None:
        samples = [_Sample(handle, e.sample, e) for e in entries]
        with self._lock:
            self._forget_done()
            self._samples[id(handle)] = samples
        for sample in samples:
            self._driver.spawn(self._segment(sample))
        if self._dead is not None:
            self._driver.soon(self._arm)

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
        elif self._driver.live:
            self._driver.run(self._pause_in_place(), "SGLang's pause_generation(mode='in_place')")

    def release(self) -> None:
        if self._in_place:
            self._driver.run(self._continue(), "SGLang's continue_generation")
        with self._lock:
            parked = [s for group in self._samples.values() for s in group if s.parked and not s.finished]
            for sample in parked:
                sample.parked = False
                sample.want = None
        for sample in parked:
            self._driver.spawn(self._segment(sample))

    # ---- what the engine asks before SGLang calls that need it idle ------------------------------------------
    def keeps_kv(self) -> bool:
        """Requests are held in SGLang with their KV (an in-place pause): its cache cannot be flushed now."""
        return self._in_place and self._unfinished()

    def quiesce(self, what: str) -> None:
        """Make SGLang idle before ``what``: the requests left in it were finished here and are only being
        stopped (an in-place pause would keep them there: SGLang is let go on, it has nothing else to run)."""
        if self._in_place and not self._unfinished():
            self._driver.run(self._continue(), "SGLang's continue_generation")
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
        self._driver.close()

    # ---- internals -----------------------------------------------------------------------------------------------
    def _arm(self) -> None:
        """On the loop's thread: check SGLang's processes in ``watch_interval_s`` (a timer, not a task: it does
        not keep the loop's thread alive)."""
        if not self._watching:
            self._watching = True
            self._driver.loop.call_later(self._watch_interval_s, self._watch)

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
        self._driver.cancel_tasks()  # their generate_request would never end

    def _wait_idle(self, what: str) -> None:
        """Until SGLang has ended every request of ours (they were aborted: its scheduler answers at its next
        step), bounded by ``answer_timeout_s``; the error names the requests it did not end."""
        if self._driver.wait_idle(self._answer_timeout_s):
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
            f"{self._in_place}; {self._driver.describe()}"
        )

    def _forget_done(self) -> None:
        for key in [k for k, group in self._samples.items() if all(s.finished for s in group)]:
            del self._samples[key]

    def _finish_here(self, sample: _Sample, reason: str, **kwargs: Any) -> None:
        """Under ``_lock``: end ``sample`` with what it has; SGLang's later answers for it are dropped."""
        if sample.finished:
            return
        sample.finished = True
        sample.want = "drop"
        sample.handle.finish(sample.index, reason, **kwargs)  # type: ignore[arg-type]
        self._tell_abort(sample)

    def _tell_abort(self, sample: _Sample) -> None:
        rid = sample.rid
        if sample.submitted and rid is not None:
            self._driver.soon(lambda: self._tm.abort_request(rid))

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

    def _request(self, sample: _Sample) -> Any:
        """Under ``_lock``: SGLang's request for the rest of ``sample``."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        request = sample.handle.request
        params = request.params
        sgl, use_filter = sample.entry.params, sample.entry.use_filter
        kwargs: dict[str, Any] = {"return_logprob": params.logprobs, "return_prompt_token_ids": True}
        if sample.tokens:
            prompt = sample.handle.prompt_token_ids
            if prompt is None:
                raise SGLangEngineError("cannot continue a sample whose prompt token ids SGLang never returned")
            rest = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - len(sample.tokens))
            sgl, use_filter = sampling_to_sglang(rest, deterministic=self._deterministic, sample=sample.index)
            kwargs["input_ids"] = [*prompt, *sample.tokens]
        elif request.prompt is not None:
            kwargs["text"] = request.prompt
        else:
            kwargs["input_ids"] = list(request.prompt_token_ids or ())
        if request.image is not None:
            kwargs["image_data"] = request.image
        if use_filter:
            kwargs["custom_logit_processor"] = self._processor
        key = self._extra_key()
        if key is not None:
            kwargs["extra_key"] = key  # GenerateReqInput.extra_key: the radix cache's namespace
        sample.rid = uuid.uuid4().hex
        sample.segments += 1
        sample.seen = 0
        sample.submitted = True
        return GenerateReqInput(rid=sample.rid, stream=True, sampling_params=sgl, **kwargs)

    async def _segment(self, sample: _Sample) -> None:
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

    def _failed(self, sample: _Sample, exc: Exception) -> None:
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

    def _take(self, sample: _Sample, out: Mapping[str, Any]) -> None:
        """Under ``_lock``: one streamed chunk of ``sample``'s current SGLang request."""
        if sample.finished or sample.want == "drop":
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
            if sample.segments == 1 and not self._tm.incremental_streaming_output:  # cumulative chunks: the whole text
                text = out.get("text")  # the whole text, as the sync path gets it
            else:
                text = self._decode(sample.tokens)
                if text is not None and isinstance(stop_reason, str) and stop_reason in text:
                    text = text[: text.find(stop_reason)]  # as detokenizer_manager.py trim_matched_stop
            sample.finished = True
            handle.finish(sample.index, finish, stop_reason=stop_reason, text=text)

    def _emit(self, sample: _Sample, ids: list[int], logprobs: list[float] | None) -> None:
        if ids:
            sample.tokens.extend(ids)
            sample.handle.emit(sample.index, ids, logprobs)

    def _decode(self, ids: list[int]) -> str | None:
        tokenizer = getattr(self._tm, "tokenizer", None)
        return None if tokenizer is None else str(tokenizer.decode(ids, skip_special_tokens=True))
