"""SGLang's adapter mapping without SGLang: the server arguments that enable it, PEFT's config and tensor names
as ``load_lora_adapter_from_tensors`` (0.5.17) takes them, ``GenerateReqInput.lora_path`` per entry, and a
replaced adapter unloaded only once no request of ours uses it (SGLang's calls faked, their signatures as in
``tokenizer_control_mixin.py``). The real engine runs in tests/gpu/test_sglang_gpu.py's conformance class."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from genengine.adapters import Adapter, AdapterConfig
from genengine.engine.adapters import AdapterHost
from genengine.engine.aio.engine import AsyncEngineBase
from genengine.errors import ConfigError, GenEngineError
from genengine.protocol import SamplingParams
from genengine.requests import Request
from genengine_sglang.adapters import (
    SGLangAdapters,
    adapter_settings,
    config_dict,
    sglang_name,
    sglang_named_tensors,
    sglang_tensors,
)

CONFIG = AdapterConfig(r=2, lora_alpha=4, target_modules=("q_proj", "v_proj"))


def _adapter(name: str = "policy", version: int = 0) -> Adapter:
    pairs = {"model.layers.0.self_attn.q_proj": (torch.ones(2, 4), torch.ones(6, 2))}
    return Adapter(name=name, version=version, config=CONFIG, pairs=pairs)


def test_server_arguments_enable_adapters() -> None:
    assert adapter_settings({}) == (False, 0, ())
    on = {"enable_lora": True, "max_lora_rank": 16, "lora_target_modules": ["q_proj", "down_proj"]}
    assert adapter_settings(on) == (True, 16, ("q_proj", "down_proj"))
    assert adapter_settings({**on, "lora_target_modules": "all"})[2][-1] == "down_proj"
    with pytest.raises(ConfigError, match="give max_lora_rank"):
        adapter_settings({"enable_lora": True})
    with pytest.raises(ConfigError, match="lora_target_modules \\['lm_head'\\]"):
        adapter_settings({**on, "lora_target_modules": ["lm_head"]})


def test_enable_lora_without_its_sizes_is_refused_with_the_settings(tmp_path: Path) -> None:
    from genengine.config import EngineConfig
    from genengine.models.tiny_model import tiny_model_dir
    from genengine_sglang.settings import resolve_settings

    config = EngineConfig(backend="sglang", model=str(tiny_model_dir()), options={"enable_lora": True})
    with pytest.raises(ConfigError, match="max_lora_rank"):
        resolve_settings(config, environ={})


def test_config_and_tensors_as_sglang_reads_them() -> None:
    adapter = _adapter()
    assert config_dict(adapter) == {
        "peft_type": "LORA",
        "r": 2,
        "lora_alpha": 4.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    tensors = sglang_tensors(adapter)
    assert sorted(tensors) == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    ]
    assert all(t.device.type == "cpu" for t in tensors.values())
    assert sglang_name(adapter) == f"policy@{adapter.uid}" and sglang_name(_adapter()) != sglang_name(adapter)


def test_lora_path_per_entry() -> None:
    adapter = _adapter()
    adapter.handle = "policy@1"
    base = Request(0, SamplingParams(n=2), prompt_token_ids=(1,))
    tuned = Request(1, SamplingParams(adapter="policy"), prompt_token_ids=(2,), lora=adapter)
    assert Request.adapter_handles([base], [0, 0]) is None
    assert Request.adapter_handles([base, tuned], [0, 0, 1]) == [None, None, "policy@1"]


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    live: dict[str, Any] = field(default_factory=dict)
    queued: list[Any] = field(default_factory=list)


class _FakeEngine(SGLangAdapters, AdapterHost):
    """The mixin over SGLang's calls, faked: loads and unloads recorded; ``fail`` makes SGLang refuse a load."""

    def __init__(self) -> None:
        overrides = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj"]}
        self._settings = types.SimpleNamespace(server_overrides=overrides)  # type: ignore[assignment]
        self.calls: list[tuple[str, str]] = []
        self.requests: list[Any] = []
        self.fail = False
        self.state = _State()
        self.buffers: dict[str, int] = {}  # SGLang's loaded adapters -> the memory their host tensors view
        outer = self

        class TM:
            async def load_lora_adapter_from_tensors(self, req: Any, _: Any) -> Any:
                outer.calls.append(("load", req.lora_name))
                outer.requests.append(req)
                if req.load_format == "flattened_bucket":  # SGLang keeps views of it: never one still in use
                    ptr = req.serialized_named_tensors[0]["flattened_tensor"].untyped_storage().data_ptr()
                    assert ptr not in outer.buffers.values(), f"{req.lora_name} overwrote a loaded adapter"
                    if not outer.fail:
                        outer.buffers[req.lora_name] = ptr
                return types.SimpleNamespace(success=not outer.fail, error_message="bad shapes")

            async def unload_lora_adapter(self, req: Any, _: Any) -> Any:
                outer.calls.append(("unload", req.lora_name))
                outer.buffers.pop(req.lora_name, None)
                return types.SimpleNamespace(success=True, error_message=None)

        self._engine = types.SimpleNamespace(
            tokenizer_manager=TM(),
            loop=asyncio.new_event_loop(),
            _serialize_tensors_per_rank=lambda tensors, fmt: [tensors],
        )

    def _on_leader(self, op: str, fn: Any) -> Any:
        return fn()

    def _sgl(self, fn: Any, what: str = "") -> Any:
        return fn()

    def _async_state(self) -> Any:
        return self.state

    _adapters_in_use = AsyncEngineBase._adapters_in_use  # the real scan, over this fake's state


@pytest.fixture
def io_struct(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's request classes as plain records (``sglang.srt.managers.io_struct``, 0.5.17 field names)."""
    module = types.ModuleType("sglang.srt.managers.io_struct")

    @dataclass
    class LoadLoRAAdapterFromTensorsReqInput:
        lora_name: str
        config_dict: dict[str, Any]
        serialized_named_tensors: list[Any]
        load_format: str | None = None

    @dataclass
    class UnloadLoRAAdapterReqInput:
        lora_name: str

    module.LoadLoRAAdapterFromTensorsReqInput = LoadLoRAAdapterFromTensorsReqInput  # type: ignore[attr-defined]
    module.UnloadLoRAAdapterReqInput = UnloadLoRAAdapterReqInput  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", module)
    bucket_module = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
    bucket_module.FlattenedTensorBucket = _FlattenedTensorBucket  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang.srt.weight_sync.tensor_bucket", bucket_module)


@dataclass
class _Meta:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int


class _FlattenedTensorBucket:
    """SGLang 0.5.17's ``FlattenedTensorBucket`` (weight_sync/tensor_bucket.py), what of it is used: tensors viewed
    as bytes and concatenated, and rebuilt from the bytes and their metadata (``reconstruct_tensors``)."""

    def __init__(self, named_tensors: Any = None, flattened_tensor: Any = None, metadata: Any = None) -> None:
        if named_tensors is None:
            self.flattened_tensor, self.metadata = flattened_tensor, metadata
            return
        flats = [t.flatten().view(torch.uint8) for _, t in named_tensors]
        starts = [0]
        for flat in flats:
            starts.append(starts[-1] + flat.numel())
        self.metadata = [
            _Meta(name, t.shape, t.dtype, starts[i], starts[i + 1]) for i, (name, t) in enumerate(named_tensors)
        ]
        self.flattened_tensor = torch.cat(flats)

    def get_flattened_tensor(self) -> Any:
        return self.flattened_tensor

    def get_metadata(self) -> Any:
        return self.metadata

    def reconstruct_tensors(self) -> list[tuple[str, Any]]:
        return [
            (m.name, self.flattened_tensor[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape))
            for m in self.metadata
        ]


def test_a_replaced_adapter_is_unloaded_once_idle(io_struct: None) -> None:
    engine = _FakeEngine()
    assert engine.supports_adapters and engine._max_lora_rank() == 8 and engine.adapter_modules == ("q_proj",)
    first, second = _adapter(version=1), _adapter(version=2)
    engine._add_adapter(first, None)
    assert first.handle == sglang_name(first) and engine.calls == [("load", first.handle)]
    # A request of ours still runs with the first one: the replacement loads, the first stays in SGLang.
    running = types.SimpleNamespace(done=False, request=types.SimpleNamespace(lora=first))
    engine.state.live["r"] = running
    engine._add_adapter(second, first)
    engine._drop_adapter(first)
    assert engine.calls[-1] == ("load", second.handle)
    running.done = True
    engine._add_adapter(_adapter(version=3), second)  # the next load unloads what is idle first
    assert ("unload", first.handle) in engine.calls


def test_sglang_refusing_an_adapter_is_an_error(io_struct: None) -> None:
    engine = _FakeEngine()
    engine.fail = True
    adapter = _adapter()
    with pytest.raises(GenEngineError, match="SGLang refused adapter 'policy': bad shapes"):
        engine._add_adapter(adapter, None)
    assert adapter.handle is None


def _received(request: Any) -> dict[str, Any]:
    """What SGLang's tp_worker makes of a request (``load_lora_adapter_from_tensors``, one TP rank)."""
    (data,) = request.serialized_named_tensors
    if request.load_format == "flattened_bucket":
        bucket = _FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
        return dict(bucket.reconstruct_tensors())
    assert request.load_format is None
    return dict(data)


def test_an_adapter_travels_as_one_shared_memory_bucket(io_struct: None) -> None:
    engine = _FakeEngine()
    assert engine.adapter_sync == "flattened"
    pairs = {
        "model.layers.0.self_attn.q_proj": (torch.randn(2, 4, dtype=torch.bfloat16), torch.randn(6, 2).bfloat16()),
        "model.layers.0.self_attn.v_proj": (torch.randn(2, 4).bfloat16(), torch.randn(3, 2).bfloat16()),
    }
    adapter = Adapter(name="policy", version=1, config=CONFIG, pairs=pairs)
    expected = {name: t.clone() for name, t in sglang_tensors(adapter).items()}
    engine._add_adapter(adapter, None)
    (request,) = engine.requests
    assert request.load_format == "flattened_bucket"
    flat = request.serialized_named_tensors[0]["flattened_tensor"]
    assert flat.is_shared() and flat.dtype == torch.uint8  # one buffer handed over, not one per tensor
    received = _received(request)
    assert sorted(received) == sorted(expected)
    assert all(torch.equal(received[n], expected[n]) and received[n].dtype == torch.bfloat16 for n in expected)
    for a, b in pairs.values():  # a copy: the trainer changing its tensors changes nothing SGLang got
        a.zero_()
        b.zero_()
    assert all(torch.equal(received[n], expected[n]) for n in expected)
    assert {"unload_s", "flatten_s", "serialize_s", "scheduler_s"} <= set(adapter.phases)


def test_the_per_tensor_way_is_kept(io_struct: None) -> None:
    engine = _FakeEngine()
    engine.adapter_sync = "tensors"
    adapter = _adapter()
    engine._add_adapter(adapter, None)
    (request,) = engine.requests
    received = _received(request)
    assert received.keys() == sglang_tensors(adapter).keys() and all(t.device.type == "cpu" for t in received.values())
    engine.adapter_sync = "fast"
    with pytest.raises(
        ConfigError, match="adapter_sync='fast' is not supported; allowed: flattened, cuda_ipc, tensors"
    ):
        engine._add_adapter(_adapter(), adapter)


def test_the_bucket_can_stay_where_the_tensors_are(io_struct: None) -> None:
    """adapter_sync="cuda_ipc": the same bucket, not copied to shared memory (on a GPU it travels as a CUDA-IPC
    handle); refused with more than one TP rank, before anything reaches SGLang."""
    engine = _FakeEngine()
    engine.adapter_sync = "cuda_ipc"
    adapter = _adapter()
    engine._add_adapter(adapter, None)
    (request,) = engine.requests
    assert request.load_format == "flattened_bucket"
    assert not request.serialized_named_tensors[0]["flattened_tensor"].is_shared()
    received = _received(request)
    assert all(torch.equal(received[n], t) for n, t in sglang_tensors(adapter).items())
    engine._settings.tp_size = 2
    with pytest.raises(ConfigError, match="cuda_ipc' serves one TP rank"):
        engine._add_adapter(_adapter(), adapter)
    assert len(engine.requests) == 1


def _sglang_normalize(weights: dict[str, Any]) -> dict[str, Any]:
    """SGLang 0.5.17's ``LoRAAdapter.normalize_qkv_proj`` and ``normalize_gate_up_proj`` (lora/lora.py:264-316,
    462-500), the dense branches as written there (substring tests included), on one layer's weights."""
    weights = dict(weights)
    names = list(weights)
    targets = {m for m in ("q_proj", "k_proj", "v_proj", "qkv_proj") for n in names if m in n}
    for name in names:
        if "q_proj" in name:
            k = weights[name.replace("q_proj", "k_proj")] if "k_proj" in targets else None
            v = weights[name.replace("q_proj", "v_proj")]
            k = torch.zeros_like(v) if k is None else k
            weights[name.replace("q_proj", "qkv_proj")] = torch.cat((weights[name], k, v), 0)
            for part in ("q_proj", "k_proj", "v_proj"):
                weights.pop(name.replace("q_proj", part), None)
        elif "qkv_proj" in name and "lora_A" in name:
            weights[name] = weights[name].repeat(3, 1)
    for name in list(weights):
        if "gate_proj" in name:
            up = name.replace("gate_proj", "up_proj")
            weights[name.replace("gate_proj", "gate_up_proj")] = torch.cat((weights.pop(name), weights.pop(up)), 0)
        elif "gate_up_proj" in name and "lora_A" in name:
            weights[name] = weights[name].repeat(2, 1)
    return weights


def test_fused_lora_b_arrive_stacked_as_sglang_would_stack_them() -> None:
    """q/k/v's and gate/up's lora_B go stacked under SGLang's fused names (its scheduler would concatenate them on
    its CPU); SGLang's normalization then ends with the same tensors as from PEFT's names. A group missing a part
    (v without k here) goes as PEFT names it."""
    torch.manual_seed(0)
    shapes = {"self_attn.q_proj": (8, 4), "self_attn.k_proj": (2, 4), "self_attn.v_proj": (2, 4)}
    shapes |= {"self_attn.o_proj": (4, 8), "mlp.gate_proj": (6, 4), "mlp.up_proj": (6, 4), "mlp.down_proj": (4, 6)}
    pairs = {f"model.layers.0.{m}": (torch.randn(2, i), torch.randn(o, 2)) for m, (o, i) in shapes.items()}
    config = AdapterConfig(r=2, lora_alpha=4, target_modules=tuple(m.rpartition(".")[2] for m in shapes))
    adapter = Adapter(name="policy", version=0, config=config, pairs=pairs)
    named = dict(sglang_named_tensors(adapter))
    lora_b = sorted(n.split(".")[-3] for n in named if ".lora_B." in n)
    assert lora_b == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert len([n for n in named if ".lora_A." in n]) == 7
    from_peft = _sglang_normalize(sglang_tensors(adapter))
    from_ours = _sglang_normalize(named)
    assert sorted(from_ours) == sorted(from_peft)
    assert all(torch.equal(from_ours[n], from_peft[n]) for n in from_peft)
    partial = {m: p for m, p in pairs.items() if "k_proj" not in m}
    names = dict(sglang_named_tensors(dataclasses.replace(adapter, pairs=partial)))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight" in names
    assert not any("qkv_proj" in n for n in names)


def _versioned(version: int, name: str = "policy") -> Adapter:
    """An adapter whose every value is its version: what SGLang received tells the versions apart."""
    value = float(version)
    pairs = {"model.layers.0.self_attn.q_proj": (torch.full((2, 4), value), torch.full((6, 2), value))}
    return Adapter(name=name, version=version, config=CONFIG, pairs=pairs)


def _buffer(engine: _FakeEngine, adapter: Adapter) -> int:
    """The memory SGLang got ``adapter``'s bucket in."""
    (request,) = [r for r in engine.requests if r.lora_name == sglang_name(adapter)]
    return int(request.serialized_named_tensors[0]["flattened_tensor"].untyped_storage().data_ptr())


def _reused(adapter: Adapter) -> bool:
    return adapter.phases.get("flatten_reused", 0.0) == 1.0


def _sync(engine: _FakeEngine, adapter: Adapter) -> None:
    """``load_adapter``'s order of hooks: add the new one, then retire the one it replaces."""
    old = engine.__dict__.setdefault("_current", {}).get(adapter.name)
    engine._add_adapter(adapter, old)
    engine.__dict__["_current"][adapter.name] = adapter
    if old is not None:
        engine._drop_adapter(old)


def test_a_buffer_is_reused_once_its_adapter_is_unloaded(io_struct: None) -> None:
    """RL steady state: v1's buffer serves v3 once v1 is unloaded (replaced by v2, idle), and SGLang then reads
    v3's values there, not v1's."""
    engine = _FakeEngine()
    v1, v2, v3 = _versioned(1), _versioned(2), _versioned(3)
    _sync(engine, v1)
    _sync(engine, v2)
    assert ("unload", sglang_name(v1)) in engine.calls and not _reused(v1) and not _reused(v2)
    _sync(engine, v3)
    assert _reused(v3) and _buffer(engine, v3) == _buffer(engine, v1)
    received = _received(engine.requests[-1])
    assert received and all(torch.equal(t, torch.full_like(t, 3.0)) for t in received.values())
    assert engine._shared_buffers.in_use.keys() == {v3.uid}  # v2 unloaded at v3's retire: idle


def test_a_buffer_is_never_reused_while_its_adapter_is_loaded_or_in_use(io_struct: None) -> None:
    """v1 retired but still used by a request keeps its buffer, and so does v2 while loaded; once v1's request is
    done the next load unloads it first and takes a buffer back (the fake SGLang checks no load overwrites the
    memory of an adapter it still has)."""
    engine = _FakeEngine()
    v1, v2, v3, v4 = (_versioned(v) for v in (1, 2, 3, 4))
    running = types.SimpleNamespace(done=False, request=types.SimpleNamespace(lora=v1))
    _sync(engine, v1)
    engine.state.live["r"] = running
    _sync(engine, v2)  # v1 retired, in use
    _sync(engine, v3)  # v1 still in use, v2 loaded until v3 is added
    assert ("unload", sglang_name(v1)) not in engine.calls and not _reused(v3)
    assert len({_buffer(engine, v) for v in (v1, v2, v3)}) == 3
    running.done = True
    _sync(engine, v4)  # unloads v1 first, then loads v4 in v2's or v1's buffer
    assert ("unload", sglang_name(v1)) in engine.calls
    assert _reused(v4) and _buffer(engine, v4) in {_buffer(engine, v1), _buffer(engine, v2)}
    assert all(torch.equal(t, torch.full_like(t, 4.0)) for t in _received(engine.requests[-1]).values())


def test_a_refused_load_gives_its_buffer_back(io_struct: None) -> None:
    engine = _FakeEngine()
    refused, adapter = _versioned(1), _versioned(2)
    engine.fail = True
    with pytest.raises(GenEngineError, match="SGLang refused"):
        engine._add_adapter(refused, None)
    engine.fail = False
    engine._add_adapter(adapter, None)
    assert _reused(adapter) and _buffer(engine, adapter) == _buffer(engine, refused)
    assert all(torch.equal(t, torch.full_like(t, 2.0)) for t in _received(engine.requests[-1]).values())


def test_idle_buffers_stay_bounded_and_go_at_shutdown(io_struct: None) -> None:
    """Four adapters unloaded leave two idle buffers (the newest), which two of the next four loads reuse; a failed
    unload's buffer is never reused; shutdown drops them all."""
    engine = _FakeEngine()
    first = [_versioned(1, name) for name in "abcd"]
    for adapter in first:
        _sync(engine, adapter)
    for adapter in first:
        engine._drop_adapter(adapter)  # unload_adapter: idle, unloaded at once
    again = [_versioned(2, name) for name in "efgh"]
    for adapter in again:
        _sync(engine, adapter)
    assert [_reused(a) for a in again] == [True, True, False, False]
    assert {_buffer(engine, a) for a in again[:2]} == {_buffer(engine, a) for a in first[2:]}
    assert not engine._shared_buffers.idle
    engine._drop_adapter(again[0])
    assert len(engine._shared_buffers.idle) == 1
    engine._drop_adapter_buffers()
    assert not engine._shared_buffers.idle and not engine._shared_buffers.in_use


def test_a_buffer_whose_unload_failed_is_not_reused(io_struct: None) -> None:
    engine = _FakeEngine()
    first, second = _versioned(1), _versioned(2)
    engine._add_adapter(first, None)

    async def refuse(req: Any, _: Any) -> Any:
        return types.SimpleNamespace(success=False, error_message="busy")

    engine._engine.tokenizer_manager.unload_lora_adapter = refuse
    with pytest.raises(GenEngineError, match="could not unload"):
        engine._unload_adapter(first)
    engine._add_adapter(second, None)  # the fake SGLang still has first: it checks second is elsewhere
    assert not _reused(second) and _buffer(engine, second) != _buffer(engine, first)
