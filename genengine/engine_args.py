"""Checks shared by the engine plugins' reference-style entry points (``get_sglang_engine``, ``get_vllm_engine``).

One place, so both plugins reject the same bad values with the same messages, before an engine is imported
or any GPU memory is taken.
"""

from __future__ import annotations

import math
import os
from typing import Any

from genengine.errors import ConfigError, InvalidArgumentError

__all__ = ["REFERENCE_DTYPES", "check_reference_args", "resolve_model_dir"]

REFERENCE_DTYPES = ("bfloat16", "float16")


def _from_hf_cache(model_id: str) -> str | None:
    """The snapshot directory of a Hugging Face id already in the local cache (nothing is downloaded)."""
    if model_id.count("/") != 1 or model_id.startswith(("/", ".")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model_id, "config.json")
    except Exception:
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


def resolve_model_dir(model: Any, *, what: str = "model", error: type[Exception] = ConfigError) -> str:
    """The model's local directory (absolute); raises ``error`` unless it holds a ``config.json``.

    A Hugging Face id is accepted when the model is already in the local cache: colocated RL runs offline,
    so a typo fails here instead of in an engine process waiting on the network.
    """
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str) or not model:
        raise error(f"{what}={model!r} must be a non-empty path to a model directory")
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise error(f"{what}={model!r} has no config.json: it is not a Hugging Face model directory")
        return os.path.abspath(model)
    if os.path.exists(model):
        raise error(f"{what}={model!r} is a file; give the model's directory")
    cached = _from_hf_cache(model)
    if cached is not None:
        return cached
    raise error(
        f"{what}={model!r} does not exist: give a local model directory (with config.json) or the id of a "
        "model already in the Hugging Face cache (nothing is downloaded)"
    )


def check_reference_args(
    *,
    engine_mem_util: Any,
    enable_engine_sleep: Any,
    tp_size: Any,
    skip_tokenizer_init: Any,
    dtype: Any,
    disable_cuda_graph: Any,
) -> None:
    """The reference's arguments, each named with what is allowed when it is wrong (``InvalidArgumentError``)."""
    mem = engine_mem_util
    if isinstance(mem, bool) or not isinstance(mem, (int, float)) or not math.isfinite(mem) or not 0 < mem <= 1:
        raise InvalidArgumentError(f"engine_mem_util={engine_mem_util!r} must be a number in (0, 1]")
    for name, value in (
        ("enable_engine_sleep", enable_engine_sleep),
        ("skip_tokenizer_init", skip_tokenizer_init),
        ("disable_cuda_graph", disable_cuda_graph),
    ):
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{name}={value!r} must be True or False")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise InvalidArgumentError(f"tp_size={tp_size!r} must be an integer >= 1 that divides the world size")
    if dtype not in REFERENCE_DTYPES:
        raise InvalidArgumentError(f"dtype={dtype!r} is not supported: allowed are 'bfloat16' and 'float16'")
