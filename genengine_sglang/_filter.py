"""Top-k then top-p filtering of logits, so that SGLang samples from, and reports the logprobs of, the
processed distribution.

SGLang 0.5.17 (``layers/sampler.py``) returns ``log(softmax(logits / T))`` for sampled tokens: after
temperature but *before* top-k/top-p renormalisation, because it filters a sorted copy of the probabilities
only to draw the sample. The contract asks for the log-probability under the distribution that was sampled
from. Masking the logits outside the top-k/top-p set before SGLang's sampler runs (a custom logit
processor, applied ahead of temperature) makes both the same: SGLang then samples from, and takes the log
of, the renormalised distribution. The order is the one of vLLM and transformers: top-k first, then top-p
on the renormalised top-k distribution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["mask_top_k_top_p"]


def mask_top_k_top_p(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """``logits`` (rows × vocab) with every token outside its row's top-k/top-p set at -inf.

    ``temperatures`` (> 0), ``top_ks`` (vocab size when off) and ``top_ps`` (1.0 when off) hold one value
    per row. The top-p set is taken on ``softmax(logits / T)`` restricted to the top-k set, and always keeps
    the most likely token. Rows are processed together: one sort of the vocabulary per call.
    """
    import torch

    scaled = logits.float() / temperatures.float().view(-1, 1)
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    vocab = scaled.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).view(1, -1)
    keep = ranks < top_ks.to(device=logits.device, dtype=torch.long).view(-1, 1)
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely tokens
    keep &= before <= top_ps.to(device=logits.device, dtype=probs.dtype).view(-1, 1)
    keep[:, 0] = True
    drop = torch.zeros_like(keep).scatter(-1, order, ~keep)
    return logits.masked_fill(drop, float("-inf"))
