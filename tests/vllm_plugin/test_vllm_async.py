"""The vllm plugin's async driver (no vLLM needed): the engine declares async, its lock lets callers in between
driver steps, and the driver's bookkeeping against a fake shaped like vLLM 0.26's in-process LLMEngine.
"""

from __future__ import annotations

import asyncio
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest
from support.vllm_fakes import HAS_VLLM
from support.vllm_fakes import completion as _completion

from genengine.errors import (
    EngineStateError,
    InvalidArgumentError,
)
from genengine_vllm.engine import VLLMEngine


def test_engine_declares_async_and_refuses_it_on_tp_groups() -> None:
    from genengine.engine.aio import AsyncEngineBase

    assert VLLMEngine.supports_async and issubclass(VLLMEngine, AsyncEngineBase)
    engine = VLLMEngine.__new__(VLLMEngine)  # the check reads the settings only: nothing is started
    engine.settings = SimpleNamespace(tp_size=2)  # type: ignore[assignment]
    with pytest.raises(EngineStateError, match="tp_size=2"):
        engine._check_async_available()
    engine.settings = SimpleNamespace(tp_size=1)  # type: ignore[assignment]
    engine._check_async_available()


def test_engine_lock_lets_callers_in_between_driver_steps() -> None:
    """The driver takes the lock straight back after each step; a caller waiting for it still gets it soon."""
    import threading
    import time

    from genengine.engine.aio import DriverLock

    lock = DriverLock()
    stop = threading.Event()
    steps = 0

    def driver() -> None:
        nonlocal steps
        while not stop.is_set():
            with lock.for_driver():
                time.sleep(0.002)  # one step
                steps += 1

    thread = threading.Thread(target=driver)
    thread.start()
    try:
        while steps < 3:
            time.sleep(0.001)
        waits = []
        for _ in range(20):
            start = time.perf_counter()
            with lock():
                waits.append(time.perf_counter() - start)
        assert max(waits) < 0.5, max(waits)
    finally:
        stop.set()
        thread.join()
    assert lock.waiting == 0


# ---- the async driver against an engine shaped like vLLM 0.26's in-process LLMEngine (a fake: it tests *our*
# driver's bookkeeping, not vLLM; GPU tests run the real one) ----------------------------------------------------
class _FakeCore:
    def __init__(self) -> None:
        self.batch_queue: list[Any] = []
        self.scheduler = SimpleNamespace(has_requests=lambda: False)
        self.calls: list[tuple[str, Any]] = []

    def pause_scheduler(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause", clear_cache))

    def resume_scheduler(self) -> None:
        self.calls.append(("resume", None))


class _FakeLLMEngine:
    """``add_request`` registers the id with the output processor, then the engine core takes it (or refuses
    it: ``refuse_in_core``), as llm_engine.py:274-276; ``step`` gives one token per request (DELTA outputs);
    ``abort_request`` forgets ids it knows and ignores the others."""

    def __init__(self) -> None:
        self.output_processor = SimpleNamespace(request_states={})
        self.running: dict[str, list[int]] = {}
        self.renderer = SimpleNamespace(cleared=0)
        self.renderer.clear_mm_cache = lambda: setattr(self.renderer, "cleared", self.renderer.cleared + 1)
        self.engine_core = SimpleNamespace(engine_core=_FakeCore())
        self.refuse_in_core = False
        self.fail_step: BaseException | None = None

    def add_request(self, vid: str, engine_input: Any, params: Any) -> None:
        self.output_processor.request_states[vid] = params
        if self.refuse_in_core:
            raise ValueError("the engine core refused it")
        self.running[vid] = [0, params.max_tokens]

    def abort_request(self, ids: list[str], internal: bool = False) -> None:
        for vid in ids:
            self.output_processor.request_states.pop(vid, None)
            self.running.pop(vid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.request_states)

    def step(self) -> list[Any]:
        if self.fail_step is not None:
            doomed = {"engine": self, "kv": bytearray(1024)}  # a frame local the error must not keep alive
            self.doomed_size = len(doomed)
            raise self.fail_step
        outputs = []
        for vid, pos in list(self.running.items()):
            pos[0] += 1
            done = pos[0] >= pos[1]
            outputs.append(
                SimpleNamespace(
                    request_id=vid,
                    finished=done,
                    outputs=[_completion(0, [pos[0]], "", "length" if done else None)],
                )
            )
            if done:
                del self.running[vid]
                self.output_processor.request_states.pop(vid, None)
        return outputs


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch) -> Any:
    import enum
    import types

    from genengine.engine.aio import DriverLock
    from genengine_vllm._async import AsyncDriver

    if not HAS_VLLM:
        kinds = types.ModuleType("vllm.sampling_params")
        kinds.RequestOutputKind = enum.Enum("RequestOutputKind", "CUMULATIVE DELTA FINAL_ONLY")  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "vllm", sys.modules.get("vllm") or types.ModuleType("vllm"))
        monkeypatch.setitem(sys.modules, "vllm.sampling_params", kinds)
    engine = _FakeLLMEngine()
    llm = SimpleNamespace(llm_engine=engine, _preprocess_cmpl_one=lambda prompt: dict(prompt))
    driver = AsyncDriver(llm, DriverLock(), detokenize=False, cuda=None)
    yield driver, engine
    driver.close()


def _async_request(loop: Any, rid: str, tokens: int) -> Any:
    from genengine.engine.aio import AsyncRequest
    from genengine.requests import normalize_requests

    request = normalize_requests(None, {"max_new_tokens": tokens}, prompt_token_ids=[[1, 2, 3]])[0]
    return AsyncRequest(rid, request, 0, loop)


def _params(tokens: int) -> Any:
    return SimpleNamespace(max_tokens=tokens, output_kind=None)


def test_driver_serves_streams_and_a_sync_batch(fake_driver: Any) -> None:
    driver, engine = fake_driver
    loop = asyncio.new_event_loop()
    try:
        request = _async_request(loop, "a", 3)
        with driver.lock():
            driver.start(request, [({"prompt_token_ids": [1, 2, 3]}, _params(3))])
            batch = driver.submit_sync([{"prompt_token_ids": [4]}], [_params(2)])
        driver.wake()
        outputs = batch.wait(driver.alive)
        assert [o.outputs[0].token_ids for o in outputs] == [[2]]  # FINAL_ONLY: the last output
        deadline = time.monotonic() + 5
        while not request.done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert request.done and request.samples[0].tokens == [1, 2, 3] and request.samples[0].finish == "length"
        assert not driver.busy and not engine.has_unfinished_requests()
    finally:
        loop.close()


def test_driver_forgets_a_request_the_engine_core_refused(fake_driver: Any) -> None:
    """vLLM's output processor has the id before the core refuses it: the driver aborts that id too, or
    ``has_unfinished_requests()`` would stay True and the next ``LLM.generate`` would step forever."""
    driver, engine = fake_driver
    loop = asyncio.new_event_loop()
    try:
        engine.refuse_in_core = True
        with driver.lock(), pytest.raises(InvalidArgumentError, match="vLLM refused the request: the engine core"):
            driver.start(_async_request(loop, "a", 3), [({"prompt_token_ids": [1]}, _params(3))])
        assert not engine.has_unfinished_requests() and not driver.busy
    finally:
        loop.close()


def test_driver_after_a_failed_step(fake_driver: Any) -> None:
    """A step that raises fails every request of ours (each caller gets the error, whose traceback keeps no
    frame locals of vLLM's), and nothing is handed to vLLM afterwards: it may be out of step."""
    driver, engine = fake_driver
    loop = asyncio.new_event_loop()
    try:
        engine.fail_step = RuntimeError("CUDA error: an illegal memory access")
        request = _async_request(loop, "a", 50)
        with driver.lock():
            driver.start(request, [({"prompt_token_ids": [1]}, _params(50))])
        driver.wake()
        deadline = time.monotonic() + 5
        while not request.done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert request.done and request.error is engine.fail_step
        frames = []
        tb = request.error.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        assert all("doomed" not in f.f_locals for f in frames)
        with driver.lock(), pytest.raises(EngineStateError, match=r"vLLM failed earlier .*illegal memory access"):
            driver.submit_sync([{"prompt_token_ids": [4]}], [_params(2)])
    finally:
        loop.close()


def test_driver_thread_dying_fails_later_calls(fake_driver: Any) -> None:
    """The driver's thread dying outside a step (here: the engine core's state cannot be read while it looks
    for work) makes every later call fail, and a generate() waiting on it fails instead of waiting forever."""
    from genengine_vllm._async import SyncBatch

    driver, engine = fake_driver

    def broken() -> bool:
        raise RuntimeError("the scheduler's state cannot be read")

    engine.engine_core.engine_core.scheduler.has_requests = broken
    with driver.lock():
        batch = driver.submit_sync([{"prompt_token_ids": [4]}], [_params(2)])
    driver.wake()
    assert [o.outputs[0].token_ids for o in batch.wait(driver.alive)] == [[2]]
    deadline = time.monotonic() + 5
    while driver.alive() and time.monotonic() < deadline:  # idle, it asks the core for work: that raises
        time.sleep(0.01)
    assert not driver.alive()
    with driver.lock(), pytest.raises(EngineStateError, match=r"vLLM failed earlier .*cannot be read"):
        driver.submit_sync([{"prompt_token_ids": [4]}], [_params(2)])
    orphan = SyncBatch(outputs=[None], remaining=1)  # a wait that nothing will end
    start = time.monotonic()
    with pytest.raises(EngineStateError, match="driver thread ended"):
        orphan.wait(driver.alive)
    assert time.monotonic() - start < 3


def test_driver_skips_a_request_aborted_before_it_reached_vllm(fake_driver: Any) -> None:
    driver, engine = fake_driver
    loop = asyncio.new_event_loop()
    try:
        request = _async_request(loop, "a", 5)
        request.finish(0, "abort")  # aborted from another thread while its submission waited for the lock
        with driver.lock():
            driver.start(request, [({"prompt_token_ids": [1]}, _params(5))])
        assert not driver.busy and not engine.output_processor.request_states
    finally:
        loop.close()


def test_driver_hold_clearing_the_cache_clears_the_renderers_multimodal_cache(fake_driver: Any) -> None:
    """As vLLM's AsyncLLM.pause_generation does: the engine core's reset clears only the receiver's cache."""
    driver, engine = fake_driver
    with driver.lock():
        driver.hold(clear_cache=False)
        driver.release()
        assert engine.renderer.cleared == 0
        driver.hold(clear_cache=True)
        driver.release()
    assert engine.renderer.cleared == 1
    assert engine.engine_core.engine_core.calls == [
        ("pause", False),
        ("resume", None),
        ("pause", False),
        ("pause", True),
        ("resume", None),
    ]
