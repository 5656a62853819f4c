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

from genengine.backend import (
    DEFAULT_BUCKET_BYTES,
    REFERENCE_DTYPES,
    ConfigError,
    EngineConfig,
    check_options,
    option_bool,
    read_model_config,
    resolve_model_dir,
)
from genengine_vllm.compat import check_installed

__all__ = [
    "DTYPES",
    "FALLBACK_ENGINE_ARGS",
    "LOGPROBS_MODE",
    "OUR_OPTIONS",
    "WEIGHT_SYNC_MODES",
    "VLLMSettings",
    "build_llm_kwargs",
    "engine_arg_names",
    "resolve_settings",
]

DTYPES = REFERENCE_DTYPES
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

# The public fields of vLLM 0.26.0's (the pinned version's) ``vllm.engine.arg_utils.EngineArgs``, i.e.
# ``{f.name for f in dataclasses.fields(EngineArgs) if not f.name.startswith("_")}``: the names
# ``engine_arg_names`` gives where vLLM is not installed, so that unknown options fail there too, with a
# "did you mean". tests/gpu/test_vllm_gpu.py checks that it equals the installed vLLM's.
FALLBACK_ENGINE_ARGS = frozenset(
    """
    model enable_return_routed_experts model_weights served_model_name tokenizer hf_config_path runner convert
    skip_tokenizer_init enable_prompt_embeds tokenizer_mode trust_remote_code allowed_local_media_path
    allowed_media_domains download_dir safetensors_load_strategy safetensors_prefetch_num_threads
    safetensors_prefetch_block_size load_format config_format dtype kv_cache_dtype seed max_model_len
    cudagraph_capture_sizes max_cudagraph_capture_size ir_op_priority distributed_executor_backend
    pipeline_parallel_size master_addr master_port nnodes node_rank distributed_timeout_seconds
    cpu_distributed_timeout_seconds numa_bind numa_bind_nodes numa_bind_cpus device_ids tensor_parallel_size
    prefill_context_parallel_size decode_context_parallel_size dcp_comm_backend dcp_kv_cache_interleave_size
    cp_kv_cache_interleave_size data_parallel_size data_parallel_rank data_parallel_start_rank
    data_parallel_size_local data_parallel_address data_parallel_rpc_port data_parallel_hybrid_lb
    data_parallel_external_lb data_parallel_multi_port_external_lb data_parallel_backend enable_expert_parallel
    enable_ep_weight_filter moe_backend linear_backend all2all_backend enable_elastic_ep enable_dbo ubatch_size
    dbo_decode_token_threshold dbo_prefill_token_threshold disable_nccl_for_dp_synchronization eplb_config
    enable_eplb expert_placement_strategy max_parallel_loading_workers block_size enable_prefix_caching
    prefix_caching_hash_algo disable_sliding_window disable_cascade_attn offload_backend cpu_offload_gb
    cpu_offload_params offload_group_size offload_num_in_group offload_prefetch_step offload_params
    gpu_memory_utilization kv_cache_memory_bytes max_num_batched_tokens max_num_scheduled_tokens
    max_num_partial_prefills max_long_partial_prefills long_prefill_token_threshold max_num_seqs max_logprobs
    logprobs_mode use_fp64_gumbel disable_log_stats aggregate_engine_logging revision code_revision hf_token
    hf_overrides model_class_overrides tokenizer_revision quantization quantization_config
    allow_deprecated_quantization enforce_eager disable_custom_all_reduce language_model_only
    limit_mm_per_prompt enable_mm_embeds interleave_mm_strings media_io_kwargs mm_processor_kwargs
    mm_processor_cache_gb mm_processor_cache_type mm_shm_cache_max_object_size_mb mm_encoder_only
    mm_encoder_tp_mode mm_encoder_attn_backend mm_encoder_attn_dtype mm_encoder_fp8_scale_path
    mm_encoder_fp8_scale_save_path mm_encoder_fp8_scale_save_margin io_processor_plugin renderer_num_workers
    skip_mm_profiling video_pruning_rate mm_tensor_ipc mm_ipc_gpu_memory_gb enable_lora max_loras max_lora_rank
    default_mm_loras fully_sharded_loras max_cpu_loras lora_dtype lora_target_modules enable_tower_connector_lora
    specialize_active_lora enable_mixed_moe_lora_format enable_moe_shared_loras ray_workers_use_nsight
    num_gpu_blocks_override model_loader_extra_config ignore_patterns enable_chunked_prefill
    disable_chunked_mm_input scheduler_reserve_full_isl prefill_schedule_interval watermark
    disable_hybrid_kv_cache_manager structured_outputs_config reasoning_parser reasoning_parser_plugin
    speculative_config spec_method spec_model spec_tokens diffusion_config show_hidden_metrics_for_version
    otlp_traces_endpoint collect_detailed_traces kv_cache_metrics kv_cache_metrics_sample cudagraph_metrics
    enable_layerwise_nvtx_tracing enable_mfu_metrics enable_logging_iteration_details jit_monitor_mode
    jit_monitor_verbose enable_mm_processor_stats scheduling_policy scheduler_cls pooler_config
    compilation_config attention_config mamba_config kernel_config enable_flashinfer_autotune
    enable_bf16x3_router_gemm worker_cls worker_extension_cls profiler_config kv_transfer_config
    kv_events_config ec_transfer_config reasoning_config generation_config enable_sleep_mode
    enable_cumem_allocator override_generation_config model_impl override_attention_dtype attention_backend
    calculate_kv_scales kv_cache_dtype_skip_layers mamba_cache_dtype mamba_ssm_cache_dtype mamba_block_size
    prefix_match_unit mamba_cache_mode mamba_backend enable_mamba_cache_stochastic_rounding
    mamba_cache_philox_rounds additional_config use_tqdm_on_load pt_load_map_location logits_processors
    async_scheduling stream_interval kv_sharing_fast_prefill optimization_level performance_mode
    kv_offloading_size kv_offloading_backend tokens_only shutdown_timeout weight_transfer_config
    fail_on_environ_validation gdn_prefill_backend
    """.split()  # noqa: SIM905 (a word list reads and diffs better than 219 quoted strings)
)


@functools.cache
def engine_arg_names() -> frozenset[str]:
    """The ``vllm.LLM`` keyword arguments genengine passes through: the installed vLLM's ``EngineArgs`` fields.

    ``vllm.LLM`` hands its extra keywords to ``EngineArgs``, so that dataclass is the authority; reading it
    imports vLLM but starts nothing. Without vLLM (or where it fails to import, which starting it reports
    as ``BackendImportError`` at the same point as before) the pinned version's names stand in.
    """
    if importlib.util.find_spec("vllm") is None:
        return FALLBACK_ENGINE_ARGS
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:  # a broken install: fail where the engine imports vLLM, not here
        return FALLBACK_ENGINE_ARGS
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
