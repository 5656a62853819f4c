"""The sglang plugin's LightRFT face on a CPU machine without SGLang: the reference signatures, both faces on
one class, and the reference arguments checked before any process or memory.
"""

from __future__ import annotations

import inspect
import math
import multiprocessing as mp
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from genengine.config import EngineConfig
from genengine.errors import (
    DistributedSetupError,
    InvalidArgumentError,
)
from genengine_sglang.engine import SGLangEngine
from genengine_sglang.lightrft import RLGenerationEngine, get_sglang_engine


def test_get_sglang_engine_has_the_reference_signature() -> None:
    params = inspect.signature(get_sglang_engine).parameters
    assert [(p.name, p.default) for p in params.values()] == [
        ("model_name_or_path", inspect.Parameter.empty),
        ("engine_mem_util", inspect.Parameter.empty),
        ("enable_engine_sleep", True),
        ("tp_size", 1),
        ("skip_tokenizer_init", False),
        ("dtype", "bfloat16"),
        ("disable_cuda_graph", False),
    ]


def test_protocol_class_has_the_protocol_face_only() -> None:
    """``SGLangEngine`` is the protocol's API alone; LightRFT's calls live on its subclass."""
    from genengine.engine.base import EngineBase

    for method in ("generate", "sleep", "wake", "load_weights"):
        assert inspect.signature(getattr(SGLangEngine, method)) == inspect.signature(getattr(EngineBase, method))
    for name in ("wake_up", "update_weights_from_tensor"):
        assert not hasattr(SGLangEngine, name) and hasattr(RLGenerationEngine, name)
    params = list(inspect.signature(SGLangEngine).parameters)
    assert params == ["settings", "group", "require_distributed"]
    assert SGLangEngine.supported_tags == RLGenerationEngine.supported_tags


def test_both_faces_on_one_class() -> None:
    gen = inspect.signature(RLGenerationEngine.generate).parameters
    for name in ("prompts", "sampling_params", "prompt_token_ids", "image_data"):
        assert name in gen
    for name in ("prompt", "input_ids", "return_logprob", "logprob_start_len", "top_logprobs_num", "gather_inputs"):
        assert gen[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert "release_weights" in inspect.signature(RLGenerationEngine.sleep).parameters
    ref = inspect.signature(RLGenerationEngine.update_weights_from_tensor).parameters
    assert list(ref)[1:] == ["name", "tensor", "flush_cache", "load_format"]
    assert RLGenerationEngine.supported_tags == ("weights", "kv_cache", "cuda_graph")


# ---- bad input, before any process or memory --------------------------------------------------------------------
BAD_ARGS: list[tuple[dict[str, Any], str]] = [
    ({"engine_mem_util": 0}, "engine_mem_util"),
    ({"engine_mem_util": 0.0}, "engine_mem_util"),
    ({"engine_mem_util": 1.5}, "engine_mem_util"),
    ({"engine_mem_util": -0.1}, "engine_mem_util"),
    ({"engine_mem_util": math.nan}, "engine_mem_util"),
    ({"engine_mem_util": "0.5"}, "engine_mem_util"),
    ({"engine_mem_util": True}, "engine_mem_util"),
    ({"tp_size": 0}, "tp_size"),
    ({"tp_size": -2}, "tp_size"),
    ({"tp_size": 1.0}, "tp_size"),
    ({"tp_size": True}, "tp_size"),
    ({"dtype": "float32"}, "dtype"),
    ({"dtype": "bf16"}, "dtype"),
    ({"disable_cuda_graph": "yes"}, "disable_cuda_graph"),
    ({"disable_cuda_graph": 1}, "disable_cuda_graph"),
    ({"enable_engine_sleep": None}, "enable_engine_sleep"),
    ({"skip_tokenizer_init": 0}, "skip_tokenizer_init"),
]


@pytest.mark.parametrize(
    ("bad", "needle"), BAD_ARGS, ids=[f"{next(iter(b))}={next(iter(b.values()))!r}" for b, _ in BAD_ARGS]
)
def test_bad_arguments(model_dir: Path, bad: dict[str, Any], needle: str) -> None:
    kwargs = {"model_name_or_path": str(model_dir), "engine_mem_util": 0.5, **bad}
    with pytest.raises(InvalidArgumentError) as info:
        get_sglang_engine(**kwargs)
    assert isinstance(info.value, ValueError)
    assert needle in str(info.value) and repr(next(iter(bad.values()))) in str(info.value)


def test_bad_model_paths(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        get_sglang_engine(str(tmp_path / "nope"), 0.5)
    with pytest.raises(InvalidArgumentError, match=r"no config\.json"):
        get_sglang_engine(str(tmp_path), 0.5)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match="is a file"):
        get_sglang_engine(str(tmp_path / "weights.bin"), 0.5)
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        get_sglang_engine("", 0.5)
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        get_sglang_engine("no-such-org/no-such-model", 0.5)  # not in the HF cache: nothing is downloaded


def test_not_initialised_is_an_assertion_error(model_dir: Path) -> None:
    with pytest.raises(DistributedSetupError) as info:
        get_sglang_engine(str(model_dir), 0.5)
    assert isinstance(info.value, AssertionError)
    assert "torch.distributed is not initialised" in str(info.value)
    assert not mp.active_children()


def test_not_initialised_survives_python_O(model_dir: Path) -> None:
    code = (
        "from genengine_sglang import get_sglang_engine\n"
        "try:\n"
        f"    get_sglang_engine({str(model_dir)!r}, 0.5)\n"
        "except AssertionError as e:\n"
        "    print('raised', type(e).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert "raised DistributedSetupError" in out.stdout, out.stderr


def test_rollout_wrapper_maps_the_reference_arguments(model_dir: Path) -> None:
    from types import SimpleNamespace

    from genengine_sglang import get_sglang_engine_for_rollout

    args = SimpleNamespace(pretrain=str(model_dir), engine_mem_util=0.5, enable_engine_sleep=True, engine_tp_size=1)
    with pytest.raises(InvalidArgumentError, match="bf16"):
        get_sglang_engine_for_rollout(args)
    args.bf16 = True
    with pytest.raises(DistributedSetupError):  # valid arguments: the reference's distributed check
        get_sglang_engine_for_rollout(args)
    args.engine_mem_util = 3
    with pytest.raises(InvalidArgumentError, match="engine_mem_util"):
        get_sglang_engine_for_rollout(args)


def test_tp_above_one_needs_distributed(model_dir: Path) -> None:
    with pytest.raises(DistributedSetupError, match="tp_size=2"):
        RLGenerationEngine.from_config(EngineConfig(backend="sglang", model=str(model_dir), tp_size=2))


# ---- sgl_model_saver ----------------------------------------------------------------------------------------------
def test_model_saver_arguments() -> None:
    from genengine_sglang import sgl_model_saver

    with pytest.raises(InvalidArgumentError, match="RLGenerationEngine"):
        sgl_model_saver.release_memory_occupation(object())  # type: ignore[arg-type]
    sgl_model_saver.release_memory_occupation()  # no live engine in this process: nothing to do
    sgl_model_saver.resume_memory_occupation()
