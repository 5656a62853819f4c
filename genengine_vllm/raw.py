"""The raw ``vllm.LLM`` that ``genengine bench`` measures beside ours: same settings, no genengine code."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

from genengine.backend import EngineConfig

__all__ = ["RawVLLMEngine", "raw_tokens_per_second"]


class RawVLLMEngine:
    """A plain ``vllm.LLM`` built with the arguments ours would use, kept alive: the plugin's ``raw_engine``,
    which ``genengine bench`` runs in a child process and pairs with ours (greedy, EOS ignored).

    It claims the process's one sleep allocator as ours does, so it must not overlap a live sleep-mode
    engine in the same process.
    """

    def __init__(self, config: Any) -> None:
        from genengine.distributed import group_seed
        from genengine.engine.environ import scoped_environ
        from genengine_vllm._process import (
            claim_sleep_slot,
            import_vllm,
            preserve_rng_states,
            start_environ,
            trainer_world,
        )
        from genengine_vllm.settings import build_llm_kwargs, resolve_settings

        settings = resolve_settings(EngineConfig.from_any(config))
        self._topology = trainer_world(settings.tp_size)
        self._vllm = import_vllm()
        self._detokenize = not settings.skip_tokenizer_init
        self._seed = group_seed(settings.seed, self._topology)
        self._token = _RawRun()  # the sleep slot holds its owner by weak reference: a plain object() has none
        self._claimed = settings.enable_sleep
        if self._claimed:
            claim_sleep_slot(self._token, "raw vllm.LLM")
        self.llm: Any = None
        try:
            kwargs = build_llm_kwargs(settings, external_launcher=self._topology is not None, group_seed=self._seed)
            with scoped_environ(start_environ(self._topology)), preserve_rng_states():  # as ours: only while it starts
                self.llm = self._vllm.LLM(**kwargs)
            if self._claimed:
                from genengine_vllm.compat import release_cumem_pools_at_exit

                release_cumem_pools_at_exit()
        except BaseException:
            self.close()
            raise

    def generate_tokens(self, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int) -> int:
        import torch

        params = self._vllm.SamplingParams(
            temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, detokenize=self._detokenize, seed=self._seed
        )
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_token_ids], params, use_tqdm=False)
        torch.cuda.synchronize()
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    def close(self) -> None:
        import torch

        from genengine_vllm._process import (
            PROCESS_STATE,
            drop_cuda_graphs,
            fresh_graph_pool,
            keep_default_group,
            release_sleep_slot,
        )

        if self.llm is not None:
            drop_cuda_graphs()  # as ours: the next engine of this process captures into a pool of its own
            with keep_default_group(self._topology is not None):
                self.llm.llm_engine.engine_core.shutdown()
            if self._topology is None:
                PROCESS_STATE.vllm_world = None
            if self._claimed:
                from genengine_vllm.compat import release_cumem_pools

                release_cumem_pools()
            self.llm = None
            gc.collect()
            torch.cuda.empty_cache()
            fresh_graph_pool()
        if self._claimed:
            release_sleep_slot(self._token)
            self._claimed = False


def raw_tokens_per_second(config: Any, prompt_token_ids: list[list[int]], max_new_tokens: int) -> float:
    """Greedy output tokens per second of a plain ``vllm.LLM`` built with the arguments ours would use.

    One warm-up run, then the median of three. Runs in this process, so it must not overlap a live
    sleep-mode engine (vLLM allows one per process; the same check as ours refuses it).
    """
    import statistics

    import torch

    raw = RawVLLMEngine(config)
    try:
        raw.generate_tokens(prompt_token_ids, max_new_tokens)
        rates = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            tokens = raw.generate_tokens(prompt_token_ids, max_new_tokens)
            rates.append(tokens / (time.perf_counter() - start))
        return float(statistics.median(rates))
    finally:
        raw.close()


class _RawRun:
    """The raw runner's claim on vLLM's one sleep allocator per process."""

    def __repr__(self) -> str:
        return "raw vllm.LLM"
