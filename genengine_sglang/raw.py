"""The raw ``sglang.Engine``, for ``genengine bench``'s comparison: same settings, no genengine in the loop."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["RawSGLangEngine", "raw_tokens_per_second", "start_raw_engine", "stop_raw_engine"]


def start_raw_engine(config: Any, **overrides: Any) -> Any:
    """An ``sglang.Engine`` with the server arguments genengine would use for ``config`` (minus its hooks)."""
    from genengine.backend import EngineConfig
    from genengine_sglang._process import current_gpu, engine_environment
    from genengine_sglang.settings import resolve_settings, server_kwargs

    settings = resolve_settings(EngineConfig.from_any(config))
    gpu = settings.base_gpu_id if settings.base_gpu_id is not None else (current_gpu() or 0)
    kwargs = server_kwargs(settings, base_gpu_id=gpu, port=settings.base_port, group_seed=settings.seed)
    for ours in ("custom_weight_loader", "enable_custom_logit_processor"):
        kwargs.pop(ours)
    kwargs.update(overrides)
    from sglang.srt.entrypoints.engine import Engine

    with engine_environment(settings.enable_sleep):
        return Engine(**kwargs)


def stop_raw_engine(engine: Any) -> None:
    from genengine_sglang._process import stop_sglang

    stop_sglang(engine)


def raw_tokens_per_second(config: Any, prompt_token_ids: list[list[int]], max_new_tokens: int) -> float:
    """Greedy output tokens per second of the raw engine on ``prompt_token_ids`` (after one warm-up)."""
    engine = start_raw_engine(config)
    try:
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        engine.generate(input_ids=[list(p) for p in prompt_token_ids], sampling_params=params)
        start = time.perf_counter()
        outs = engine.generate(input_ids=[list(p) for p in prompt_token_ids], sampling_params=params)
        seconds = time.perf_counter() - start
        return sum(int(o["meta_info"]["completion_tokens"]) for o in outs) / seconds
    finally:
        stop_raw_engine(engine)


class RawSGLangEngine:
    """The raw ``sglang.Engine`` kept alive: the plugin's ``raw_engine``, which ``genengine bench`` runs in a
    child process and pairs with ours (greedy, EOS ignored)."""

    def __init__(self, config: Any) -> None:
        self.engine = start_raw_engine(config)

    def generate_tokens(self, prompt_token_ids: Any, max_new_tokens: int) -> int:
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        outs = self.engine.generate(input_ids=[list(p) for p in prompt_token_ids], sampling_params=params)
        return sum(int(o["meta_info"]["completion_tokens"]) for o in outs)

    def close(self) -> None:
        stop_raw_engine(self.engine)
