"""Logprob parity between an engine and transformers on the same tokens, with the bf16 floor beside it.

A bf16 engine cannot match a float32 forward better than transformers' own bf16 forward does: on the tiny
test model that floor is about 0.02 (mean |Δlogprob|). Measuring it in the same test turns "parity" into
a claim that can fail for the right reason: the engine adds error beyond bf16 arithmetic, or drifts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from genengine.protocol import GenerationResult

__all__ = ["PARITY_GOAL", "bf16_copy", "mean_logprob_gap", "parity_bound", "token_logprobs"]

PARITY_GOAL = 0.01
"""Mean |Δlogprob| the GPU engines aim for; where bf16 itself is coarser, the bound is the measured floor."""


def token_logprobs(model: Any, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> list[float]:
    """Log-probabilities ``model`` gives ``token_ids`` after ``prompt_ids`` (one forward pass)."""
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        x = torch.tensor([list(prompt_ids) + list(token_ids)], device=device)
        logits = model(x).logits[0, len(prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(list(token_ids), device=device)[:, None])[:, 0].tolist()


def mean_logprob_gap(results: Sequence[GenerationResult], model: Any, other: Any = None) -> float:
    """Mean |Δ| over every generated token: engine logprobs vs ``model``, or ``other`` vs ``model`` when given."""
    gaps: list[float] = []
    for r in results:
        out = r.outputs[0]
        ref = token_logprobs(model, r.prompt_token_ids, out.token_ids)
        got = token_logprobs(other, r.prompt_token_ids, out.token_ids) if other is not None else out.logprobs
        gaps += [abs(a - b) for a, b in zip(got or [], ref, strict=True)]
    return sum(gaps) / len(gaps)


def bf16_copy(model: Any) -> Any:
    """The same weights in bf16: the precision a bf16 engine computes in."""
    import copy

    import torch

    return copy.deepcopy(model).to(torch.bfloat16).eval()


def parity_bound(floor: float, slack: float = 1.25, *, floor_goal: float = PARITY_GOAL) -> float:
    """What an engine's gap may be: the goal, or ``slack`` times transformers' own bf16 gap if that is larger."""
    return max(floor_goal, slack * floor)
