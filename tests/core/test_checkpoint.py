"""``genengine.engine.checkpoint``: the HF checkpoint facts every backend reads (one suite for every backend)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from genengine.engine.checkpoint import (
    checkpoint_dtype,
    engine_dtype,
    read_model_config,
    read_safetensors_header,
    resolve_model_dir,
    text_config,
    tied_embeddings,
    vocab_size,
    weight_spec,
)
from genengine.engine.environ import scoped_environ, strip_expandable_segments
from genengine.errors import CheckpointError, ConfigError, InvalidArgumentError, WeightLoadError
from genengine.models.tiny_model import build_tiny_model, tiny_model_dir
from genengine.weights import WeightValidator


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


def _config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def _hf_state_dict(path: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).state_dict())


# ---- directory and config -------------------------------------------------------------------------------
def test_model_dir_and_config(model_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_dir(model_dir) == os.path.abspath(model_dir)
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        resolve_model_dir(tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"model_name_or_path=.*does not exist"):
        resolve_model_dir(tmp_path / "nope", what="model_name_or_path", error=InvalidArgumentError)
    assert read_model_config(model_dir) == _config(model_dir)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(CheckpointError, match="must hold a JSON object"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    # Both a configuration error (create_engine) and a bad argument (the reference entry points).
    with pytest.raises(ConfigError, match="cannot read") as info:
        read_model_config(tmp_path)
    assert isinstance(info.value, InvalidArgumentError)


def test_text_config_vocab_tied_and_dtype() -> None:
    vlm = {"text_config": {"vocab_size": 7, "tie_word_embeddings": True, "torch_dtype": "float16"}}
    assert text_config(vlm) is vlm["text_config"] and vocab_size(vlm) == 7 and tied_embeddings(vlm)
    assert vocab_size({"vocab_size": True}) is None and vocab_size({"vocab_size": 0}) is None
    assert not tied_embeddings({}) and not tied_embeddings({"tie_word_embeddings": "yes"})
    assert engine_dtype("auto", vlm) == "float16" and engine_dtype("auto", {}) == "bfloat16"
    assert engine_dtype("float16", {"torch_dtype": "float32"}) == "float16"
    assert checkpoint_dtype({"dtype": "torch.float32"}) == "float32" and checkpoint_dtype({"dtype": "int8"}) is None


# ---- the weight spec ------------------------------------------------------------------------------------------
def test_spec_from_headers_accepts_a_trainers_state_dict(model_dir: Path) -> None:
    from safetensors.torch import load_file

    spec = weight_spec(model_dir, _config(model_dir), "bfloat16")
    tensors = load_file(str(model_dir / "model.safetensors"))
    state = _hf_state_dict(model_dir)
    assert set(spec) == set(tensors) == set(state)
    assert all(spec[n].shape == tuple(t.shape) for n, t in state.items())
    assert all(info.required and info.dtype == "bfloat16" for info in spec.values())
    validator = WeightValidator(spec)
    for i, item in enumerate(state.items()):
        validator.check(i, item)
    header = read_safetensors_header(model_dir / "model.safetensors")
    assert {n: s for n, (s, _) in header.items()} == {n: tuple(t.shape) for n, t in tensors.items()}
    with pytest.raises(WeightLoadError, match=r"did you mean 'model\.norm\.weight'"):
        WeightValidator(spec).check(0, ("model.norm.weights", state["model.norm.weight"]))


def test_spec_tied_embeddings(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "tied", tie_word_embeddings=True, num_layers=1)
    spec = weight_spec(path, _config(path), "bfloat16")
    assert "lm_head.weight" not in read_safetensors_header(path / "model.safetensors")
    head = spec["lm_head.weight"]
    assert not head.required and head.shape == spec["model.embed_tokens.weight"].shape
    state = _hf_state_dict(path)
    assert set(state) == set(spec)
    assert {n for n, i in spec.items() if i.required} == set(state) - {"lm_head.weight"}


def test_spec_tied_head_in_the_checkpoint_is_optional(model_dir: Path) -> None:
    config = {**_config(model_dir), "tie_word_embeddings": True}
    assert not weight_spec(model_dir, config, "bfloat16")["lm_head.weight"].required
    assert weight_spec(model_dir, {**config, "tie_word_embeddings": False}, "bfloat16")["lm_head.weight"].required


def test_spec_sharded_checkpoint_skipped_buffers_and_int_tensors(tmp_path: Path, model_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), start=1):
        fname = f"model-{i:05d}-of-00002.safetensors"
        shard = {n: tensors[n] for n in part}
        if i == 2:
            shard["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(32)
            shard["model.layers.0.mlp.qscale"] = torch.ones(4, dtype=torch.int32)
        save_file(shard, str(tmp_path / fname))
        weight_map.update({n: fname for n in shard})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    spec = weight_spec(tmp_path, _config(tmp_path), "auto")
    assert set(spec) == {*names, "model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.0.mlp.qscale"}
    assert not spec["model.layers.0.self_attn.rotary_emb.inv_freq"].required
    qscale = spec["model.layers.0.mlp.qscale"]
    assert not qscale.required and qscale.dtype == "int32"  # quantisation metadata cannot come from a trainer
    assert spec["model.norm.weight"].required and spec["model.norm.weight"].dtype == "bfloat16"  # config's dtype
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="do not exist"):
        weight_spec(tmp_path, {}, "bfloat16")


def test_spec_without_weight_files_matches(model_dir: Path, tmp_path: Path) -> None:
    """A config-only directory (the engines' load_format="dummy") gets the same spec from the meta device."""
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")
    config = _config(model_dir)
    assert weight_spec(tmp_path, config, "float16") == weight_spec(model_dir, config, "float16")


def test_bad_safetensors_headers(tmp_path: Path) -> None:
    bad = tmp_path / "x.safetensors"
    for content, message in [
        (b"\x05\x00", "shorter than its 8-byte header"),
        (struct.pack("<Q", 10) + b"{not json}", "x.safetensors"),
        (struct.pack("<Q", 3) + b"[1]", "not a JSON object"),
        (struct.pack("<Q", 200_000_000), "the safetensors cap"),
    ]:
        bad.write_bytes(content)
        with pytest.raises(CheckpointError, match=message):
            read_safetensors_header(bad)


# ---- process environment ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        (None, None),
        ("expandable_segments:True", None),
        ("expandable_segments:true,max_split_size_mb:128", "max_split_size_mb:128"),
        (
            "max_split_size_mb:64, expandable_segments:True ,garbage_collection_threshold:0.6",
            "max_split_size_mb:64,garbage_collection_threshold:0.6",
        ),
        ("expandable_segments:False", "expandable_segments:False"),
        ("max_split_size_mb:20", "max_split_size_mb:20"),
    ],
)
def test_strip_expandable_segments(conf: str | None, expected: str | None) -> None:
    assert strip_expandable_segments(conf) == expected


def test_scoped_environ_restores_on_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENENGINE_T_KEEP", "a")
    monkeypatch.delenv("GENENGINE_T_NEW", raising=False)
    with pytest.raises(RuntimeError), scoped_environ({"GENENGINE_T_KEEP": None, "GENENGINE_T_NEW": "1"}):
        assert "GENENGINE_T_KEEP" not in os.environ and os.environ["GENENGINE_T_NEW"] == "1"
        raise RuntimeError
    assert os.environ["GENENGINE_T_KEEP"] == "a" and "GENENGINE_T_NEW" not in os.environ
