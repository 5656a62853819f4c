"""The custom logit processor SGLang runs for requests with top-k/top-p (see ``_filter``).

Imported only where SGLang is installed: on the TP leader, to serialise the processor once, and in the
scheduler processes, which import it by reference when they deserialise it.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

from genengine_sglang._filter import mask_top_k_top_p
from genengine_sglang.settings import LOGIT_PROCESSOR_PARAM

__all__ = ["ProcessedLogprobFilter", "serialized_processor"]


class ProcessedLogprobFilter(CustomLogitProcessor):
    """Masks each row's logits to its request's top-k/top-p set (parameters in ``custom_params``)."""

    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None) -> torch.Tensor:
        if not custom_param_list:
            return logits
        params = [p.get(LOGIT_PROCESSOR_PARAM) if p else None for p in custom_param_list]
        if any(p is None for p in params):  # rows of other processors' requests are never mixed in here
            return logits
        vocab = logits.shape[-1]
        temps = torch.tensor([p["t"] for p in params], dtype=torch.float32, device=logits.device)  # type: ignore[index]
        ks = torch.tensor([min(p["k"] or vocab, vocab) for p in params], device=logits.device)  # type: ignore[index]
        ps = torch.tensor([p["p"] for p in params], dtype=torch.float32, device=logits.device)  # type: ignore[index]
        return mask_top_k_top_p(logits, temps, ks, ps)


_SERIALIZED: str | None = None


def serialized_processor() -> str:
    """``ProcessedLogprobFilter.to_str()``, computed once (it is the same string for every request)."""
    global _SERIALIZED
    if _SERIALIZED is None:
        _SERIALIZED = ProcessedLogprobFilter.to_str()
    return _SERIALIZED
