"""vLLM adapters loaded from memory (``adapter_sync="memory"``, the default) without vLLM: the worker's LoRA
manager is faked as vLLM 0.24-0.26 shape it (``LRUCacheWorkerLoRAManager.add_adapter`` loads through
``_load_adapter``, then registers; lora/worker_manager.py), ``PEFTHelper`` and ``LoRAModel.from_lora_tensors``
by their signatures. What is checked: no folder is written or read, vLLM gets its own copy of the tensors with the
scale folded into ``lora_B``, a reload after eviction gets the staged model back, a refused adapter leaves nothing
staged, and an unload forgets it. The real engine runs in tests/gpu/test_vllm_adapters_gpu.py."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import types
from typing import Any

import pytest
import torch

from genengine.adapters import Adapter, AdapterConfig
from genengine.engine.adapters import AdapterHost
from genengine.engine.aio.engine import AsyncEngineBase
from genengine.errors import GenEngineError
from genengine_vllm.adapters import VLLMAdapters

CONFIG = AdapterConfig(r=2, lora_alpha=6, target_modules=("o_proj", "q_proj"))
Q, OUT = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"


def _adapter(module: str = Q) -> Adapter:
    pairs = {
        module: (torch.arange(8.0).reshape(2, 4), torch.arange(12.0).reshape(6, 2)),
        OUT: (torch.ones(2, 4), torch.full((4, 2), 0.5)),
    }
    return Adapter(name="policy", version=1, config=CONFIG, pairs=pairs)


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    request_module = types.ModuleType("vllm.lora.request")

    @dataclasses.dataclass
    class LoRARequest:
        lora_name: str
        lora_int_id: int
        lora_path: str

    request_module.LoRARequest = LoRARequest  # type: ignore[attr-defined]
    helper_module = types.ModuleType("vllm.lora.peft_helper")

    @dataclasses.dataclass
    class PEFTHelper:  # vLLM's fields that matter here; from_dict keeps the known ones
        r: int
        lora_alpha: int
        target_modules: Any
        bias: str = "none"
        vllm_max_position_embeddings: int | None = None

        @classmethod
        def from_dict(cls, config: dict[str, Any]) -> PEFTHelper:
            return cls(**config)

        def validate_legal(self, lora_config: Any) -> None:
            if self.r > lora_config.max_lora_rank:
                raise ValueError(f"LoRA rank {self.r} is greater than max_lora_rank {lora_config.max_lora_rank}.")

    helper_module.PEFTHelper = PEFTHelper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request_module)
    monkeypatch.setitem(sys.modules, "vllm.lora.peft_helper", helper_module)


class _LoRAModel:
    @classmethod
    def from_lora_tensors(cls, **kwargs: Any) -> Any:
        return types.SimpleNamespace(id=kwargs["lora_model_id"], **kwargs)


class _WorkerManager:
    """``LRUCacheWorkerLoRAManager`` as far as ``add_adapter`` and ``remove_adapter`` go."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.vocab_size = 32
        self.max_position_embeddings = 128
        self.lora_config = types.SimpleNamespace(max_lora_rank=8, lora_dtype=torch.float32)
        self._lora_model_cls = _LoRAModel
        self._adapter_manager = types.SimpleNamespace(
            supported_lora_modules=["qkv_proj", "o_proj"],
            packed_modules_mapping={"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
            model=types.SimpleNamespace(),
        )
        self.registered: dict[int, Any] = {}
        self.folder_reads: list[str] = []

    def _load_adapter(self, request: Any) -> Any:  # vLLM's: from the folder
        self.folder_reads.append(request.lora_path)
        raise FileNotFoundError(request.lora_path)

    def add_adapter(self, request: Any) -> bool:
        lora = self._load_adapter(request)
        self.registered[lora.id] = lora
        return True

    def remove_adapter(self, lora_id: int) -> bool:
        return self.registered.pop(lora_id, None) is not None


class _FakeEngine(VLLMAdapters, AdapterHost):
    def __init__(self) -> None:
        self.settings = types.SimpleNamespace(llm_options={"enable_lora": True, "max_lora_rank": 8})
        self.manager = _WorkerManager()
        self.state = types.SimpleNamespace(lock=threading.Lock(), live={}, queued=[])
        wrapper = types.SimpleNamespace(worker=types.SimpleNamespace(model_runner=self.manager_holder()))
        manager = self.manager

        class Engine:  # LLMEngine → EngineCore → Executor → Worker → model_runner.add_lora
            def add_lora(self, request: Any) -> bool:
                return manager.add_adapter(request)

            def remove_lora(self, lora_id: int) -> bool:
                return manager.remove_adapter(lora_id)

        def collective_rpc(fn: Any, args: tuple[Any, ...] = ()) -> list[Any]:  # UniProcExecutor: called in place
            return [fn(wrapper, *args)]

        self._llm = types.SimpleNamespace(llm_engine=Engine(), collective_rpc=collective_rpc)
        self._lock = contextlib.nullcontext

    def manager_holder(self) -> Any:
        return types.SimpleNamespace(lora_manager=self.manager)

    def _async_state(self) -> Any:
        return self.state

    _adapters_in_use = AsyncEngineBase._adapters_in_use


def _staged(engine: _FakeEngine) -> dict[int, Any]:
    return engine.manager.__dict__.get("_genengine_memory_loras", {})


def test_an_adapter_goes_to_vllm_from_memory(fake_vllm: None) -> None:
    engine = _FakeEngine()
    adapter = _adapter()
    engine._add_adapter(adapter, None)
    assert engine.manager.folder_reads == []  # no folder read (nor written: the path names no file)
    assert adapter.handle.lora_path.startswith("genengine-memory://")
    lora = engine.manager.registered[adapter.uid]
    assert lora.lora_model_id == adapter.uid and lora.dtype == torch.float32 and lora.device == torch.device("cpu")
    # vLLM sees scale 1 (lora_alpha == r) and lora_B already multiplied by lora_alpha / r = 3.
    assert lora.peft_helper.lora_alpha == lora.peft_helper.r == 2
    assert lora.peft_helper.target_modules == ["o_proj", "q_proj"]
    tensors = lora.tensors
    a, b = adapter.pairs[Q]
    assert torch.equal(tensors[f"base_model.model.{Q}.lora_A.weight"], a)
    assert torch.equal(tensors[f"base_model.model.{Q}.lora_B.weight"], b * 3)
    assert torch.equal(tensors[f"base_model.model.{OUT}.lora_B.weight"], torch.full((4, 2), 1.5))
    # vLLM's copy, not the trainer's tensors: the trainer changing them changes nothing served.
    a.add_(1)
    b.zero_()
    assert torch.equal(tensors[f"base_model.model.{Q}.lora_A.weight"], torch.arange(8.0).reshape(2, 4))
    assert torch.equal(tensors[f"base_model.model.{Q}.lora_B.weight"], torch.arange(12.0).reshape(6, 2) * 3)
    assert {"unload_s", "copy_s", "build_s", "add_lora_s", "sync_s", "stage_s"} <= set(adapter.phases)


def test_vllm_reloading_an_evicted_adapter_gets_the_staged_one(fake_vllm: None) -> None:
    engine = _FakeEngine()
    adapter = _adapter()
    engine._add_adapter(adapter, None)
    staged = engine.manager.registered.pop(adapter.uid)  # vLLM's LRU dropped it (max_cpu_loras)
    assert engine.manager._load_adapter(adapter.handle) is staged  # a request in flight brings it back
    other = types.SimpleNamespace(lora_int_id=10**9, lora_path="/some/folder")
    with pytest.raises(FileNotFoundError):  # any other adapter still loads from its folder
        engine.manager._load_adapter(other)
    assert engine.manager.folder_reads == ["/some/folder"]


def test_an_unload_forgets_the_staged_model(fake_vllm: None) -> None:
    engine = _FakeEngine()
    adapter = _adapter()
    engine._add_adapter(adapter, None)
    engine._drop_adapter(adapter)
    assert adapter.uid not in engine.manager.registered and adapter.uid not in _staged(engine)


@pytest.mark.parametrize(
    ("adapter", "match"),
    [
        (_adapter("model.layers.0.mlp.down_proj"), r"expected target modules .* received \['model.layers.0.mlp"),
        (dataclasses.replace(_adapter(), config=AdapterConfig(r=16, lora_alpha=16, target_modules=("q_proj",))), "16"),
    ],
)
def test_a_refused_adapter_leaves_nothing(fake_vllm: None, adapter: Adapter, match: str) -> None:
    engine = _FakeEngine()
    first = _adapter()
    engine._add_adapter(first, None)
    with pytest.raises(GenEngineError, match=match):
        engine._add_adapter(adapter, first)
    assert adapter.handle is None and adapter.uid not in _staged(engine)
    assert set(engine.manager.registered) == {first.uid} and set(_staged(engine)) == {first.uid}


class _SlotManager:
    """``LRUCacheLoRAModelManager``'s GPU slots as vLLM 0.24.0 - 0.25.1 run them (lora/model_manager.py):
    ``activate_adapter`` evicts the least recently used active adapter at ``lora_slots`` and takes its slot
    (``lora_index_to_id``); ``set_adapter_mapping`` rebuilds the per-request slot indices only when the batch's
    mapping changed (0.24.0 model_manager.py:1146-1149). ``layout`` True: 0.26.0's, which compares the slot
    layout too (``_last_slot_layout``, model_manager.py:1152-1160)."""

    def __init__(self, layout: bool) -> None:
        self.supported_lora_modules = ["qkv_proj", "o_proj"]
        self.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
        self.model = types.SimpleNamespace()
        self.lora_index_to_id: list[int | None] = [None, None]
        self.active: list[int] = []  # least recently used first
        self._last_mapping: tuple[int, ...] | None = None
        self.slot_of_request: list[int] = []  # the punica metadata: the slot each request reads
        if layout:
            self._last_slot_layout: tuple[int | None, ...] | None = None

    def activate_adapter(self, lora_id: int) -> None:
        if lora_id in self.active:
            self.active.remove(lora_id)
        else:
            if len(self.active) == len(self.lora_index_to_id):
                evicted = self.active.pop(0)
                self.lora_index_to_id[self.lora_index_to_id.index(evicted)] = None
            self.lora_index_to_id[self.lora_index_to_id.index(None)] = lora_id
        self.active.append(lora_id)

    def set_adapter_mapping(self, mapping: tuple[int, ...]) -> None:
        layout = tuple(self.lora_index_to_id)
        stale = self._last_mapping != mapping
        if hasattr(self, "_last_slot_layout"):
            stale = stale or self._last_slot_layout != layout
            self._last_slot_layout = layout
        if stale:
            self.slot_of_request = [self.lora_index_to_id.index(i) for i in mapping]
            self._last_mapping = mapping


@pytest.mark.parametrize("layout", [False, True], ids=["0.24.0-0.25.1", "0.26.0"])
def test_an_adapter_added_beside_a_running_batch_leaves_its_slots_right(fake_vllm: None, layout: bool) -> None:
    """Two requests in flight with adapters A and C fill both GPU slots; loading B (vLLM's add_lora activates
    it, evicting A) and the next step (A and C brought back, in other slots) must leave each request reading
    its own adapter's slot, although the batch's mapping did not change."""
    engine = _FakeEngine()
    slots = _SlotManager(layout)
    engine.manager._adapter_manager = slots  # type: ignore[assignment]
    registered = engine.manager.add_adapter

    def add_adapter(request: Any) -> bool:  # LRUCacheWorkerLoRAManager.add_adapter: register, then activate
        added = registered(request)
        slots.activate_adapter(request.lora_int_id)
        return added

    engine.manager.add_adapter = add_adapter  # type: ignore[method-assign]
    a, c, b = _adapter(), _adapter(), _adapter()
    engine._add_adapter(a, None)
    engine._add_adapter(c, None)

    def step() -> None:  # the model runner: _apply_adapters, then set_adapter_mapping
        for uid in (a.uid, c.uid):
            slots.activate_adapter(uid)
        slots.set_adapter_mapping((a.uid, c.uid))

    step()
    assert [slots.lora_index_to_id[s] for s in slots.slot_of_request] == [a.uid, c.uid]
    engine._add_adapter(b, None)
    step()
    assert slots.lora_index_to_id != [a.uid, c.uid]  # the slots moved under an unchanged mapping
    assert [slots.lora_index_to_id[s] for s in slots.slot_of_request] == [a.uid, c.uid]
