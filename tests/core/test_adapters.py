"""The adapter contract without an engine: config coercion, the checks of ``check_adapter``, and an engine that
does not serve adapters refusing them (the conformance suite's ``AdapterTests`` cover a serving engine)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from genengine.adapters import AdapterConfig, check_adapter, supports_adapters
from genengine.errors import EngineStateError, InvalidArgumentError, WeightLoadError
from genengine.protocol import SamplingParams
from genengine.weights import WeightInfo

SPEC = {
    "model.layers.0.self_attn.q_proj.weight": WeightInfo((8, 6), "float32"),
    "model.layers.0.self_attn.q_proj.bias": WeightInfo((8,), "float32"),
    "model.layers.0.mlp.up_proj.weight": WeightInfo((10, 6), "float32"),
    "model.norm.weight": WeightInfo((6,), "float32"),
}
P = "base_model.model.model.layers.0."


def adapter(r: int = 2) -> dict[str, Any]:
    return {
        f"{P}self_attn.q_proj.lora_A.weight": torch.zeros(r, 6),
        f"{P}self_attn.q_proj.lora_B.weight": torch.zeros(8, r),
        f"{P}mlp.up_proj.lora_A.weight": torch.zeros(r, 6),
        f"{P}mlp.up_proj.lora_B.weight": torch.zeros(10, r),
    }


CONFIG = AdapterConfig(r=2, lora_alpha=4, target_modules=("q_proj", "up_proj"))


def test_a_good_adapter_gives_its_pairs() -> None:
    pairs = check_adapter(adapter(), CONFIG, SPEC, max_rank=4)
    assert list(pairs) == ["model.layers.0.mlp.up_proj", "model.layers.0.self_attn.q_proj"]
    assert tuple(pairs["model.layers.0.mlp.up_proj"][1].shape) == (10, 2)
    assert CONFIG.scaling == 2.0


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda t, c: (t, AdapterConfig(r=8, lora_alpha=8, target_modules=c.target_modules)), "max_lora_rank=4"),
        (lambda t, c: (t, AdapterConfig(r=2, lora_alpha=4, target_modules=("q_prj", "up_proj"))), "did you mean"),
        (lambda t, c: (t, AdapterConfig(r=2, lora_alpha=4, target_modules=("q_proj",))), "not in the config"),
        (lambda t, c: ({**t, f"{P}mlp.up_proj.lora_A.weight": torch.zeros(2, 5)}, c), r"asks for \[2, 6\]"),
        (lambda t, c: ({k: v for k, v in t.items() if "up_proj.lora_B" not in k}, c), "no lora_B"),
        (lambda t, c: ({**t, f"{P}mlp.up_proj.lora_A.weight": torch.zeros(2, 6, dtype=torch.int64)}, c), "float"),
        (lambda t, c: ({**t, f"{P}mlp.up_proj.weight": torch.zeros(10, 6)}, c), "not a LoRA weight"),
        (lambda t, c: ({**t, f"{P}mlp.gate_proj.lora_A.weight": torch.zeros(2, 6)}, c), "no linear layer"),
        (lambda t, c: ({}, c), "no tensors"),
    ],
)
def test_a_bad_adapter_is_refused_naming_why(change: Any, match: str) -> None:
    tensors, config = change(adapter(), CONFIG)
    with pytest.raises(WeightLoadError, match=match):
        check_adapter(tensors, config, SPEC, max_rank=4)


def test_servable_modules_are_enforced() -> None:
    with pytest.raises(WeightLoadError, match="up_proj: this engine serves adapters on q_proj"):
        check_adapter(adapter(), CONFIG, SPEC, max_rank=4, servable=("q_proj",))


def test_peft_config_is_coerced_and_unsupported_features_refused() -> None:
    peft = pytest.importorskip("peft")
    config = AdapterConfig.coerce(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj"]))
    assert config == AdapterConfig(r=4, lora_alpha=8.0, target_modules=("q_proj", "v_proj"))
    for bad, match in [
        (peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), "use_dora"),
        (peft.LoraConfig(r=4, target_modules=["q_proj"], use_rslora=True), "use_rslora"),
        (peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save"),
        (peft.LoraConfig(r=4, target_modules=["q_proj"], rank_pattern={"q_proj": 8}), "rank_pattern"),
        (peft.LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.w"]), "target_parameters"),
        ({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "target_parameters": ["w"]}, "target_parameters"),
        (peft.LoraConfig(r=4, target_modules=r".*proj"), "regular expression"),
        ({"r": 0, "lora_alpha": 1, "target_modules": ["q_proj"]}, "r=0"),
        ("nope", "adapter config"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            AdapterConfig.coerce(bad)


def test_sampling_params_adapter_name_is_checked() -> None:
    assert SamplingParams(adapter="policy").adapter == "policy"
    assert SamplingParams.coerce({"adapter": "a-1"}).adapter == "a-1"
    for bad in ("", " x", 3, "a" * 200):
        with pytest.raises(InvalidArgumentError, match="adapter name"):
            SamplingParams(adapter=bad)  # type: ignore[arg-type]


def test_an_engine_without_adapters_declares_it_and_refuses_them() -> None:
    """``EngineBase`` serves none unless the backend declares ``supports_adapters``: both calls are refused before
    the engine does any work."""
    from genengine.engine.base import EngineBase

    class NoAdapters(EngineBase):
        ran = 0

        def _generate(self, requests: Any) -> Any:
            self.ran += 1
            return []

        def _release(self, level: int) -> None: ...
        def _resume(self, tags: Any) -> None: ...
        def _weight_spec(self) -> Any:
            return SPEC

        def _apply_weights(self, bucket: Any, session: Any) -> None: ...
        def _flush_cache(self) -> None: ...
        def _shutdown(self) -> None: ...

    engine = NoAdapters()
    assert not supports_adapters(engine) and engine.max_lora_rank == 0
    with pytest.raises(EngineStateError, match="does not serve LoRA adapters"):
        engine.load_adapter("a", adapter(), CONFIG)
    with pytest.raises(InvalidArgumentError, match="does not serve LoRA adapters"):
        engine.generate(prompt_token_ids=[[1, 2]], sampling_params={"adapter": "a"})
    assert engine.ran == 0
