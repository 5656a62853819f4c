"""The sglang plugin's loop driver (``LoopThread``), which runs SGLang's event loop for sync and async callers:
plain loops, then a fake shaped like SGLang's tokenizer manager (tests/support/sglang_loop.py; it tests our
driver, not SGLang), on asyncio and uvloop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from support.sglang_loop import FakeTokenizerManager as _FakeTokenizerManager
from support.sglang_loop import no_loop_thread as _no_loop_thread
from support.sglang_loop import run_caller as _run_caller

from genengine.errors import GenEngineError
from genengine_sglang.errors import SGLangEngineError


def test_loop_driver_lends_the_loop_to_a_thread_while_tasks_run() -> None:
    """The driver on a plain asyncio loop (SGLang's is one): sync calls run in the caller's thread while no task
    is live, on the loop's thread while tasks are, and the tasks go on during them; the thread ends when idle."""
    import asyncio
    import threading

    from genengine_sglang._loop import LoopThread

    loop = asyncio.new_event_loop()
    driver = LoopThread(loop)
    try:

        async def where() -> threading.Thread:
            return threading.current_thread()

        assert driver.run(where()) is threading.current_thread()  # today's path
        release = asyncio.Event()
        ticks: list[int] = []

        async def task() -> None:
            while not release.is_set():
                ticks.append(1)
                await asyncio.sleep(0.001)

        driver.spawn(task())
        assert driver.live == 1
        thread = driver.run(where())
        assert thread is not threading.current_thread() and thread.name == "genengine-sglang-loop"

        async def slow() -> int:
            before = len(ticks)
            await asyncio.sleep(0.05)
            return len(ticks) - before

        assert driver.run(slow()) > 5  # the task ran during the job's run_until_complete
        with pytest.raises(ZeroDivisionError):
            driver.call(lambda: 1 // 0)  # a job's error reaches the caller
        loop.call_soon_threadsafe(release.set)
        assert driver.wait_idle(10)
        thread.join(10)
        assert not thread.is_alive()
        assert driver.run(where()) is threading.current_thread()  # the loop is the callers' again
        driver.spawn(task())  # and a thread takes it back for new tasks
        driver.close(10)
        with pytest.raises(GenEngineError, match="shut down"):
            driver.spawn(task())
    finally:
        loop.close()


def test_loop_driver_tasks_spawned_while_a_caller_runs_the_loop() -> None:
    """A task spawned from another thread while a caller runs the loop itself: it starts there, and a thread
    takes the loop over when that call ends."""
    import asyncio
    import threading

    from genengine_sglang._loop import LoopThread

    loop = asyncio.new_event_loop()
    driver = LoopThread(loop)
    done = threading.Event()
    try:

        async def task() -> None:
            await asyncio.sleep(0.05)
            done.set()

        async def caller() -> None:
            threading.Thread(target=driver.spawn, args=(task(),)).start()
            await asyncio.sleep(0.01)

        driver.run(caller())
        assert done.wait(10)
        assert driver.wait_idle(10)
    finally:
        driver.close(10)
        loop.close()


def test_loop_driver_sync_calls_from_inside_a_coroutine(sgl_loop: tuple[str, Any]) -> None:
    """A sync SGLang call made from inside a trainer's coroutine with no stream live (``load_weights`` between
    pause and resume) runs on the driver's thread: on the caller's, SGLang's loop cannot run (``Cannot run the
    event loop while another loop is running``, and uvloop left the call behind as a task on SGLang's loop: the
    GPU hang of issue 17). Nothing is left on the loop, the thread ends after the call, and a later call from
    a plain thread runs there again."""
    from genengine_sglang._loop import LoopThread

    kind, loop = sgl_loop
    driver = LoopThread(loop)
    tm = _FakeTokenizerManager(loop)
    try:
        assert driver.call(lambda: tm.generate_sync("first", 3)) == ["0", "1", "2", "end"]  # the receive task starts
        here = threading.current_thread()

        async def where() -> threading.Thread:
            return threading.current_thread()

        async def trainer() -> tuple[threading.Thread, list[str]]:
            thread = driver.run(where())
            return thread, driver.call(lambda: tm.generate_sync("inside", 4), "the test's generate")

        thread, got = _run_caller(kind, trainer())
        assert thread is not here and thread.name == "genengine-sglang-loop"
        assert got == ["0", "1", "2", "3", "end"]
        assert _no_loop_thread()
        assert [t for t in asyncio.all_tasks(loop) if t is not tm.handle_task] == []  # nothing left behind
        assert driver.run(where()) is here and tm.handle_loops == 1
    finally:
        driver.close(5)
        tm.close()


def test_loop_driver_streams_with_a_lazily_started_receive_task(sgl_loop: tuple[str, Any]) -> None:
    """The receive task starts on SGLang's loop while our thread runs it (a stream is the first request), and
    serves every later runner of the loop: sync calls from a coroutine and from a plain thread while streams
    run, aborts told through ``soon`` from another thread, a spawn and a ``soon`` from the loop's own thread,
    and, once the thread has gone, a sync call in the caller's thread (outputs that arrived while nobody ran
    the loop waited in the socket)."""
    from genengine_sglang._loop import LoopThread

    kind, loop = sgl_loop
    driver = LoopThread(loop)
    tm = _FakeTokenizerManager(loop)
    sinks: dict[str, list[str]] = {f"s{i}": [] for i in range(40)}
    follow_up: list[str] = []
    told: list[threading.Thread] = []

    async def pump(rid: str, n: int, sink: list[str]) -> None:
        async for item in tm.generate_request(rid, n):
            sink.append(item)
        if rid == "s1":  # from the loop's own thread
            driver.spawn(pump("follow-up", 2, follow_up))
            driver.soon(lambda: told.append(threading.current_thread()))

    try:
        for rid, sink in sinks.items():
            driver.spawn(pump(rid, 30, sink))

        async def trainer() -> list[str]:
            while not sinks["s0"]:
                await asyncio.sleep(0.001)
            return driver.call(lambda: tm.generate_sync("from-coroutine", 5))

        assert _run_caller(kind, trainer()) == ["0", "1", "2", "3", "4", "end"]
        got: list[Any] = []
        plain = threading.Thread(target=lambda: got.append(driver.call(lambda: tm.generate_sync("from-thread", 2))))
        plain.start()
        plain.join(10)
        assert got == [["0", "1", "end"]]
        aborted = {f"s{i}" for i in range(0, 40, 4)}
        for rid in aborted:
            driver.soon(lambda rid=rid: tm.abort_request(rid))
        assert driver.wait_idle(10), driver.describe()
        for rid, sink in sinks.items():
            if rid in aborted and sink[-1] == "abort":
                assert sink[:-1] == [str(k) for k in range(len(sink) - 1)], rid
            else:
                assert sink == [*map(str, range(30)), "end"], rid
        assert sum(sinks[rid][-1] == "abort" for rid in aborted) >= 1
        assert follow_up == ["0", "1", "end"] and [t.name for t in told] == ["genengine-sglang-loop"]
        assert _no_loop_thread()
        tm.emit("gone", "7")  # a late output while nobody runs the loop
        assert driver.call(lambda: tm.generate_sync("after", 3)) == ["0", "1", "2", "end"]
        assert tm.handle_loops == 1  # one receive task throughout, whoever ran the loop
    finally:
        driver.close(5)
        tm.close()


def test_loop_driver_waits_are_bounded(sgl_loop: tuple[str, Any]) -> None:
    """``wait_idle`` returns False at its bound; a call the thread does not take (a callback blocks the loop)
    fails after ``pickup_timeout_s`` naming the call and where the loop is stuck, and never runs later; a call
    that does not return fails after ``call_timeout_s``; a sync call from a task on the loop itself fails
    at once."""
    from genengine_sglang._loop import LoopThread

    _kind, loop = sgl_loop
    driver = LoopThread(loop, pickup_timeout_s=0.3, call_timeout_s=0.5)
    release, gate, slow = threading.Event(), threading.Event(), threading.Event()
    ran: list[str] = []
    errors: list[BaseException] = []

    async def held() -> None:
        while not release.is_set():
            await asyncio.sleep(0.005)

    def blocking_callback() -> None:
        gate.wait(10)

    async def calls_sync_from_the_loop() -> None:
        try:
            driver.call(lambda: None, "a call from a task")
        except SGLangEngineError as exc:
            errors.append(exc)

    try:
        driver.spawn(held())
        start = time.monotonic()
        assert driver.wait_idle(0.2) is False and time.monotonic() - start < 2
        driver.spawn(calls_sync_from_the_loop())
        driver.soon(blocking_callback)
        with pytest.raises(
            SGLangEngineError,
            match=r"(?s)the test's call: .* did not take the call within 0\.3 s.*"
            r"blocking_callback",
        ):
            driver.call(lambda: ran.append("late"), "the test's call")
        gate.set()
        assert driver.call(lambda: 7) == 7 and ran == []  # recovered; the refused call never ran
        with pytest.raises(SGLangEngineError, match=r"the test's slow call did not return within 0\.5 s"):
            driver.call(lambda: slow.wait(10), "the test's slow call")
        slow.set()
        assert len(errors) == 1 and "SGLang's own event loop" in str(errors[0])
        release.set()
        assert driver.wait_idle(10), driver.describe()
    finally:
        gate.set()
        slow.set()
        release.set()
        driver.close(5)
