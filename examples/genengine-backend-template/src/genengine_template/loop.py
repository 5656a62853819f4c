"""The template's own engine: a deliberately small sampling loop over a Hugging Face causal LM.

It stands for *your* engine and knows nothing about genengine. It runs one full forward pass per new
token (no KV cache, no batching), which keeps it short enough to read in one sitting; ``engine.py``
adapts it to the ``GenerationEngine`` protocol.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["TinyLoop", "pick_token"]


def pick_token(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[int, float]:
    """Choose the next token and return it with its *processed* log-probability.

    Processed = under the distribution actually sampled from (after temperature, top-k, top-p and
    renormalisation), which is what an RL trainer's importance ratio needs. Greedy (temperature 0)
    reports the unscaled distribution, as vLLM and SGLang do.
    """
    logits = logits.float()
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        return token, float(logp[token])
    scores = logits / temperature
    if top_k is not None and top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first one always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False
        scores = scores.clone()
        scores[order[drop]] = float("-inf")
    logp = torch.log_softmax(scores, dim=-1)
    token = int(torch.multinomial(logp.exp().cpu(), 1, generator=generator))
    return token, float(logp[token])


class TinyLoop:
    """One model, one sequence at a time, a full forward per token."""

    def __init__(self, model_path: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        self.model = model.to(self.device).eval()
        # Without tokenizer files, token-id prompts still work (and transformers would invent an empty one).
        files = ("tokenizer.json", "tokenizer_config.json")
        has_tokenizer = any(os.path.exists(os.path.join(model_path, f)) for f in files)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_path) if has_tokenizer else None
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.vocab_size: int = self.model.get_input_embeddings().num_embeddings
        self.max_positions: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self._host_copy: dict[str, torch.Tensor] | None = None
        # A small prefix cache: prompt -> logits of its last position. It stands for an engine's KV/prefix
        # cache, and like one it must be flushed when the weights change, or it serves the old model.
        self.prefix_cache: dict[tuple[int, ...], torch.Tensor] | None = {}
        self._shapes = {n: (tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()}

    @torch.inference_mode()
    def stream(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> Iterator[tuple[int, float]]:
        """Yield (token, processed logprob) until ``max_new_tokens`` or the context is full; the caller stops early."""
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        key = tuple(prompt_ids)
        for step in range(max_new_tokens):
            if self.max_positions is not None and ids.shape[1] >= self.max_positions:
                return
            cached = self.prefix_cache.get(key) if step == 0 and self.prefix_cache is not None else None
            logits = cached if cached is not None else self.model(input_ids=ids).logits[0, -1]
            if step == 0 and self.prefix_cache is not None:
                self.prefix_cache[key] = logits
            token, logprob = pick_token(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            yield token, logprob
            ids = torch.cat([ids, torch.tensor([[token]], device=self.device)], dim=1)

    # ---- memory: what an engine's "release/resume memory occupation" does -------------------------
    def release_cache(self) -> None:
        self.prefix_cache = None

    def resume_cache(self) -> None:
        self.prefix_cache = {}

    def flush_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def release_weights(self, *, keep_host_copy: bool) -> None:
        """Give the weights' memory back; with ``keep_host_copy`` they can be restored as they were."""
        params = dict(self.model.named_parameters())
        if keep_host_copy:
            # On CPU the weights already live in host memory: the "copy" is the tensor itself.
            self._host_copy = {
                n: p.data if self.device.type == "cpu" else p.data.to("cpu", copy=True) for n, p in params.items()
            }
        else:
            self._host_copy = None
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def restore_weights(self) -> None:
        """Take the memory back: the saved copy if there is one, otherwise uninitialised tensors to be loaded."""
        for name, p in self.model.named_parameters():
            shape, dtype = self._shapes[name]
            if self._host_copy is not None:
                p.data = self._host_copy[name].to(self.device)
            else:
                p.data = torch.empty(shape, dtype=dtype, device=self.device)
        self._host_copy = None

    @torch.inference_mode()
    def write_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one (already checked) tensor into the parameter of that name (tied aliases included)."""
        target = self.model.get_parameter(name) if name in self._shapes else self._alias(name)
        target.data.copy_(tensor.to(device=self.device, dtype=target.dtype))

    def _alias(self, name: str) -> torch.nn.Parameter:
        for alias, p in self.model.named_parameters(remove_duplicate=False):
            if alias == name:
                return p
        raise KeyError(name)

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def greedy_tokens_per_second(loop: TinyLoop, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> float:
    """Raw throughput of the loop alone, for ``genengine bench`` to show beside the adapted engine."""
    start = time.perf_counter()
    tokens = sum(len(list(loop.stream(p, max_new_tokens=max_new_tokens, temperature=0))) for p in prompts)
    return tokens / (time.perf_counter() - start)
