"""The raw runner ``genengine bench`` calls to show the template's loop beside the adapted engine."""

from __future__ import annotations

from collections.abc import Sequence

from genengine.backend import EngineConfig, torch_dtype
from genengine.errors import ConfigError


def raw_tokens_per_second(
    config: EngineConfig, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int
) -> float:
    """Greedy tokens per second of ``TinyLoop`` alone, with no genengine code on the path."""
    import torch

    from genengine_template.loop import TinyLoop, greedy_tokens_per_second

    if config.model is None:
        raise ConfigError("the template's raw runner needs model=PATH")
    device = config.options.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    loop = TinyLoop(config.model, dtype=torch_dtype(config.dtype, config.model), device=device)
    try:
        greedy_tokens_per_second(loop, prompt_token_ids[:1], 1)  # warm-up
        return greedy_tokens_per_second(loop, prompt_token_ids, max_new_tokens)
    finally:
        loop.close()
