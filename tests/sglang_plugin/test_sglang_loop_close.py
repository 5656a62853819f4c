"""The sglang plugin's loop driver (``LoopThread``) when things end: close with tasks pending or a caller on the
loop, bounded waits behind a stuck call, and async requests when SGLang's processes die (fakes from
tests/support/sglang_loop.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from typing import Any

import pytest
from support.sglang_loop import no_loop_thread as _no_loop_thread

from genengine.errors import GenEngineError
from genengine.requests import normalize_requests
from genengine_sglang.errors import SGLangEngineError
from genengine_sglang.mapping import build_entries


def test_loop_driver_close_with_tasks_pending(sgl_loop: tuple[str, Any]) -> None:
    """``close`` cancels live tasks and stops the thread; one that ignores its cancellation is reported (left
    behind) within the bound; spawns after it are refused."""
    from genengine_sglang._loop import LoopThread

    _kind, loop = sgl_loop
    seen: list[str] = []
    stubborn = threading.Event()

    started = threading.Semaphore(0)

    async def cancellable() -> None:
        started.release()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def ignores_cancel() -> None:
        started.release()
        while not stubborn.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                seen.append("ignored")

    driver = LoopThread(loop)
    driver.spawn(cancellable())
    driver.spawn(cancellable())
    assert started.acquire(timeout=5) and started.acquire(timeout=5)
    driver.close(5)
    assert seen == ["cancelled", "cancelled"] and driver.live == 0 and _no_loop_thread()
    with pytest.raises(GenEngineError, match="shut down"):
        driver.spawn(cancellable())

    other = LoopThread(loop)
    other.spawn(ignores_cancel())
    assert started.acquire(timeout=5)
    start = time.monotonic()
    with pytest.raises(SGLangEngineError, match=r"1 task\(s\) on SGLang's event loop did not end within 0\.3 s"):
        other.close(0.6)
    assert time.monotonic() - start < 3 and "ignored" in seen
    stubborn.set()
    loop.run_until_complete(asyncio.sleep(0.05))  # the stubborn task ends once the loop runs again


def test_loop_driver_asks_run_forever_to_stop_once() -> None:
    """uvloop's ``stop()`` queues a handle (it is not a flag, as in asyncio): a second stop asked in the pass
    that ends ``run_forever`` would stay queued and end the next job's ``run_until_complete`` after one pass
    ("Event loop stopped before Future completed"). A job queued behind such a pass runs to its end."""
    from genengine_sglang._loop import LoopThread, _Job

    uvloop = pytest.importorskip("uvloop")
    loop = uvloop.new_event_loop()
    driver = LoopThread(loop)
    release = threading.Event()

    async def held() -> None:
        while not release.is_set():
            await asyncio.sleep(0.005)

    async def slow() -> str:
        await asyncio.sleep(0.05)
        return "done"

    job = _Job(lambda: loop.run_until_complete(slow()), "the test's job")

    def two_stops() -> None:  # the second one in the pass where the first stop takes effect
        with driver._changed:
            driver._jobs.append(job)
        driver._maybe_stop()
        loop.call_soon(driver._maybe_stop)

    try:
        driver.spawn(held())
        driver.soon(two_stops)
        assert job.done.wait(10)
        assert job.error is None and job.value == "done", job.error
    finally:
        release.set()
        driver.close(5)
        loop.close()


def test_loop_driver_call_queued_behind_a_stuck_call_is_bounded(sgl_loop: tuple[str, Any]) -> None:
    """A call waiting behind another call that does not return fails at its own ``call_timeout_s``, naming
    the call before it, instead of waiting as long as that one; it never runs later."""
    from genengine_sglang._loop import LoopThread

    _kind, loop = sgl_loop
    driver = LoopThread(loop, pickup_timeout_s=0.2, call_timeout_s=0.6)
    release, stuck = threading.Event(), threading.Event()
    ran: list[str] = []

    async def held() -> None:
        while not release.is_set():
            await asyncio.sleep(0.005)

    def first() -> None:
        with contextlib.suppress(SGLangEngineError):
            driver.call(lambda: (stuck.set(), release.wait(10)), "the stuck call")

    try:
        driver.spawn(held())
        other = threading.Thread(target=first)
        other.start()
        assert stuck.wait(5)
        start = time.monotonic()
        with pytest.raises(SGLangEngineError, match=r"the second call: not started within 0\.6 s.*the stuck call"):
            driver.call(lambda: ran.append("late"), "the second call")
        assert time.monotonic() - start < 3
        release.set()
        other.join(5)
        assert driver.call(lambda: 7) == 7 and ran == []
    finally:
        release.set()
        driver.close(5)


def test_loop_driver_close_while_a_caller_runs_the_loop(sgl_loop: tuple[str, Any]) -> None:
    """Shutdown while a caller runs SGLang's loop in its own sync call, with a task spawned meanwhile: the
    close waits for that call, then cancels the task; nothing is left live."""
    from genengine_sglang._loop import LoopThread

    _kind, loop = sgl_loop
    driver = LoopThread(loop)
    inside, seen = threading.Event(), []

    async def cancellable() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def busy() -> None:
        inside.set()
        await asyncio.sleep(0.4)

    caller = threading.Thread(target=lambda: driver.run(busy(), "the caller's call"))
    caller.start()
    assert inside.wait(5)
    driver.spawn(cancellable())  # spawned while the caller runs the loop: no thread of ours yet
    driver.close(5)
    caller.join(5)
    assert seen == ["cancelled"] and driver.live == 0 and _no_loop_thread()


class _SilentTokenizerManager:
    """SGLang's tokenizer manager after its scheduler died: requests are taken and never answered."""

    incremental_streaming_output = False

    def __init__(self) -> None:
        self.rid_to_state: dict[str, Any] = {}

    async def generate_request(self, obj: Any, request: Any) -> Any:
        self.rid_to_state[obj.rid] = obj
        await asyncio.Event().wait()
        yield {}

    def abort_request(self, rid: str) -> None:
        self.rid_to_state.pop(rid, None)


def test_async_requests_fail_when_sglang_processes_die(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang reports a dead scheduler by SIGQUIT, which uvloop drops while our thread runs the loop: the
    async layer checks SGLang's processes itself, and every stream in flight raises, naming the dead process,
    within about one check interval; the loop's thread ends. (SGLang's ``GenerateReqInput`` is a stand-in
    here: this tests our watch, not SGLang.)"""
    import types

    from genengine.engine.aio import AsyncRequest
    from genengine_sglang._async import AsyncDriver
    from genengine_sglang._loop import LoopThread

    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    io_struct.GenerateReqInput = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)

    sgl_loop, caller_loop = asyncio.new_event_loop(), asyncio.new_event_loop()
    driver = LoopThread(sgl_loop)
    tm = _SilentTokenizerManager()
    died = threading.Event()
    aio = AsyncDriver(
        driver,
        tm,
        deterministic=False,
        processor=None,
        extra_key=lambda: None,
        timeout_s=30,
        dead=lambda: "SGLang's scheduler (pid 4242, exit code -9) died" if died.is_set() else None,
        watch_interval_s=0.05,
    )
    requests = normalize_requests(None, {"temperature": 0, "max_new_tokens": 8}, prompt_token_ids=[[1, 2, 3]])
    entries = build_entries(requests, deterministic=False, has_tokenizer=True)
    handle = AsyncRequest("r0", requests[0], 0, caller_loop)
    try:
        aio.start(handle, entries)
        time.sleep(0.3)
        assert not handle.done and len(tm.rid_to_state) == 1  # alive: it waits, as a slow request would
        died.set()
        start = time.monotonic()
        deadline = start + 5
        while not handle.done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handle.done and time.monotonic() - start < 2
        assert isinstance(handle.error, SGLangEngineError)
        assert "scheduler (pid 4242, exit code -9) died" in str(handle.error)
        assert _no_loop_thread() and driver.live == 0
    finally:
        driver.close(5)
        sgl_loop.close()
        caller_loop.close()
