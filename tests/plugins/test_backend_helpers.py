"""``genengine.backend``, the plugin author's one import: it stays light, and its helpers keep the contract's
rules (stop/EOS, tied weights, seeds, option checks) that the embedded backend and the template share."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from genengine import backend
from genengine.backend import Completion, EngineConfig, SamplingParams, complete
from genengine.engine.completion import sample_seed
from genengine.errors import ConfigError
from genengine.models.tiny_model import build_tiny_model, tiny_model_dir

_ALPHABET = "abcdefghij"


def _decode(ids: list[int]) -> str:
    """A toy decoder: token i is the letter i; 9 ("j") is special and skipped."""
    return "".join(_ALPHABET[i] for i in ids if i != 9)


def test_importing_it_loads_no_torch() -> None:
    code = "import genengine.backend, sys; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_it_exports_what_it_lists() -> None:
    assert all(hasattr(backend, name) for name in backend.__all__)
    for name in ("EngineBase", "EngineConfig", "check_options", "Request", "WeightInfo", "hookimpl", "FromConfig"):
        assert name in backend.__all__
    # the async half: the async base and the objects its hooks see
    for name in ("AsyncEngineBase", "AsyncRequest", "DriverLock"):
        assert name in backend.__all__


# ---- stop rules ---------------------------------------------------------------------------------------------
def _run(params: dict[str, Any], tokens: list[int], eos: tuple[int, ...] = (0,), decode: Any = _decode) -> Any:
    steps = ((t, -0.5 * (k + 1)) for k, t in enumerate(tokens))
    return complete(steps, SamplingParams(**params), eos_token_ids=eos, decode=decode)


def test_eos_stops_and_is_kept_in_tokens_but_not_text() -> None:
    out = _run({"max_new_tokens": 8}, [1, 2, 0, 3])
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == ([1, 2, 0], "bc", "stop", None)
    assert out.logprobs is None


def test_ignore_eos_runs_to_max_new_tokens() -> None:
    out = _run({"max_new_tokens": 4, "ignore_eos": True, "logprobs": True}, [1, 0, 0, 2, 3])
    assert (out.token_ids, out.text, out.finish_reason) == ([1, 0, 0, 2], "baac", "length")
    assert out.logprobs == [-0.5, -1.0, -1.5, -2.0]


def test_stop_token_id_is_the_stop_reason_and_eos_wins_over_it() -> None:
    out = _run({"max_new_tokens": 8, "stop_token_ids": [4]}, [1, 4, 2])
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == ([1, 4], "b", "stop", 4)
    out = _run({"max_new_tokens": 8, "stop_token_ids": [0]}, [1, 0])  # EOS too: EOS's rule (vLLM's order)
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    out = _run({"max_new_tokens": 8, "stop_token_ids": [0], "ignore_eos": True}, [1, 0])
    assert (out.finish_reason, out.stop_reason) == ("stop", 0)


def test_stop_string_cuts_the_text_and_keeps_the_token() -> None:
    out = _run({"max_new_tokens": 8, "stop": ["cd", "zz"]}, [1, 2, 3, 4, 5])
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == ([1, 2, 3], "b", "stop", "cd")
    out = _run({"max_new_tokens": 3, "stop": ["de"]}, [1, 2, 3, 4])  # max_new_tokens first
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == ([1, 2, 3], "bcd", "length", None)


def test_without_a_decoder_there_is_no_text_and_no_stop_string() -> None:
    out = _run({"max_new_tokens": 3, "stop": ["b"]}, [1, 2, 3], decode=None)
    assert (out.token_ids, out.text, out.finish_reason) == ([1, 2, 3], None, "length")


def test_a_stream_that_ends_early_ends_with_length() -> None:
    out = _run({"max_new_tokens": 8}, [1, 2])
    assert (out.token_ids, out.text, out.finish_reason) == ([1, 2], "bc", "length")


def test_completion_says_when_it_is_done() -> None:
    row = Completion(SamplingParams(max_new_tokens=3), eos_token_ids=frozenset({0}), decode=_decode)
    assert row.add(1, -1.0) and row.add(2, -1.0)
    assert not row.add(3, -1.0)
    assert row.output().finish_reason == "length"


# ---- seeds --------------------------------------------------------------------------------------------------
def test_seeds_follow_the_request_else_the_config() -> None:
    seeded, plain = SamplingParams(seed=7), SamplingParams()
    a, b = backend.Seeds(0), backend.Seeds(0)
    assert a.request(seeded) == 7
    assert a.sample(seeded, 1) == sample_seed(7, 1) != sample_seed(7, 0)
    assert [a.request(plain), a.sample(plain, 0)] == [b.request(plain), b.sample(plain, 0)]
    assert backend.Seeds(1).request(plain) != backend.Seeds(0).request(plain)
    assert sample_seed(3, 0) == sample_seed(3, 0) < 2**63


# ---- weights ------------------------------------------------------------------------------------------------
def test_module_weight_spec_matches_the_checkpoint_spec(tmp_path: Path) -> None:
    """A tied lm_head is optional under either spec; names and shapes agree."""
    import transformers

    from genengine.engine.checkpoint import read_model_config, weight_spec

    model_dir = build_tiny_model(tmp_path / "tied", arch="llama", tie_word_embeddings=True, dtype="float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    spec = backend.module_weight_spec(model)
    assert spec == backend.module_weight_spec(model, buffers=False)  # no persistent buffers here
    assert not spec["lm_head.weight"].required and spec["model.embed_tokens.weight"].required
    on_disk = weight_spec(model_dir, read_model_config(model_dir), "float32")
    assert {n: (i.shape, i.required) for n, i in spec.items()} == {n: (i.shape, i.required) for n, i in on_disk.items()}


def test_module_weight_spec_lists_buffers_only_when_asked() -> None:
    import torch

    module = torch.nn.BatchNorm1d(4)
    assert set(backend.module_weight_spec(module, buffers=False)) == {"weight", "bias"}
    spec = backend.module_weight_spec(module)
    assert {"running_mean", "num_batches_tracked"} <= set(spec) and spec["num_batches_tracked"].dtype == "int64"


# ---- configuration ------------------------------------------------------------------------------------------
class _Made(backend.FromConfig):
    backend_name = "made"
    config_options = ("device",)

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.model, self.kwargs = model, kwargs


def test_from_config_checks_then_builds() -> None:
    engine = _Made.from_config({"backend": "made", "model": "m", "seed": 3, "options": {"device": "cpu"}})
    assert engine.model == "m"
    assert engine.kwargs == {"dtype": "bfloat16", "enable_sleep": True, "seed": 3, "device": "cpu"}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model": "m", "options": {"devise": "cpu"}}, "unknown option 'devise' for backend 'made' (did you mean"),
        ({"model": "m", "tp_size": 2}, "tp_size=2: the made backend runs on one device (tp_size=1)"),
        ({}, "the made backend needs a model: pass model=PATH"),
    ],
)
def test_from_config_refuses_before_building(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _Made.from_config(EngineConfig(backend="made", **config))
    assert message in str(info.value)


@pytest.mark.parametrize(("device", "message"), [("tpu", "device='tpu': allowed"), (None, "device=None")])
def test_check_device(device: Any, message: str) -> None:
    assert backend.check_device("cpu") == "cpu"
    with pytest.raises(ConfigError, match=message):
        backend.check_device(device)


def test_torch_dtype_auto_reads_config_json(tmp_path: Path) -> None:
    import torch

    assert backend.torch_dtype("bfloat16", "/nowhere") is torch.bfloat16
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert backend.torch_dtype("auto", str(tmp_path)) is torch.float16
    (tmp_path / "config.json").write_text("{}")
    assert backend.torch_dtype("auto", str(tmp_path)) is torch.float32
    assert backend.torch_dtype("auto", str(tiny_model_dir())) in (torch.float32, torch.bfloat16)


def test_text_decoder_skips_special_tokens() -> None:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir())
    ids = [*tokenizer.encode("hello world", add_special_tokens=False), tokenizer.eos_token_id]
    assert backend.text_decoder(tokenizer)(ids) == tokenizer.decode(ids, skip_special_tokens=True)
