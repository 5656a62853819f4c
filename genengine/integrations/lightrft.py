"""Checks shared by the engine plugins' reference-style entry points (``get_sglang_engine``, ``get_vllm_engine``).

One place, so both plugins reject the same bad values with the same messages, before an engine is imported
or any GPU memory is taken.
"""

from __future__ import annotations

import math
from typing import Any

from genengine.errors import InvalidArgumentError

__all__ = ["REFERENCE_DTYPES", "check_reference_args"]

REFERENCE_DTYPES = ("bfloat16", "float16")


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
