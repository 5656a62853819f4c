"""The raw ``vllm.LLM`` that ``genengine bench`` measures beside ours: same settings, no genengine code."""

from __future__ import annotations

import gc
import time
from typing import Any

from genengine.backend import EngineConfig

__all__ = ["raw_tokens_per_second"]


def raw_tokens_per_second(config: Any, prompt_token_ids: list[list[int]], max_new_tokens: int) -> float:
    """Greedy output tokens per second of a plain ``vllm.LLM`` built with the arguments ours would use.

    One warm-up run, then the median of three. Runs in this process, so it must not overlap a live
    sleep-mode engine (vLLM allows one per process; the same check as ours refuses it).
    """
    import statistics

    import torch

    from genengine.backend import scoped_environ
    from genengine_vllm._process import (
        PROCESS_STATE,
        claim_sleep_slot,
        import_vllm,
        keep_default_group,
        preserve_rng_states,
        release_sleep_slot,
        start_environ,
        trainer_world,
    )
    from genengine_vllm.settings import build_llm_kwargs, resolve_settings

    settings = resolve_settings(EngineConfig.from_any(config))
    topology = trainer_world(settings.tp_size)
    vllm = import_vllm()
    token = _RawRun()  # the sleep slot holds its owner by weak reference: a plain object() has none
    if settings.enable_sleep:
        claim_sleep_slot(token, "raw vllm.LLM")
    group_seed = settings.seed + (topology.dp_rank if topology is not None else 0)
    llm: Any = None
    try:
        kwargs = build_llm_kwargs(settings, external_launcher=topology is not None, group_seed=group_seed)
        with scoped_environ(start_environ(topology)), preserve_rng_states():  # as ours: only while it starts
            llm = vllm.LLM(**kwargs)
        params = vllm.SamplingParams(
            temperature=0.0,
            max_tokens=max_new_tokens,
            ignore_eos=True,
            detokenize=not settings.skip_tokenizer_init,
            seed=group_seed,
        )
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        llm.generate(prompts, params, use_tqdm=False)
        rates = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            rates.append(tokens / (time.perf_counter() - start))
        return float(statistics.median(rates))
    finally:
        if llm is not None:
            with keep_default_group(topology is not None):
                llm.llm_engine.engine_core.shutdown()
            if topology is None:
                PROCESS_STATE.vllm_world = None
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        release_sleep_slot(token)


class _RawRun:
    """The raw runner's claim on vLLM's one sleep allocator per process."""

    def __repr__(self) -> str:
        return "raw vllm.LLM"
