"""The tiny-model builder: deterministic, loadable by transformers, shaped as asked."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from genengine.errors import InvalidArgumentError
from genengine.models import tiny_model
from genengine.models.tiny_model import build_tiny_model, count_params, tiny_model_dir

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_arguments_give_identical_files(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    for name in FILES:
        assert _digest(a / name) == _digest(b / name), name
    c = build_tiny_model(tmp_path / "c", seed=4)
    assert _digest(a / "model.safetensors") != _digest(c / "model.safetensors")
    assert _digest(a / "tokenizer.json") == _digest(c / "tokenizer.json"), "the tokenizer must not depend on seed"


def test_default_model_loads_in_transformers() -> None:
    import torch
    import transformers

    path = tiny_model_dir()
    assert {p.name for p in path.iterdir()} >= set(FILES)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (256, 512, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (4, 2, 512)
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is False

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == 512 and tok.eos_token_id == 0 and tok.pad_token_id == 0
    assert model.generation_config.eos_token_id == 0
    weight = model.model.layers[0].mlp.up_proj.weight.float()
    assert abs(weight.std().item() - 0.1) < 0.01, "2-D weights are normal(0, 0.1) at the default width"

    # Peaked, varied outputs: greedy continuations of different prompts differ.
    outs = set()
    for prompt in ("The quick brown fox", "Once upon a time", "Hello"):
        ids = tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        outs.add(tuple(gen[0, ids.shape[1] :].tolist()))
    assert len(outs) == 3


def test_tokenizer_round_trips_and_matches_raw_tokenizers() -> None:
    import transformers
    from tokenizers import Tokenizer

    path = tiny_model_dir()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in ("The quick brown fox 12345 jumps!!  over\n\nthe lazy dog", "Grüße, 東京 <|im_end|> x", "it's"):
        ids = tok.encode(text)
        assert ids == raw.encode(text).ids
        assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_other_architectures_and_tied_embeddings(tmp_path: Path, arch: str) -> None:
    import torch
    import transformers
    from safetensors import safe_open

    path = build_tiny_model(tmp_path / arch, arch=arch, tie_word_embeddings=True, dtype="float32", hidden_size=128)
    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
        assert fh.get_tensor("model.norm.weight").dtype == torch.float32
    assert "lm_head.weight" not in names, "a tied lm_head is not stored"
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    n = sum(p.numel() for p in model.parameters())
    assert n == count_params(
        arch,
        vocab_size=512,
        hidden_size=128,
        intermediate_size=512,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=True,
    )


def test_num_params_reaches_about_that_many(tmp_path: Path) -> None:
    import transformers

    path = build_tiny_model(tmp_path / "m", num_params=5_000_000, dtype="float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    assert 0.85 * 5_000_000 <= n <= 1.15 * 5_000_000


@pytest.mark.parametrize(("arch", "target"), [("qwen2", 7_000_000_000), ("llama", 7_000_000_000), ("qwen2", 5 * 10**8)])
def test_shapes_for_large_models_are_realistic(arch: str, target: int) -> None:
    shape = tiny_model._shapes_for(arch, target, 512, False)
    n = count_params(arch, vocab_size=512, **shape)
    assert 0.95 * target <= n <= 1.05 * target
    heads, kv = shape["num_heads"], shape["num_kv_heads"]
    assert heads % 4 == 0 and heads % kv == 0 and kv % 2 == 0, "TP=2 must split the heads"
    assert 0.5 <= shape["num_layers"] / (shape["hidden_size"] / 128) <= 1.5
    if arch == "qwen2" and target == 7_000_000_000:
        assert shape["hidden_size"] == 3584 and heads == 28 and kv == 4  # Qwen2-7B's attention shape


def test_big_checkpoints_are_sharded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    monkeypatch.setattr(tiny_model, "_SHARD_BYTES", 400_000)
    path = build_tiny_model(tmp_path / "sharded", dtype="float32")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((path / s).exists() for s in shards)
    assert not (path / "model.safetensors").exists()
    sharded = transformers.AutoModelForCausalLM.from_pretrained(path)
    single = transformers.AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "one", dtype="float32"))
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items(), strict=True):
        assert a.equal(b), name


def test_tiny_model_dir_builds_once_per_arguments() -> None:
    assert tiny_model_dir() == tiny_model_dir()
    assert tiny_model_dir(seed=1) != tiny_model_dir()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"arch": "gpt2"},
        {"dtype": "int8"},
        {"hidden_size": 0},
        {"num_heads": 3},
        {"num_kv_heads": 3},
        {"vocab_size": 100},
        {"num_params": 10},
        {"seed": "x"},
        {"num_layers": True},
    ],
)
def test_bad_arguments_are_rejected(tmp_path: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        build_tiny_model(tmp_path / "bad", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "bad" / "model.safetensors").exists()


def test_documented_testing_paths_re_export_the_builders() -> None:
    """``genengine.testing.tiny_model`` / ``tiny_vlm`` (the paths users call) hand on the product builders."""
    from genengine.models import tiny_vlm
    from genengine.testing import tiny_model as old_model
    from genengine.testing import tiny_vlm as old_vlm

    for old, new in ((old_model, tiny_model), (old_vlm, tiny_vlm)):
        assert old.__all__ == new.__all__
        assert all(getattr(old, name) is getattr(new, name) for name in new.__all__)
