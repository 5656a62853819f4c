"""genengine's settings → ``vllm.LLM`` keyword arguments, as plain functions of plain data.

Nothing here starts vLLM or imports torch, so every bad value fails before vLLM starts or any GPU memory
is taken; where vLLM is installed its ``EngineArgs`` is read (not started) for the pass-through names.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from genengine.backend import DEFAULT_BUCKET_BYTES, EngineConfig, check_options, option_bool
from genengine.engine.checkpoint import read_model_config, resolve_model_dir
from genengine.errors import ConfigError
from genengine_vllm.compat import check_installed, recorded_engine_args

__all__ = [
    "DTYPES",
    "LOGPROBS_MODE",
    "OUR_OPTIONS",
    "WEIGHT_SYNC_MODES",
    "VLLMSettings",
    "build_llm_kwargs",
    "engine_arg_names",
    "resolve_settings",
]

DTYPES = ("bfloat16", "float16")
"""What the RL engines run in (as SGLang's reference accepts): bf16 or fp16, never fp32."""

LOGPROBS_MODE = "processed_logprobs"
"""vLLM's default is raw logprobs (before temperature/top-k/top-p); the contract is processed ones."""

WEIGHT_SYNC_MODES = ("bucketed", "per_param")

OUR_OPTIONS = (
    "skip_tokenizer_init",
    "disable_cuda_graph",
    "weight_sync_mode",
    "bucket_bytes",
    "allow_unverified_version",
)
"""Backend options that genengine itself interprets; everything else allowed goes to ``vllm.LLM``
(``allow_unverified_version``: see ``genengine_vllm.compat``)."""


@functools.cache
def engine_arg_names() -> frozenset[str]:
    """The ``vllm.LLM`` keyword arguments genengine passes through: the installed vLLM's ``EngineArgs`` fields.

    ``vllm.LLM`` hands its extra keywords to ``EngineArgs``, so that dataclass is the authority; reading it
    imports vLLM but starts nothing. Without vLLM (or where it fails to import, which starting it reports
    as ``BackendImportError`` at the same point as before) the recorded names of the installed release, or
    of the newest verified one, stand in (``compat.recorded_engine_args``: ``surfaces/VERSION.json``, made
    from each release's wheel by tools/engine_surface.py).
    """
    if importlib.util.find_spec("vllm") is None:
        return recorded_engine_args()
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:  # a broken install: fail where the engine imports vLLM, not here
        return recorded_engine_args()
    return frozenset(f.name for f in dataclasses.fields(EngineArgs) if not f.name.startswith("_"))


# vLLM arguments genengine sets itself: passing one as an option is an error that says what to use instead.
_CONTROLLED: Mapping[str, str] = {
    "model": "the model is EngineConfig.model (get_vllm_engine's model_name_or_path)",
    "tensor_parallel_size": "use tp_size",
    "gpu_memory_utilization": "use mem_util (get_vllm_engine's engine_mem_util)",
    "enable_sleep_mode": "use enable_sleep (get_vllm_engine's enable_engine_sleep)",
    "enable_cumem_allocator": "it follows enable_sleep (vLLM's sleep mode needs its cumem allocator)",
    "dtype": "use dtype",
    "enforce_eager": "use disable_cuda_graph",
    "seed": "use EngineConfig.seed (each TP group samples with seed + its group index)",
    "distributed_executor_backend": (
        "genengine picks it: 'external_launcher' (one engine rank per trainer rank) when torch.distributed "
        "is initialised, vLLM's in-process default otherwise"
    ),
    "logprobs_mode": f"logprobs are always {LOGPROBS_MODE!r}, the kind every genengine backend returns",
    "pipeline_parallel_size": "a colocated engine is tensor-parallel only",
    "data_parallel_size": "data parallelism is the trainer's world size divided by tp_size",
    "data_parallel_rank": "data parallelism is the trainer's world size divided by tp_size",
    "data_parallel_size_local": "data parallelism is the trainer's world size divided by tp_size",
    "data_parallel_backend": "data parallelism is the trainer's world size divided by tp_size",
}


@dataclass(frozen=True)
class VLLMSettings:
    """One validated engine request: what genengine decides plus the options passed through to vLLM."""

    model: str
    tp_size: int
    mem_util: float
    dtype: str
    enable_sleep: bool
    seed: int
    skip_tokenizer_init: bool = False
    enforce_eager: bool = False
    weight_sync_mode: str = "bucketed"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    llm_options: Mapping[str, Any] = field(default_factory=dict)
    model_config: Mapping[str, Any] = field(default_factory=dict)


def resolve_settings(config: EngineConfig) -> VLLMSettings:
    """Validate an ``EngineConfig`` for the vllm backend; raises ``ConfigError`` naming the bad value."""
    options = dict(config.options)
    check_options(
        "vllm", options, OUR_OPTIONS, passthrough=sorted(engine_arg_names()), passthrough_from="vllm.EngineArgs"
    )
    check_installed(options)  # a vLLM outside the verified range: refused before vLLM starts
    options.pop("allow_unverified_version", None)
    for key in options:
        if key in _CONTROLLED:
            raise ConfigError(f"option {key!r} is set by genengine for the vllm backend: {_CONTROLLED[key]}")
    if config.dtype not in DTYPES:
        raise ConfigError(f"dtype={config.dtype!r} is not supported by the vllm backend; allowed: {', '.join(DTYPES)}")
    skip_tok = option_bool("skip_tokenizer_init", options.pop("skip_tokenizer_init", False))
    eager = option_bool("disable_cuda_graph", options.pop("disable_cuda_graph", False))
    mode = options.pop("weight_sync_mode", "bucketed")
    if mode not in WEIGHT_SYNC_MODES:
        raise ConfigError(f"weight_sync_mode={mode!r} is not supported; allowed: {', '.join(WEIGHT_SYNC_MODES)}")
    bucket = options.pop("bucket_bytes", DEFAULT_BUCKET_BYTES)
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
        raise ConfigError(f"bucket_bytes={bucket!r} must be a positive integer (bytes per load_weights bucket)")
    model_dir = resolve_model_dir(config.model)
    model_config = read_model_config(model_dir)
    return VLLMSettings(
        model=model_dir,
        tp_size=config.tp_size,
        mem_util=float(config.mem_util),
        dtype=config.dtype,
        enable_sleep=config.enable_sleep,
        seed=config.seed,
        skip_tokenizer_init=skip_tok,
        enforce_eager=eager,
        weight_sync_mode=mode,
        bucket_bytes=bucket,
        llm_options=options,
        model_config=model_config,
    )


def build_llm_kwargs(settings: VLLMSettings, *, external_launcher: bool, group_seed: int) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM``: the settings genengine controls, then the pass-through options.

    ``group_seed`` is the same on every rank of a TP group (external_launcher needs identical sampling
    on all of them) and differs between groups, so data-parallel replicas draw different samples.
    """
    kwargs: dict[str, Any] = {
        "model": settings.model,
        "tensor_parallel_size": settings.tp_size,
        "gpu_memory_utilization": settings.mem_util,
        "dtype": settings.dtype,
        "enable_sleep_mode": settings.enable_sleep,
        "enforce_eager": settings.enforce_eager,
        "skip_tokenizer_init": settings.skip_tokenizer_init,
        "seed": group_seed,
        "logprobs_mode": LOGPROBS_MODE,
    }
    if external_launcher:
        kwargs["distributed_executor_backend"] = "external_launcher"
    kwargs.update(settings.llm_options)
    return kwargs
