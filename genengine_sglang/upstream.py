"""What of SGLang this plugin touches: checked against every supported release's recorded surface.

``tools/engine_surface.py`` reads each release's wheel (by AST, nothing imported) and writes
``surfaces/VERSION.json`` for the modules and classes named here; ``tests/plugins/test_engine_surfaces.py`` checks,
on the CPU, that every use exists in every release ``compat.SUPPORTED`` lists, unless ``compat.BRANCHES``
names that use and the releases that lack it (the plugin then branches on the feature). The notation is
``genengine_vllm.upstream``'s: ``"module:Name[.member][(keyword, ...)]"``, a leading ``?`` for a use reached
through ``getattr(..., None)`` (recorded and reported, never required). The test also fails on an ``import``
from SGLang in the plugin that is not declared here.
"""

from __future__ import annotations

__all__ = ["FIELDS", "USES"]

USES: tuple[str, ...] = (
    # _process.py, raw.py: the engine, its start and its stop
    "sglang.srt.entrypoints.engine:Engine",
    "sglang.srt.entrypoints.engine:Engine.loop",
    "sglang.srt.entrypoints.engine:Engine.tokenizer_manager",
    "sglang.srt.entrypoints.engine:Engine.shutdown",
    "sglang.srt.entrypoints.engine:Engine.get_all_child_pids",
    "sglang.srt.entrypoints.engine:Engine.generate(input_ids, sampling_params)",
    "?sglang.srt.entrypoints.engine:Engine.send_to_rpc",
    "?sglang.srt.entrypoints.engine:Engine._weight_cache_daemon_procs",
    "?sglang.srt.entrypoints.engine:Engine._terminate_weight_cache_daemons",
    "sglang.srt.server_args:ServerArgs",
    "sglang.srt.utils:kill_process_tree(include_parent, wait_timeout)",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.auto_create_handle_loop",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.event_loop",
    "?sglang.srt.managers.tokenizer_manager:TokenizerManager._subprocess_watchdog",
    # engine.py, lightrft.py: generate, sleep, wake, flush
    "sglang.srt.entrypoints.engine:Engine.release_memory_occupation(tags)",
    "sglang.srt.entrypoints.engine:Engine.resume_memory_occupation(tags)",
    "sglang.srt.entrypoints.engine:Engine.flush_cache",
    "?sglang.srt.managers.tokenizer_manager:TokenizerManager.tokenizer",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.generate_request",
    "sglang.srt.managers.io_struct:GenerateReqInput(text, input_ids, sampling_params, return_logprob, "
    "image_data, custom_logit_processor, extra_key, rid, stream)",
    "sglang.srt.managers.io_struct:GenerateReqInput(return_prompt_token_ids)",  # compat.prompt_ids_returned
    # _async.py: streamed requests, pause and continue
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.abort_request",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.pause_generation",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.continue_generation",
    "sglang.srt.managers.io_struct:PauseGenerationReqInput(mode)",
    "sglang.srt.managers.io_struct:ContinueGenerationReqInput",
    "sglang.srt.server_args:ServerArgs.incremental_streaming_output",
    # compat.incremental_streaming: the manager's own copy from 0.5.16, its server_args' before
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.incremental_streaming_output",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.server_args",
    "?sglang.srt.managers.tokenizer_manager:TokenizerManager.rid_to_state",
    "?sglang.srt.managers.tokenizer_manager:TokenizerManager.is_pause",
    # _weightsync.py: weights through CUDA IPC
    "sglang.srt.entrypoints.engine:Engine.update_weights_from_tensor(load_format, flush_cache)",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.update_weights_from_tensor",
    "sglang.srt.managers.io_struct:UpdateWeightsFromTensorReqInput(serialized_named_tensors, load_format, flush_cache)",
    "sglang.srt.weight_sync.tensor_bucket:FlattenedTensorBucket(named_tensors)",
    # compat.local_serialized_tensor: where the class lives moved in 0.5.16
    "sglang.srt.model_executor.model_runner_components.weight_updater:LocalSerializedTensor(values)",
    "sglang.srt.model_executor.model_runner:LocalSerializedTensor(values)",
    # _logits.py: the logit filter SGLang's scheduler runs
    "sglang.srt.sampling.custom_logit_processor:CustomLogitProcessor",
    "sglang.srt.sampling.custom_logit_processor:CustomLogitProcessor.to_str",
    # mapping.py (sampling_to_sglang): the sampling-parameter keys we send
    "sglang.srt.sampling.sampling_params:SamplingParams(max_new_tokens, temperature, ignore_eos, n, stop, "
    "stop_token_ids, sampling_seed, top_k, custom_params)",
    # compat.graph_options (benchmarks/bench_pool.py), settings.check_graph_memory_saver: CUDA graphs per phase
    # from 0.5.14, for all phases before
    "sglang.srt.server_args:ServerArgs(cuda_graph_max_bs_decode, disable_prefill_cuda_graph)",
    "sglang.srt.server_args:ServerArgs(cuda_graph_max_bs, disable_piecewise_cuda_graph)",
    "sglang.srt.server_args:ServerArgs(cuda_graph_backend_prefill, cuda_graph_backend_decode, cuda_graph_config)",
    # adapters.py: LoRA adapters from tensors, per request, unloaded
    "?sglang.srt.entrypoints.engine:Engine._serialize_tensors_per_rank",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.load_lora_adapter_from_tensors",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.unload_lora_adapter",
    "sglang.srt.managers.io_struct:LoadLoRAAdapterFromTensorsReqInput.lora_name",
    "sglang.srt.managers.io_struct:LoadLoRAAdapterFromTensorsReqInput.config_dict",
    "sglang.srt.managers.io_struct:LoadLoRAAdapterFromTensorsReqInput.serialized_named_tensors",  # compat: 0.5.17
    "sglang.srt.managers.io_struct:LoadLoRAAdapterFromTensorsReqInput.load_format",  # "flattened_bucket"
    "sglang.srt.weight_sync.tensor_bucket:FlattenedTensorBucket.get_flattened_tensor",
    "sglang.srt.weight_sync.tensor_bucket:FlattenedTensorBucket.get_metadata",
    "sglang.srt.managers.io_struct:UnloadLoRAAdapterReqInput.lora_name",
    "sglang.srt.managers.io_struct:GenerateReqInput(lora_path)",
    "sglang.srt.server_args:ServerArgs(enable_lora, max_lora_rank, lora_target_modules)",
    # settings.py (server_kwargs): the server arguments genengine sets itself
    "sglang.srt.server_args:ServerArgs(model_path, tp_size, mem_fraction_static, dtype, base_gpu_id, gpu_id_step, "
    "port, skip_tokenizer_init, trust_remote_code, disable_cuda_graph, random_seed, enable_memory_saver, "
    "enable_weights_cpu_backup, custom_weight_loader, enable_custom_logit_processor, nnodes, node_rank)",
)
"""Every SGLang name, member and keyword the plugin's code uses."""

FIELDS: tuple[str, ...] = ("sglang.srt.server_args:ServerArgs",)
"""Classes whose field lists the settings layer needs where SGLang is not installed (the options it accepts)."""
