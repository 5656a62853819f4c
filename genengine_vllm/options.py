"""The old home of :mod:`genengine_vllm.settings` and :mod:`genengine_vllm.mapping`, which it re-exports.

Kept for callers outside the plugin that still import from here (``tests/test_examples.py``,
``benchmarks/bench_vllm.py``); new code imports from the two modules. ``ENGINE_ARGS`` is the pinned
version's name list (``settings.FALLBACK_ENGINE_ARGS``); the check itself uses ``settings.engine_arg_names()``.
"""

from __future__ import annotations

from genengine_vllm.mapping import (
    MIN_TEMPERATURE,
    convert_request_output,
    sampled_logprobs,
    split_greedy_n,
    vllm_sampling_kwargs,
)
from genengine_vllm.settings import (
    DTYPES,
    LOGPROBS_MODE,
    OUR_OPTIONS,
    WEIGHT_SYNC_MODES,
    VLLMSettings,
    build_llm_kwargs,
    resolve_settings,
)
from genengine_vllm.settings import FALLBACK_ENGINE_ARGS as ENGINE_ARGS

__all__ = [
    "DTYPES",
    "ENGINE_ARGS",
    "LOGPROBS_MODE",
    "MIN_TEMPERATURE",
    "OUR_OPTIONS",
    "WEIGHT_SYNC_MODES",
    "VLLMSettings",
    "build_llm_kwargs",
    "convert_request_output",
    "resolve_settings",
    "sampled_logprobs",
    "split_greedy_n",
    "vllm_sampling_kwargs",
]
