"""The embedded backend's decode-step pieces: a sample's row, greedy and processed sampling, the KV buffers.

Kept apart from ``transformers.py`` (the engine: loading, prefill, decode loop, memory) so that each reads
in one sitting; only that module uses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from genengine.backend import Completion, SamplingParams

if TYPE_CHECKING:
    import torch

    from genengine.backend import AsyncRequest
    from genengine.backends.transformers._lora import LoraWeights

PrefixKey = tuple["LoraWeights | None", tuple[int, ...]]
"""A prefill's cache key: the adapter (None: the base) and the token ids."""

__all__ = ["TINY_TEMPERATURE", "PrefixKey", "Row", "buffer_layer_class", "greedy", "processed_sample"]

TINY_TEMPERATURE = 1e-30
"""Below this a temperature is its T → 0 limit: float32 ``logits / T`` would overflow to inf and give NaN."""


@dataclass
class Row:
    """One sample being generated: its prompt, its seed, and its tokens so far under the stop rules."""

    prompt: tuple[int, ...]
    seed: int
    out: Completion
    sink: AsyncRequest | None = None
    """The async request this row is completion ``index`` of (None for a synchronous ``generate``)."""
    index: int = 0
    emitted: int = 0
    _rng: torch.Generator | None = None
    lora: LoraWeights | None = None
    """The adapter this row is generated with (None: the base model)."""

    @property
    def params(self) -> SamplingParams:
        return self.out.params

    @property
    def context(self) -> tuple[int, ...]:
        """What the next token is sampled after: the prompt and every token so far."""
        return self.prompt + tuple(self.out.tokens) if self.out.tokens else self.prompt

    @property
    def key(self) -> PrefixKey:
        """The context's prefill as the prefix cache knows it: per adapter, since the KV differs."""
        return (self.lora, self.context)

    def report(self) -> None:
        """Hand an async request the tokens it has not seen, and the finish once there is one."""
        if self.sink is None:
            return
        out = self.out
        if len(out.tokens) > self.emitted:
            new = slice(self.emitted, len(out.tokens))
            self.sink.emit(self.index, out.tokens[new], out.logprobs[new])
            self.emitted = len(out.tokens)
        if out.finish_reason is not None:
            self.sink.finish(self.index, out.finish_reason, stop_reason=out.stop_reason, text=out.text)

    def uniform(self) -> float:
        import torch

        if self._rng is None:
            self._rng = torch.Generator().manual_seed(self.seed)
        return float(torch.rand(1, generator=self._rng).item())


_BUFFER_LAYER: Any = None


def buffer_layer_class() -> Any:
    """A transformers cache layer over preallocated buffers: decode writes in place instead of concatenating."""
    global _BUFFER_LAYER
    if _BUFFER_LAYER is not None:
        return _BUFFER_LAYER
    from transformers.cache_utils import DynamicLayer

    class BufferLayer(DynamicLayer):  # type: ignore[misc]
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
            super().__init__()
            self._k, self._v, self._n = keys, values, length
            self.device, self.dtype = keys.device, keys.dtype
            self.is_initialized = True
            self._views()

        def _views(self) -> None:
            self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]

        def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
            pass

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            new = key_states.shape[-2]
            self._k[:, :, self._n : self._n + new] = key_states
            self._v[:, :, self._n : self._n + new] = value_states
            self._n += new
            self._views()
            return self.keys, self.values

        def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
            return int(self._n)

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self._k, self._v = self._k[indices], self._v[indices]
            self._views()

    _BUFFER_LAYER = BufferLayer
    return BufferLayer


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax, with its logprob under the unscaled distribution (the contract's greedy logprob)."""
    import torch

    tokens = logits.argmax(dim=-1)
    chosen = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, chosen


def processed_sample(logits: torch.Tensor, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, then top-k, then top-p (transformers' order and tie rules); sample by each row's own RNG.

    Inverse-CDF sampling with one uniform per row from the row's generator: a seeded row draws the same
    numbers whatever else is in the batch. Returns the tokens and their processed logprobs.
    """
    import torch

    device = logits.device
    params = [row.params for row in rows]
    vocab = logits.shape[-1]
    temps = [p.temperature for p in params]
    scores = logits / torch.tensor(temps, device=device)[:, None]
    tiny = [t < TINY_TEMPERATURE for t in temps]
    if any(tiny):  # logits / T overflows (or T rounds to 0): use the limit, all mass on the argmax (ties shared)
        limit = torch.where(logits == logits.amax(dim=-1, keepdim=True), 0.0, -float("inf"))
        scores = torch.where(torch.tensor(tiny, device=device)[:, None], limit, scores)
    ks = [p.top_k_or_none or 0 for p in params]
    if any(0 < k < vocab for k in ks):
        kmax = min(max(ks), vocab)
        top = torch.topk(scores, kmax, dim=-1).values
        kth = top.gather(1, (torch.tensor(ks, device=device).clamp(1, kmax) - 1)[:, None])
        kth[torch.tensor([not 0 < k < vocab for k in ks], device=device)] = -float("inf")
        scores = scores.masked_fill(scores < kth, -float("inf"))  # ties with the k-th are kept
    if any(p.top_p < 1 for p in params):
        # As transformers' TopPLogitsWarper: drop the least likely tokens whose total mass is <= 1 - top_p.
        order_vals, order = torch.sort(scores, dim=-1)
        cum = order_vals.softmax(dim=-1).cumsum(dim=-1)
        limit = torch.tensor([1 - p.top_p if p.top_p < 1 else -1.0 for p in params], device=device)
        remove = cum <= limit[:, None]
        remove[:, -1] = False
        scores = scores.masked_fill(remove.scatter(1, order, remove), -float("inf"))
    logp = torch.log_softmax(scores, dim=-1)
    cdf = logp.exp().cumsum(dim=-1)
    u = torch.tensor([row.uniform() for row in rows], dtype=cdf.dtype, device=device)
    # right=True: the first index whose cdf exceeds u*total, never a token of probability 0.
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=vocab - 1)
    picked = logp.gather(1, pick[:, None])[:, 0]
    bad = torch.isinf(picked)  # only when u*total rounds up to the total: take the most likely token
    if bool(bad.any()):
        pick = torch.where(bad, logp.argmax(dim=-1), pick)
        picked = logp.gather(1, pick[:, None])[:, 0]
    return pick, picked
