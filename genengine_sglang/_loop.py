"""``LoopThread``: SGLang 0.5.17's event loop, lent to a thread of ours while async requests are live.

SGLang's ``sgl.Engine`` keeps its ``TokenizerManager`` in this process on one asyncio loop (``engine.loop``)
that runs only while a caller runs it: every sync ``Engine`` method is ``loop.run_until_complete(...)``.
Streamed requests need the loop to keep running between our calls, so :class:`LoopThread` lends it to a thread
while any async request is live and gives it back when none is (the sync path is then exactly what it was).
Sync calls made meanwhile are handed to that thread as jobs: it leaves ``run_forever``, runs the job (whose
``run_until_complete`` keeps the streams going) and goes back. One thread owns the loop at any time, so
SGLang's zmq sockets are never used from two threads. The async requests themselves are
:class:`genengine_sglang._async.AsyncDriver`'s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from genengine.errors import EngineClosedError
from genengine_sglang.errors import SGLangEngineError

__all__ = ["PICKUP_TIMEOUT_S", "THREAD_STOP_TIMEOUT_S", "LoopThread"]

T = TypeVar("T")


PICKUP_TIMEOUT_S = 30.0
"""How long the loop's thread may take to take a call handed to it: it only has to leave ``run_forever`` (one
loop iteration), so a call not taken by then means a callback on the loop blocks it (the error shows where)."""
THREAD_STOP_TIMEOUT_S = 10.0
"""How long the loop's thread may take to stop at shutdown, once its tasks are cancelled."""


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


class LoopThread:
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
