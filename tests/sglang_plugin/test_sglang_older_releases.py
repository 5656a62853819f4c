"""What the plugin does where SGLang 0.5.12 - 0.5.15 behave unlike 0.5.17 (names existing is not behaving the
same): fakes shaped like those releases' objects, read from their wheels, drive the plugin's own code paths.
"""

from __future__ import annotations

import asyncio
import sys
import time
import types
from typing import Any

import pytest

from genengine.requests import normalize_requests
from genengine_sglang import compat
from genengine_sglang.mapping import build_entries


def _manager_0512(incremental: bool) -> Any:
    """0.5.12 - 0.5.15.post1: the flag lives on the server args only (``tokenizer_manager.py``:
    ``self.server_args.incremental_streaming_output``); 0.5.16 copies it onto the manager."""
    return types.SimpleNamespace(server_args=types.SimpleNamespace(incremental_streaming_output=incremental))


def test_incremental_streaming_is_read_where_each_release_keeps_it() -> None:
    assert compat.incremental_streaming(_manager_0512(False)) is False
    assert compat.incremental_streaming(_manager_0512(True)) is True
    newer = types.SimpleNamespace(incremental_streaming_output=True, server_args=None)  # 0.5.16 on
    assert compat.incremental_streaming(newer) is True


class _StreamingManager0512:
    """A 0.5.12 tokenizer manager streaming one request in cumulative chunks, the last one with the whole
    text (``_wait_one_response`` resolves it); no ``incremental_streaming_output`` attribute of its own."""

    tokenizer = None

    def __init__(self) -> None:
        self.server_args = types.SimpleNamespace(incremental_streaming_output=False)
        self.rid_to_state: dict[str, Any] = {}

    async def generate_request(self, obj: Any, request: Any) -> Any:
        self.rid_to_state[obj.rid] = obj
        try:
            yield {"output_ids": [7], "meta_info": {"completion_tokens": 1, "finish_reason": None}}
            await asyncio.sleep(0)
            yield {
                "text": "seven eight",
                "output_ids": [7, 8],
                "meta_info": {"completion_tokens": 2, "finish_reason": {"type": "length", "length": 2}},
            }
        finally:
            self.rid_to_state.pop(obj.rid, None)

    def abort_request(self, rid: str) -> None:
        self.rid_to_state.pop(rid, None)


@pytest.fixture
def fake_io_struct(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's ``GenerateReqInput`` as a namespace (the driver builds one per request), prompt ids returned."""
    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    io_struct.GenerateReqInput = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)
    monkeypatch.setattr(compat, "prompt_ids_returned", lambda: True)


def test_a_stream_ends_on_a_0512_tokenizer_manager(fake_io_struct: None) -> None:
    """The async driver's last chunk asks whether chunks are cumulative: on 0.5.12 reading the manager's
    own attribute failed every stream at its end (``AttributeError`` → the request failed)."""
    from genengine.engine.aio import AsyncRequest
    from genengine_sglang._async import AsyncDriver
    from genengine_sglang._loop import LoopThread

    sgl_loop, caller_loop = asyncio.new_event_loop(), asyncio.new_event_loop()
    driver = LoopThread(sgl_loop)
    aio = AsyncDriver(
        driver, _StreamingManager0512(), deterministic=False, processor=None, extra_key=lambda: None, timeout_s=30
    )
    requests = normalize_requests(None, {"temperature": 0, "max_new_tokens": 2}, prompt_token_ids=[[1, 2, 3]])
    entries = build_entries(requests, deterministic=False, has_tokenizer=True)
    handle = AsyncRequest("r0", requests[0], 0, caller_loop)
    try:
        aio.start(handle, entries)
        deadline = time.monotonic() + 10
        while not handle.done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handle.done and handle.error is None, handle.error
        sample = handle.samples[0]
        assert (sample.tokens, sample.finish, sample.text) == ([7, 8], "length", "seven eight")
    finally:
        driver.close(5)
        sgl_loop.close()
        caller_loop.close()


def _server_args_fields(version: str) -> list[str]:
    surface = compat.surface(version)
    assert surface is not None
    return list(surface["fields"]["sglang.srt.server_args:ServerArgs"])


@pytest.mark.parametrize("version", compat.SUPPORTED)
def test_disable_cuda_graph_turns_off_every_graph_on_each_release(version: str) -> None:
    """0.5.12 - 0.5.13.post1's ``disable_cuda_graph`` leaves the piecewise prefill graphs on (``ModelRunner``
    calls ``init_piecewise_cuda_graphs`` whatever it says: torch.compile at every start, memory outside the
    saver); from 0.5.14 it resolves to both phases off. The added argument is one the release has."""
    fields = _server_args_fields(version)
    added = compat.graphs_off({"disable_cuda_graph": True}, fields)
    old = version in ("0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1")
    assert added == ({"disable_piecewise_cuda_graph": True} if old else {}), version
    assert set(added) <= set(fields)
    assert compat.graphs_off({"disable_cuda_graph": False}, fields) == {}
    # the caller's own choice stands
    assert compat.graphs_off({"disable_cuda_graph": True, "disable_piecewise_cuda_graph": False}, fields) == {}


class _Started(Exception):
    pass


def test_launch_hands_sglang_0512_the_piecewise_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_process.launch`` builds ``sglang.Engine``'s arguments with it (an Engine stand-in records them;
    ``ServerArgs`` has 0.5.12's recorded fields)."""
    import dataclasses

    from genengine_sglang import _process

    fields = _server_args_fields("0.5.12")
    server_args = dataclasses.make_dataclass("ServerArgs", [(f, Any, None) for f in fields])
    seen: dict[str, Any] = {}

    def engine(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise _Started

    for name in ("sglang", "sglang.srt", "sglang.srt.entrypoints"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.entrypoints.engine", types.SimpleNamespace(Engine=engine))
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", types.SimpleNamespace(ServerArgs=server_args))
    with pytest.raises(_Started):
        _process.launch({"model_path": "m", "disable_cuda_graph": True}, enable_sleep=False)
    assert seen == {"model_path": "m", "disable_cuda_graph": True, "disable_piecewise_cuda_graph": True}
    seen.clear()
    with pytest.raises(_Started):
        _process.launch({"model_path": "m", "disable_cuda_graph": False}, enable_sleep=False)
    assert seen == {"model_path": "m", "disable_cuda_graph": False}


def test_launch_refuses_adapters_before_sglang_starts_where_it_cannot_take_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On 0.5.12 - 0.5.16 (one adapter payload for every rank) ``enable_lora=True`` is refused before
    ``sglang.Engine`` starts, naming the installed release and the one that takes adapters; 0.5.17's request
    starts it."""
    import dataclasses
    import importlib.metadata

    from genengine.errors import ConfigError
    from genengine_sglang import _process

    @dataclasses.dataclass
    class Old:
        serialized_tensors: str

    @dataclasses.dataclass
    class New:
        serialized_named_tensors: list[bytes]

    fields = _server_args_fields("0.5.12")
    assert {"enable_lora", "max_lora_rank", "lora_target_modules"} <= set(fields)
    server_args = dataclasses.make_dataclass("ServerArgs", [(f, Any, None) for f in fields])
    started: list[dict[str, Any]] = []

    def engine(**kwargs: Any) -> None:
        started.append(kwargs)
        raise _Started

    for name in ("sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.entrypoints.engine", types.SimpleNamespace(Engine=engine))
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", types.SimpleNamespace(ServerArgs=server_args))
    real_version = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "0.5.12" if name == "sglang" else real_version(name)
    )
    lora = {"model_path": "m", "enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj"]}
    monkeypatch.setitem(
        sys.modules, "sglang.srt.managers.io_struct", types.SimpleNamespace(LoadLoRAAdapterFromTensorsReqInput=Old)
    )
    with pytest.raises(ConfigError, match=r"enable_lora=True: .*from 0\.5\.17 on, and sglang 0\.5\.12 is installed"):
        _process.launch(lora, enable_sleep=False)
    assert started == []
    with pytest.raises(_Started):  # without adapters 0.5.12 starts
        _process.launch({"model_path": "m", "enable_lora": False}, enable_sleep=False)
    monkeypatch.setitem(
        sys.modules, "sglang.srt.managers.io_struct", types.SimpleNamespace(LoadLoRAAdapterFromTensorsReqInput=New)
    )
    with pytest.raises(_Started):
        _process.launch(lora, enable_sleep=False)
    assert started[-1]["enable_lora"] is True


def test_adapters_from_tensors_follow_the_request_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.5.12 - 0.5.16's request has one payload for every rank (``serialized_tensors``, a dataclass), 0.5.17's
    one per rank (``serialized_named_tensors``, and the Engine's per-rank serializer): only the latter is
    what genengine sends; the adapters GPU test skips on the former."""
    import dataclasses

    @dataclasses.dataclass
    class Old:
        lora_name: str
        config_dict: dict[str, Any]
        serialized_tensors: str

    @dataclasses.dataclass
    class New:
        lora_name: str
        config_dict: dict[str, Any]
        serialized_named_tensors: list[bytes]

    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    for cls, want in ((Old, False), (New, True)):
        io_struct = types.SimpleNamespace(LoadLoRAAdapterFromTensorsReqInput=cls)
        monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)
        assert compat.lora_tensors_per_rank() is want
        assert compat.lora_tensors_per_rank(types.SimpleNamespace(_serialize_tensors_per_rank=print)) is want
    assert compat.lora_tensors_per_rank(types.SimpleNamespace()) is False  # an Engine without the serializer


class _LosingAbortManager0512:
    """0.5.12's abort path: ``TokenizerManager.abort_request`` sends ``AbortReq`` for any rid it knows, and the
    scheduler drops one for a request it does not have yet (``Scheduler.abort_request`` searches its queues):
    an abort between ``_init_req_state`` and ``_send_one_request`` is lost and the request runs to its end.
    Here the request reaches the "scheduler" when ``gate`` opens; then one chunk per step until aborted."""

    tokenizer = None

    def __init__(self) -> None:
        self.server_args = types.SimpleNamespace(incremental_streaming_output=False)
        self.rid_to_state: dict[str, Any] = {}
        self.scheduled: set[str] = set()
        self.aborted: set[str] = set()
        self.abort_calls: list[tuple[str, bool]] = []
        self.steps = 0
        self.gate: asyncio.Event | None = None

    async def generate_request(self, obj: Any, request: Any) -> Any:
        self.rid_to_state[obj.rid] = obj
        self.gate = asyncio.Event()
        try:
            await self.gate.wait()  # tokenizing, or behind a weight update's lock
            self.scheduled.add(obj.rid)
            for step in range(1, 5000):
                await asyncio.sleep(0.001)
                self.steps += 1
                if obj.rid in self.aborted:
                    reason = {"type": "abort", "message": "aborted", "status_code": 200}
                    yield {"output_ids": [], "meta_info": {"completion_tokens": step - 1, "finish_reason": reason}}
                    return
                yield {"output_ids": list(range(step)), "meta_info": {"completion_tokens": step, "finish_reason": None}}
        finally:
            self.rid_to_state.pop(obj.rid, None)

    def abort_request(self, rid: str) -> None:
        scheduled = rid in self.scheduled
        self.abort_calls.append((rid, scheduled))
        if scheduled:
            self.aborted.add(rid)


def test_an_abort_lost_before_the_scheduler_had_the_request_is_told_again(fake_io_struct: None) -> None:
    """Aborted while between the tokenizer manager and the scheduler (0.5.12 loses that abort): SGLang's next
    chunk of the request makes the driver tell it again, and the request ends within a few steps instead of
    running its 5000."""
    from genengine.engine.aio import AsyncRequest
    from genengine_sglang._async import AsyncDriver
    from genengine_sglang._loop import LoopThread

    sgl_loop, caller_loop = asyncio.new_event_loop(), asyncio.new_event_loop()
    driver = LoopThread(sgl_loop)
    tm = _LosingAbortManager0512()
    aio = AsyncDriver(driver, tm, deterministic=False, processor=None, extra_key=lambda: None, timeout_s=30)
    requests = normalize_requests(None, {"temperature": 0, "max_new_tokens": 5000}, prompt_token_ids=[[1, 2, 3]])
    entries = build_entries(requests, deterministic=False, has_tokenizer=True)
    handle = AsyncRequest("r0", requests[0], 0, caller_loop)

    def until(check: Any) -> None:
        deadline = time.monotonic() + 5
        while not check() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert check()

    try:
        aio.start(handle, entries)
        until(lambda: tm.rid_to_state and tm.gate is not None)
        aio.abort([handle])  # the caller's abort: SGLang is told while the request is not scheduled yet
        until(lambda: tm.abort_calls)
        assert handle.done and handle.samples[0].finish == "abort"
        sgl_loop.call_soon_threadsafe(tm.gate.set)  # type: ignore[union-attr]
        assert driver.wait_idle(5), driver.describe()
        assert [scheduled for _, scheduled in tm.abort_calls] == [False, True]
        assert tm.steps < 200, tm.steps
    finally:
        driver.close(5)
        sgl_loop.close()
        caller_loop.close()
