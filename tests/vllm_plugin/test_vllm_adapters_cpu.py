"""vLLM's adapter mapping without vLLM: the ``LLM`` options that enable it, the PEFT folder a ``LoRARequest`` names
in the ``adapter_sync="folder"`` way (read back with safetensors), ``lora_request`` per prompt, and a replaced
adapter removed (with its folder) only once no request of ours uses it (vLLM's ``LLMEngine.add_lora`` and
``remove_lora`` faked, as in 0.26's ``v1/engine/llm_engine.py``). The real engine runs in
tests/gpu/test_vllm_adapters_gpu.py."""

from __future__ import annotations

import contextlib
import json
import os
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
from genengine_vllm.adapters import VLLMAdapters, adapter_settings, lora_base_names, write_adapter_dir

CONFIG = AdapterConfig(r=2, lora_alpha=4, target_modules=("q_proj", "v_proj"))


def _adapter(version: int = 0) -> Adapter:
    pairs = {"model.layers.0.self_attn.q_proj": (torch.arange(8.0).reshape(2, 4), torch.ones(6, 2))}
    return Adapter(name="policy", version=version, config=CONFIG, pairs=pairs)


def test_options_enable_adapters() -> None:
    assert adapter_settings({}) == (False, 0)
    assert adapter_settings({"enable_lora": True}) == (True, 16)
    assert adapter_settings({"enable_lora": True, "max_lora_rank": 64}) == (True, 64)
    with pytest.raises(ConfigError, match="max_lora_rank=0"):
        adapter_settings({"enable_lora": True, "max_lora_rank": 0})


def test_the_peft_folder(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    adapter = _adapter()
    path = write_adapter_dir(adapter, str(tmp_path))
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    a, b = adapter.pairs["model.layers.0.self_attn.q_proj"]
    assert torch.equal(tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"], a)
    assert torch.equal(tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"], b)
    config = json.loads(Path(path, "adapter_config.json").read_text())
    assert config["r"] == 2 and config["lora_alpha"] == 4.0 and config["target_modules"] == ["q_proj", "v_proj"]


def test_lora_request_per_prompt() -> None:
    adapter = _adapter()
    adapter.handle = "LoRARequest"
    base = Request(0, SamplingParams(), prompt_token_ids=(1,))
    tuned = Request(1, SamplingParams(adapter="policy"), prompt_token_ids=(2,), lora=adapter)
    assert Request.adapter_handles([base], [0]) is None
    assert Request.adapter_handles([base, tuned], [0, 1, 1]) == [None, "LoRARequest", "LoRARequest"]


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    live: dict[str, Any] = field(default_factory=dict)
    queued: list[Any] = field(default_factory=list)


class _FakeEngine(VLLMAdapters, AdapterHost):
    adapter_sync = "folder"  # the PEFT-folder way (the in-memory one: test_vllm_lora_memory_cpu.py)

    def __init__(self, *, mapping_goes_stale: bool = True) -> None:
        self.settings = types.SimpleNamespace(llm_options={"enable_lora": True, "max_lora_rank": 8})
        self.calls: list[tuple[str, int]] = []
        self.mapping_goes_stale = mapping_goes_stale  # the worker's answer to refresh_mapping (vLLM < 0.26.0)
        self.accept = True
        self.state = _State()
        outer = self

        class Engine:
            def add_lora(self, request: Any) -> bool:
                assert os.path.isfile(os.path.join(request.lora_path, "adapter_model.safetensors"))
                outer.calls.append(("add", request.lora_int_id))
                return outer.accept

            def remove_lora(self, lora_id: int) -> bool:
                outer.calls.append(("remove", lora_id))
                return True

        def collective_rpc(fn: Any, args: tuple[Any, ...] = ()) -> list[Any]:
            outer.calls.append((fn.__name__, -1))
            return [outer.mapping_goes_stale]

        self._llm = types.SimpleNamespace(llm_engine=Engine(), collective_rpc=collective_rpc)
        self._lock = contextlib.nullcontext

    def _async_state(self) -> Any:
        return self.state

    _adapters_in_use = AsyncEngineBase._adapters_in_use  # the real scan, over this fake's state


@pytest.fixture
def lora_request_module(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("vllm.lora.request")

    @dataclass
    class LoRARequest:
        lora_name: str
        lora_int_id: int
        lora_path: str

    module.LoRARequest = LoRARequest  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.lora.request", module)


def test_a_replaced_adapter_is_removed_once_idle(lora_request_module: None) -> None:
    engine = _FakeEngine()
    assert engine.supports_adapters and engine._max_lora_rank() == 8
    first, second = _adapter(1), _adapter(2)
    engine._add_adapter(first, None)
    assert first.handle.lora_int_id == first.uid and first.handle.lora_name == f"policy@{first.uid}"
    running = types.SimpleNamespace(done=False, request=types.SimpleNamespace(lora=first))
    engine.state.live["r"] = running
    engine._add_adapter(second, first)
    engine._drop_adapter(first)
    assert ("remove", first.uid) not in engine.calls and os.path.isdir(first.handle.lora_path)
    running.done = True
    engine._add_adapter(_adapter(3), second)
    assert ("remove", first.uid) in engine.calls and not os.path.exists(first.handle.lora_path)
    # Every add_lora and remove_lora is followed by the slot-metadata refresh (compat.refresh_lora_mapping).
    refresh = ("refresh_mapping", -1)
    for i, call in enumerate(engine.calls):
        if call[0] in ("add", "remove"):
            assert engine.calls[i + 1] == refresh, engine.calls
    engine._adapters_by_name = {"policy": second}  # type: ignore[attr-defined]
    engine._remove_adapter_dirs()
    assert not os.path.exists(second.handle.lora_path)


def test_a_release_that_keeps_its_slot_mapping_right_is_asked_once(lora_request_module: None) -> None:
    # vLLM 0.26.0 on compares the slot layout itself: its worker answers False, and no later sync asks again.
    engine = _FakeEngine(mapping_goes_stale=False)
    previous = None
    for uid in (1, 2, 3):
        adapter = _adapter(uid)
        engine._add_adapter(adapter, previous)
        if previous is not None:
            engine._drop_adapter(previous)
        previous = adapter
    assert [c for c in engine.calls if c[0] == "refresh_mapping"] == [("refresh_mapping", -1)], engine.calls
    assert [c[0] for c in engine.calls].count("add") == 3


def test_vllm_refusing_an_adapter_is_an_error_and_leaves_no_folder(lora_request_module: None) -> None:
    engine = _FakeEngine()
    engine.accept = False
    adapter = _adapter()
    with pytest.raises(GenEngineError, match="vLLM refused adapter 'policy'"):
        engine._add_adapter(adapter, None)
    assert adapter.handle is None


class _Wrapped(torch.nn.Module):
    """The shape of vLLM's ``BaseLayerWithLoRA``: the original layer kept as ``base_layer``."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.base_layer = inner


def _vllm_like_model(*, lora: bool) -> torch.nn.Module:
    """Qwen2's module tree as vLLM names it (q/k/v packed into qkv_proj, gate/up into gate_up_proj)."""
    wrap = _Wrapped if lora else (lambda m: m)
    attn = torch.nn.Module()
    attn.qkv_proj = wrap(torch.nn.Linear(4, 12))
    attn.o_proj = wrap(torch.nn.Linear(4, 4, bias=False))
    layer = torch.nn.Module()
    layer.self_attn = attn
    layer.input_layernorm = torch.nn.LayerNorm(4)
    inner = torch.nn.Module()
    inner.layers = torch.nn.ModuleList([layer])
    inner.embed_tokens = torch.nn.Embedding(10, 4)
    model = torch.nn.Module()
    model.model = inner
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}  # type: ignore[assignment]
    return model


def test_base_weights_name_the_wrapped_layers_of_a_lora_engine() -> None:
    """vLLM with enable_lora keeps a wrapped layer's weight under base_layer, and its loader looks names up: a
    trainer's q_proj.weight must become q_proj.base_layer.weight (the loader packs it into qkv_proj), while the
    layers vLLM does not wrap keep their names."""
    t = torch.zeros(1)
    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.v_proj.bias",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
    ]
    renamed = [n for n, _ in lora_base_names(_vllm_like_model(lora=True), [(n, t) for n in names])]
    assert renamed == [
        "model.layers.0.self_attn.q_proj.base_layer.weight",
        "model.layers.0.self_attn.v_proj.base_layer.bias",
        "model.layers.0.self_attn.o_proj.base_layer.weight",
        "model.layers.0.input_layernorm.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
    ]
    # A prefix vLLM maps differently (a VLM's language model) still finds the wrapped layer by its last segments.
    assert (
        lora_base_names(_vllm_like_model(lora=True), [("language_model.model.layers.0.self_attn.k_proj.weight", t)])[0][
            0
        ]
        == "language_model.model.layers.0.self_attn.k_proj.base_layer.weight"
    )
    plain = [(n, t) for n in names]
    assert lora_base_names(_vllm_like_model(lora=False), plain) == plain
    already = [("model.layers.0.self_attn.q_proj.base_layer.weight", t)]
    assert lora_base_names(_vllm_like_model(lora=True), already) == already
