"""What of vLLM this plugin touches: checked against every supported release's recorded surface.

``tools/engine_surface.py`` reads each release's wheel (by AST, nothing imported) and writes
``surfaces/VERSION.json`` for the modules and classes named here; ``tests/plugins/test_engine_surfaces.py`` checks,
on the CPU, that every use exists in every release ``compat.SURFACES`` lists, unless ``compat.BRANCHES``
names that use and the releases that lack it (the plugin then branches on the feature). A use is
``"module:Name[.member][(keyword, ...)]"``: the module exports ``Name``; the class (or a base) has ``member``
(method, class attribute, field, or an attribute its methods assign on ``self``); the callable accepts those
keywords (by name, or through ``**kwargs``). A leading ``?`` marks a use the code reaches through
``getattr(..., None)`` or ``sys.modules.get``: recorded and reported, never required. Keep this list in step
with the code: the test also fails on an ``import`` from vLLM in the plugin that is not declared here.
"""

from __future__ import annotations

__all__ = ["FIELDS", "USES"]

USES: tuple[str, ...] = (
    # engine.py, raw.py: building the engine, generate, sleep, wake, weights, teardown
    "vllm:LLM",
    "vllm:SamplingParams",
    "vllm.entrypoints.llm:LLM.generate(use_tqdm)",
    # adapters.py: LoRA adapters, preloaded from a PEFT folder and named per request
    "vllm.entrypoints.llm:LLM.generate(lora_request)",
    "vllm.v1.engine.llm_engine:LLMEngine.add_request(lora_request)",
    "vllm.v1.engine.llm_engine:LLMEngine.add_lora",
    "vllm.v1.engine.llm_engine:LLMEngine.remove_lora",
    "vllm.lora.request:LoRARequest",
    "vllm.lora.request:LoRARequest.lora_path",
    "vllm.lora.request:LoRARequest.lora_int_id",
    "vllm.lora.request:LoRARequest.lora_name",
    # _lora_memory.py: an adapter built on the worker's GPU from its tensors and registered by add_lora
    "vllm.v1.worker.gpu_worker:Worker.model_runner",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.lora_manager",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.add_adapter",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager._load_adapter(lora_request)",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager._adapter_manager",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager._lora_model_cls",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.lora_config",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.device",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.vocab_size",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.max_position_embeddings",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager.supported_lora_modules",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager.packed_modules_mapping",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager.model",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager._last_mapping",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager._last_slot_layout",
    "vllm.config.lora:LoRAConfig.max_lora_rank",
    "vllm.config.lora:LoRAConfig.lora_dtype",
    "vllm.lora.peft_helper:PEFTHelper.from_dict",
    "vllm.lora.peft_helper:PEFTHelper.validate_legal",
    "vllm.lora.peft_helper:PEFTHelper(r, lora_alpha, target_modules, bias, vllm_max_position_embeddings)",
    "vllm.lora.lora_model:LoRAModel.from_lora_tensors(lora_model_id, tensors, peft_helper, device, dtype, "
    "model_vocab_size, weights_mapper, skip_prefixes)",
    "vllm.model_executor.models.utils:WeightsMapper.get_unstacked_mapper",
    "vllm.entrypoints.llm:LLM.sleep(level)",
    "vllm.entrypoints.llm:LLM.wake_up(tags)",
    "vllm.entrypoints.llm:LLM.collective_rpc",
    "vllm.entrypoints.llm:LLM.apply_model",
    "vllm.entrypoints.llm:LLM.reset_prefix_cache",
    "vllm.entrypoints.llm:LLM.llm_engine",
    "vllm.entrypoints.llm:LLM.model_config",
    "vllm.entrypoints.llm:LLM._preprocess_cmpl_one",
    "vllm.distributed.parallel_state:cleanup_dist_env_and_memory",
    "vllm.v1.engine.core_client:InprocClient",
    "vllm.v1.engine.core_client:InprocClient.engine_core",
    "vllm.v1.engine.core_client:InprocClient.shutdown",
    "?vllm.v1.engine.llm_engine:LLMEngine.vllm_config",
    "vllm.v1.engine.llm_engine:LLMEngine.engine_core",
    "vllm.v1.engine.llm_engine:LLMEngine.reset_encoder_cache",
    "vllm.v1.engine.llm_engine:LLMEngine.has_unfinished_requests",
    "vllm.v1.engine.llm_engine:LLMEngine.abort_request(request_ids, internal)",
    "vllm.v1.engine.llm_engine:LLMEngine.output_processor",
    "vllm.v1.engine.output_processor:OutputProcessor.request_states",
    "vllm.v1.engine.core:EngineCore.model_executor",
    "vllm.v1.engine.core:EngineCore.scheduler",
    "vllm.v1.engine.core:EngineCore.structured_output_manager",
    "vllm.v1.structured_output:StructuredOutputManager.clear_backend",
    "vllm.v1.executor.abstract:Executor.shutdown",
    "vllm.v1.core.sched.scheduler:Scheduler.shutdown",
    # _process.drop_cuda_graphs / fresh_graph_pool: the process's last engine leaves no graphs and a new pool id
    "?vllm.compilation.cuda_graph:CUDAGraphWrapper.clear_all_graphs",
    "?vllm.compilation.breakable_cudagraph:BreakableCUDAGraphWrapper.clear_all_graphs",
    "?vllm.platforms:_current_platform",
    "?vllm.platforms.interface:Platform._global_graph_pool",
    "?vllm.device_allocator.cumem:CuMemAllocator",
    # compat.release_cumem_pools_at_exit: the sleep allocator's pools, released before finalization
    "vllm.device_allocator.cumem:CuMemAllocator.release_pools",
    "vllm.device_allocator.cumem:CuMemAllocator.allocator_and_pools",
    "vllm.device_allocator.cumem:CuMemAllocator.instance",
    # _async.py: the driver that steps the engine for streamed requests
    "vllm.sampling_params:RequestOutputKind.DELTA",
    "vllm.sampling_params:RequestOutputKind.FINAL_ONLY",
    "vllm.sampling_params:SamplingParams.output_kind",
    "vllm.v1.engine.llm_engine:LLMEngine.add_request",
    "vllm.v1.engine.llm_engine:LLMEngine.step",
    "vllm.v1.engine.llm_engine:LLMEngine.renderer",
    "vllm.renderers.base:BaseRenderer.clear_mm_cache",
    "vllm.v1.engine.core:EngineCore.pause_scheduler(mode, clear_cache)",
    "vllm.v1.engine.core:EngineCore.resume_scheduler",
    "vllm.v1.core.sched.scheduler:Scheduler.kv_cache_manager",
    "vllm.v1.core.kv_cache_manager:KVCacheManager.block_pool",
    "vllm.v1.core.kv_cache_manager:KVCacheManager.evict_blocks",
    "vllm.v1.core.block_pool:BlockPool.blocks",
    "vllm.v1.core.block_pool:BlockPool.cached_block_hash_to_block",
    "vllm.v1.core.block_pool:BlockHashToBlockMap._cache",
    "vllm.v1.core.kv_cache_utils:KVCacheBlock.block_id",
    "vllm.v1.core.kv_cache_utils:KVCacheBlock.block_hash",
    # mapping.py (vllm_sampling_kwargs), engine.py and raw.py: the SamplingParams keywords we pass
    "vllm.sampling_params:SamplingParams(n, temperature, top_p, top_k, max_tokens, stop, stop_token_ids, "
    "ignore_eos, seed, logprobs, flat_logprobs, detokenize, skip_special_tokens, include_stop_str_in_output)",
    # engine.py (_vllm_requests): a call's requests get copies of one built SamplingParams, each its own seed;
    # vLLM clones a request's params before it changes them (InputProcessor.process_inputs)
    "vllm.sampling_params:SamplingParams.seed",
    "vllm.sampling_params:SamplingParams.clone",
    # settings.py (build_llm_kwargs): the EngineArgs fields genengine sets itself
    "vllm.engine.arg_utils:EngineArgs(model, tensor_parallel_size, gpu_memory_utilization, dtype, "
    "enable_sleep_mode, enforce_eager, skip_tokenizer_init, seed, logprobs_mode, distributed_executor_backend)",
)
"""Every vLLM name, member and keyword the plugin's code uses."""

FIELDS: tuple[str, ...] = ("vllm.engine.arg_utils:EngineArgs",)
"""Classes whose field lists the settings layer needs where vLLM is not installed (the options it accepts)."""
