"""The embedded default backend: PyTorch + transformers on the CPU or one CUDA device.

It runs everywhere, so trainers and tests are real without a GPU, and it is the reference the GPU
backends are held to by the conformance suite: processed logprobs computed exactly as the contract says,
seeded sampling that does not depend on batch composition, and a prompt prefix cache that ``load_weights``
must flush (so a stale-cache bug would show here as on SGLang or vLLM).
"""

from __future__ import annotations

import gc
import hashlib
import inspect
import os
import random
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from genengine.base import EngineBase
from genengine.config import EngineConfig, check_options
from genengine.environ import malloc_trim
from genengine.errors import ConfigError, InvalidArgumentError
from genengine.protocol import (
    TAG_KV_CACHE,
    TAG_WEIGHTS,
    FinishReason,
    GenerationOutput,
    GenerationResult,
    SamplingParams,
)
from genengine.weights import DEFAULT_BUCKET_BYTES, WeightInfo

if TYPE_CHECKING:
    import torch

    from genengine.requests import Request

__all__ = ["OPTIONS", "TransformersEngine", "hf_generate_tokens_per_second"]

OPTIONS = (
    "device",
    "max_batch_size",
    "bucket_bytes",
    "attn_implementation",
    "prefix_cache_bytes",
    "keep_prefix_cache_on_sleep",
)
"""Backend options (``EngineConfig.options``) this backend accepts."""

_ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
_TINY_TEMPERATURE = 1e-30
"""Below this a temperature is its T → 0 limit: float32 ``logits / T`` would overflow to inf and give NaN."""
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_STOP_CONTEXT = 4
"""Tokens decoded before the new ones when looking for stop strings: a decoder may treat the first token of
what it decodes specially (SentencePiece drops its leading space), so the new text is read off a decode that
starts this many tokens earlier, minus that earlier part."""


# ---- option checks (all run before anything is loaded) -------------------------------------------------------
def _check_device(device: Any) -> str:
    if not isinstance(device, str) or not _DEVICE_RE.match(device):
        raise ConfigError(f"device={device!r}: allowed are 'cpu', 'cuda' or 'cuda:N'")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} but CUDA is not available here; use device='cpu'")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    return value


def _checkpoint_dtype(model_dir: str) -> str:
    import json

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
        cfg = json.load(fh)
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return str(dtype).removeprefix("torch.")


def _plain_decode(tokenizer: Any) -> Callable[..., str]:
    """``tokenizer.decode``, or the Rust tokenizer's own where transformers' wrapper adds nothing to it.

    Half the cost of a stop-string check is the wrapper (issue 15). It only forwards to the Rust tokenizer
    when neither method is overridden and the space clean-up is off, so the text is the same.
    """
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # older transformers (the GPU images)
        return tokenizer.decode  # type: ignore[no-any-return]
    cls = type(tokenizer)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    )
    return tokenizer._tokenizer.decode if plain else tokenizer.decode  # type: ignore[no-any-return]


def _sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed``: stable across runs and machines."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{index}".encode()).digest()[:8], "little") & (2**63 - 1)


# ---- per-call state ---------------------------------------------------------------------------------------
@dataclass
class _Prefix:
    """A prompt's prefill: per-layer keys and values ``[kv_heads, len, head_dim]`` and the next-token logits."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor
    nbytes: int


class _StopStrings:
    """Finds a row's stop strings as tokens come, decoding a few recent tokens instead of the whole output.

    The rule is the full-decode one: stop after the first token at which ``decode(tokens)`` contains a stop
    string, and cut that text before the earliest one. Decoding everything at every step made long outputs
    quadratic (issue 15). Since the text one token earlier held no stop string, a new one ends in the new
    text, so only the new text and the ``longest - 1`` characters before it are searched.

    The full text up to the last step that ended on a whole character is taken as settled; only its last
    characters are kept (``_tail``). The text after it is a decode from token ``_start`` (``_STOP_CONTEXT``
    or more tokens before that step, where there are any) minus ``_anchor``, what the same decode read at that
    step. A hit found there is decided on the full decode, which also gives the returned text; so is every
    step where the window no longer starts with ``_anchor`` (a decoder that rewrote text behind the newest
    token, as transformers' space clean-up does, or a multi-byte character completed). Settling only
    on whole characters spares a character that arrives in pieces that full decode.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]) -> None:
        self._decode = decode
        self._stops = tuple(stops)
        self._keep = max(len(s) for s in self._stops) - 1
        self._start = 0
        self._anchor = self._tail = ""

    def check(self, tokens: list[int]) -> tuple[str, str] | None:
        """After each new token: (the stop string, the text before it) once the full text holds one, else None."""
        count = len(tokens)
        window = self._decode(tokens[self._start : count])
        if window.startswith(self._anchor):
            searched = self._tail + window[len(self._anchor) :]
            if not any(s in searched for s in self._stops):
                if not window.endswith("\ufffd"):  # a whole character: settle the text up to here
                    self._tail = searched[max(0, len(searched) - self._keep) :]
                    if count - self._start >= 2 * _STOP_CONTEXT:
                        self._start = count - _STOP_CONTEXT
                        window = self._decode(tokens[self._start : count])
                    self._anchor = window
                return None
        text = self._decode(tokens)
        hits = [(text.find(s), s) for s in self._stops if s in text]
        if hits:
            cut, stop = min(hits)
            return stop, text[:cut]
        self._tail = text[max(0, len(text) - self._keep) :]  # no hit after all: settle on the full text
        self._start = max(0, count - _STOP_CONTEXT)
        self._anchor = self._decode(tokens[self._start : count])
        return None


@dataclass
class _Row:
    """One sample being generated."""

    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    stop_reason: str | int | None = None
    text: str | None = None
    stops: _StopStrings | None = None
    _rng: torch.Generator | None = None

    def uniform(self) -> float:
        import torch

        if self._rng is None:
            self._rng = torch.Generator().manual_seed(self.seed)
        return float(torch.rand(1, generator=self._rng).item())


_BUFFER_LAYER: Any = None


def _buffer_layer_class() -> Any:
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


def _greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax, with its logprob under the unscaled distribution (the contract's greedy logprob)."""
    import torch

    tokens = logits.argmax(dim=-1)
    chosen = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, chosen


def _processed_sample(logits: torch.Tensor, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
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
    tiny = [t < _TINY_TEMPERATURE for t in temps]
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


class TransformersEngine(EngineBase):
    """A ``GenerationEngine`` running a transformers causal LM in this process.

    Options: ``device`` ("cpu", "cuda", "cuda:N"), ``max_batch_size`` (rows decoded together),
    ``bucket_bytes``, ``attn_implementation`` (transformers' name, default its own choice),
    ``prefix_cache_bytes`` (prompt KV kept across calls; 0 disables), ``keep_prefix_cache_on_sleep`` (CPU
    only: a level-1 sleep keeps the prefix cache, as SGLang's does, so the flush a load owes while the KV
    cache sleeps can be seen to happen at wake; see ``prefix_cache_hits``). ``mem_util`` is not used: memory
    grows with the batch. Sleep level 1 moves the weights to host memory (on CPU there is nothing to
    move) and drops the prefix cache (unless ``keep_prefix_cache_on_sleep``); level 2 frees the weights'
    storage and the cache.
    """

    supported_tags = (TAG_WEIGHTS, TAG_KV_CACHE)
    validate_all_weights_first = True

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        device: str = "cpu",
        dtype: str = "auto",
        enable_sleep: bool = True,
        seed: int = 0,
        max_batch_size: int = 64,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        attn_implementation: str | None = None,
        prefix_cache_bytes: int = 256 << 20,
        keep_prefix_cache_on_sleep: bool = False,
    ) -> None:
        model_dir = os.fspath(model)
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise ConfigError(f"model={model_dir!r} is not a model directory (no config.json there)")
        device = _check_device(device)
        if dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype={dtype!r}: allowed are auto, bfloat16, float16, float32")
        _check_positive_int("max_batch_size", max_batch_size)
        if attn_implementation is not None and attn_implementation not in _ATTN_IMPLEMENTATIONS:
            raise ConfigError(
                f"attn_implementation={attn_implementation!r}: allowed are {', '.join(_ATTN_IMPLEMENTATIONS)} or None"
            )
        if isinstance(prefix_cache_bytes, bool) or not isinstance(prefix_cache_bytes, int) or prefix_cache_bytes < 0:
            raise ConfigError(f"prefix_cache_bytes={prefix_cache_bytes!r} must be an integer >= 0")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"seed={seed!r} must be an integer")
        if not isinstance(keep_prefix_cache_on_sleep, bool):
            raise ConfigError(f"keep_prefix_cache_on_sleep={keep_prefix_cache_on_sleep!r} must be true or false")
        if keep_prefix_cache_on_sleep and device != "cpu":
            raise ConfigError(
                "keep_prefix_cache_on_sleep=True needs device='cpu': on a GPU the kept cache would stay in the "
                "device memory that a sleep must free"
            )
        super().__init__(sleep_enabled=enable_sleep, bucket_bytes=bucket_bytes)

        import torch
        import transformers

        self.model_dir = model_dir
        self.device = torch.device(device)
        self.dtype = getattr(torch, _checkpoint_dtype(model_dir) if dtype == "auto" else dtype)
        self.max_batch_size = max_batch_size
        self.prefix_cache_bytes = prefix_cache_bytes
        self.keep_prefix_cache_on_sleep = keep_prefix_cache_on_sleep
        self._rng = random.Random(seed)

        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()
        try:
            self._tokenizer: Any = transformers.AutoTokenizer.from_pretrained(model_dir)
            kwargs: dict[str, Any] = {"dtype": self.dtype}
            if attn_implementation is not None:
                kwargs["attn_implementation"] = attn_implementation
            model_obj: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
        model_obj.to(self.device).eval().requires_grad_(False)
        self._model: Any = model_obj
        cfg = self._model.config.get_text_config(decoder=True)
        self._config = self._model.config
        # transformers renamed ``past_key_values`` to ``cache`` (5.2x); the GPU images run older releases.
        forward_params = inspect.signature(self._model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self._attn = str(getattr(self._config, "_attn_implementation", None) or "")
        self._vocab = int(cfg.vocab_size)
        self._max_len = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)

        eos: set[int] = set()
        for source in (self._model.generation_config.eos_token_id, self._tokenizer.eos_token_id):
            if isinstance(source, int):
                eos.add(source)
            elif isinstance(source, (list, tuple)):
                eos.update(int(t) for t in source)
        self._eos = frozenset(eos)
        self._decode_fn = _plain_decode(self._tokenizer)
        pad = self._tokenizer.pad_token_id
        self._pad = int(pad if pad is not None else min(eos, default=0))

        # Parameters by every HF name (a tied lm_head appears under both names, as one Parameter).
        self._params = dict(self._model.named_parameters(remove_duplicate=False))
        seen: dict[int, str] = {}
        spec: dict[str, WeightInfo] = {}
        for name, tensor in self._model.state_dict().items():
            alias = id(self._params[name]) in seen if name in self._params else False
            spec[name] = WeightInfo(
                shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."), required=not alias
            )
            if name in self._params:
                seen.setdefault(id(self._params[name]), name)
        self._spec = spec
        self._unique_params = list({id(p): p for p in self._params.values()}.values())
        self._shapes = [tuple(p.shape) for p in self._unique_params]
        self._host_backup: list[torch.Tensor] | None = None
        self._prefixes: OrderedDict[tuple[int, ...], _Prefix] = OrderedDict()
        self._prefix_nbytes = 0
        self._prefix_hits = 0

    @classmethod
    def from_config(cls, config: Any) -> TransformersEngine:
        """Build from an ``EngineConfig`` (the registry's factory); options are checked before loading."""
        config = EngineConfig.from_any(config)
        check_options("transformers", config.options, OPTIONS)
        if config.tp_size != 1:
            raise ConfigError(f"tp_size={config.tp_size}: the transformers backend runs on one device (tp_size=1)")
        if config.model is None:
            raise ConfigError("the transformers backend needs a model: pass model=PATH")
        return cls(
            config.model,
            dtype=config.dtype,
            enable_sleep=config.enable_sleep,
            seed=config.seed,
            **dict(config.options),
        )

    # ---- introspection -------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model(self) -> Any:
        """The underlying transformers model (read-only use: its weights belong to the engine)."""
        return self._model

    @property
    def prefix_cache_hits(self) -> int:
        """Prompts whose prefill came from the prefix cache, since the engine started.

        Counted per distinct prompt of a ``generate`` call. The conformance suite reads it (an optional
        attribute of any engine) to see that a flush really empties the cache.
        """
        return self._prefix_hits

    def _vocab_size(self) -> int | None:
        return self._vocab

    def _weight_spec(self) -> Mapping[str, WeightInfo]:
        return self._spec

    # ---- generate ------------------------------------------------------------------------------------------
    def _encode(self, request: Request) -> tuple[int, ...]:
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        ids = tuple(int(t) for t in self._tokenizer.encode(request.prompt))
        if not ids:
            raise InvalidArgumentError(f"prompts[{request.index}]={request.prompt!r} encodes to no tokens")
        return ids

    def _generate(self, requests: list[Request]) -> list[GenerationResult]:
        import torch

        prompts = [self._encode(r) for r in requests]
        for r, ids in zip(requests, prompts, strict=True):
            if len(ids) + r.params.max_new_tokens > self._max_len:
                raise InvalidArgumentError(
                    f"prompt {r.index} has {len(ids)} tokens; with max_new_tokens={r.params.max_new_tokens} it "
                    f"exceeds the model's context of {self._max_len} tokens"
                )
        rows: list[list[_Row]] = []
        for r, ids in zip(requests, prompts, strict=True):
            p = r.params
            rows.append(
                [
                    _Row(ids, p, _sample_seed(p.seed, j) if p.seed is not None else self._rng.getrandbits(63))
                    for j in range(p.n)
                ]
            )
        flat = [row for per_request in rows for row in per_request]
        with torch.inference_mode():
            prefixes = self._prefill(list(dict.fromkeys(prompts)))
            # Rows of similar prompt length decode together: less padding.
            ordered = sorted(flat, key=lambda row: len(row.prompt))
            for start in range(0, len(ordered), self.max_batch_size):
                self._decode(ordered[start : start + self.max_batch_size], prefixes)
        return [
            GenerationResult(
                prompt_token_ids=list(ids),
                outputs=[
                    GenerationOutput(
                        token_ids=row.tokens,
                        text=row.text,
                        finish_reason=row.finish or "length",
                        logprobs=row.logprobs if row.params.logprobs else None,
                        stop_reason=row.stop_reason,
                    )
                    for row in per_request
                ],
            )
            for ids, per_request in zip(prompts, rows, strict=True)
        ]

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self._config)

    def _prefill(self, prompts: list[tuple[int, ...]]) -> dict[tuple[int, ...], _Prefix]:
        """KV and next-token logits of each distinct prompt, from the prefix cache or computed in batches."""
        import torch

        found: dict[tuple[int, ...], _Prefix] = {}
        todo = []
        for ids in prompts:
            hit = self._prefixes.get(ids)
            if hit is not None:
                self._prefixes.move_to_end(ids)
                found[ids] = hit
                self._prefix_hits += 1
            else:
                todo.append(ids)
        todo.sort(key=len)
        for start in range(0, len(todo), self.max_batch_size):
            batch = todo[start : start + self.max_batch_size]
            width = max(len(ids) for ids in batch)
            input_ids = torch.full((len(batch), width), self._pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for b, ids in enumerate(batch):
                input_ids[b, width - len(ids) :] = torch.tensor(ids)
                mask[b, width - len(ids) :] = 1
            input_ids, mask = input_ids.to(self.device), mask.to(self.device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            cache = self._new_cache()
            out = self._model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kwarg: cache},
            )
            logits = out.logits[:, -1].float()
            layers = cache.layers
            for b, ids in enumerate(batch):
                keep = slice(width - len(ids), width)
                keys = [layer.keys[b, :, keep].clone() for layer in layers]
                values = [layer.values[b, :, keep].clone() for layer in layers]
                nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values))
                entry = _Prefix(keys, values, logits[b].clone(), nbytes)
                found[ids] = entry
                self._remember(ids, entry)
        return found

    def _remember(self, ids: tuple[int, ...], entry: _Prefix) -> None:
        if entry.nbytes > self.prefix_cache_bytes:
            return
        self._prefixes[ids] = entry
        self._prefix_nbytes += entry.nbytes
        while self._prefix_nbytes > self.prefix_cache_bytes:
            _, old = self._prefixes.popitem(last=False)
            self._prefix_nbytes -= old.nbytes

    def _decode(self, rows: list[_Row], prefixes: dict[tuple[int, ...], _Prefix]) -> None:
        """Decode rows together: left-padded prompt KV in buffers sized for the whole run, written in place."""
        import torch

        width = max(len(row.prompt) for row in rows)
        capacity = width + max(row.params.max_new_tokens for row in rows)
        batch = len(rows)
        first = prefixes[rows[0].prompt]
        cache = self._new_cache()
        layers = []
        for layer in range(len(first.keys)):
            kv_heads, _, head_dim = first.keys[layer].shape
            keys = first.keys[layer].new_zeros((batch, kv_heads, capacity, head_dim))
            values = torch.zeros_like(keys)
            for b, row in enumerate(rows):
                entry = prefixes[row.prompt]
                keys[b, :, width - len(row.prompt) : width] = entry.keys[layer]
                values[b, :, width - len(row.prompt) : width] = entry.values[layer]
            layers.append(_buffer_layer_class()(keys, values, width))
        cache.layers = layers
        # The attention mask as the attention kernel takes it ([batch, 1, 1, keys]), extended in place.
        allowed = torch.zeros((batch, 1, 1, capacity), dtype=torch.bool)
        for b, row in enumerate(rows):
            allowed[b, :, :, width - len(row.prompt) : width] = True
        allowed = allowed.to(self.device)
        positions = torch.tensor([len(row.prompt) for row in rows], device=self.device)
        logits = torch.stack([prefixes[row.prompt].logits for row in rows])
        active = list(range(batch))
        length = width
        while True:
            live = [rows[i] for i in active]
            tokens = self._sample(logits, live)
            keep = [j for j, row in enumerate(live) if self._advance(row)]
            if not keep:
                return
            if len(keep) < len(active):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                allowed, positions, tokens = allowed[index], positions[index], tokens[index]
                active = [active[j] for j in keep]
            allowed[:, :, :, length] = True
            length += 1
            out = self._model(
                input_ids=tokens[:, None],
                attention_mask=self._decode_mask(allowed[:, :, :, :length]),
                position_ids=positions[:, None],
                use_cache=True,
                **{self._cache_kwarg: cache},
            )
            logits = out.logits[:, -1].float()
            positions = positions + 1

    def _decode_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """A ready 4-D mask (transformers passes those through untouched) where the kernel's format is known."""
        import torch

        if self._attn == "sdpa":
            return allowed
        if self._attn == "eager":
            zero = torch.zeros((), dtype=self.dtype, device=allowed.device)
            return torch.where(allowed, zero, torch.finfo(self.dtype).min)
        return allowed[:, 0, 0].long()  # other kernels: the plain 2-D padding mask

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Pick each row's next token and record its processed logprob; returns the tokens."""
        import torch

        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not sampled:
            tokens, chosen = _greedy(logits)
        elif len(sampled) == len(rows):
            tokens, chosen = _processed_sample(logits, rows)
        else:
            tokens, chosen = _greedy(logits)
            index = torch.tensor(sampled, device=logits.device)
            pick, picked = _processed_sample(logits[index], [rows[i] for i in sampled])
            tokens = tokens.index_put((index,), pick)
            chosen = chosen.index_put((index,), picked)
        for row, tok, lp in zip(rows, tokens.tolist(), chosen.tolist(), strict=True):
            row.tokens.append(tok)
            row.logprobs.append(lp)
        return tokens

    def _advance(self, row: _Row) -> bool:
        """Apply the stop rules to a row's newest token; True while the row goes on."""
        p = row.params
        tok = row.tokens[-1]

        if not p.ignore_eos and tok in self._eos:
            row.finish = "stop"
        elif tok in p.stop_token_ids:
            row.finish, row.stop_reason = "stop", tok
        if row.finish is not None:
            row.text = self._decode_text(row.tokens[:-1])
            return False
        if p.stop:
            if row.stops is None:
                row.stops = _StopStrings(self._decode_text, p.stop)
            hit = row.stops.check(row.tokens)
            if hit is not None:
                row.finish = "stop"
                row.stop_reason, row.text = hit
                return False
        if len(row.tokens) >= p.max_new_tokens:
            row.finish = "length"
            row.text = self._decode_text(row.tokens)
            return False
        return True

    def _decode_text(self, ids: list[int]) -> str:
        """``tokenizer.decode(ids, skip_special_tokens=True)``: the text of an output."""
        return str(self._decode_fn(ids, skip_special_tokens=True))

    # ---- memory --------------------------------------------------------------------------------------------
    def _drop_prefixes(self) -> None:
        self._prefixes.clear()
        self._prefix_nbytes = 0

    def _free_device_memory(self) -> None:
        import torch

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        else:
            malloc_trim()  # so that a level-2 sleep shows in RSS on CPU

    def _release(self, level: int) -> None:
        import torch

        if level == 2 or not self.keep_prefix_cache_on_sleep:
            self._drop_prefixes()
        if level == 2:
            for p in self._unique_params:
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        elif self.device.type == "cuda":
            self._host_backup = [
                torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p.data) for p in self._unique_params
            ]
            for p in self._unique_params:
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self._free_device_memory()

    def _resume(self, tags: tuple[str, ...]) -> None:
        import torch

        if TAG_WEIGHTS not in tags:
            return  # the KV cache is allocated per call: nothing to take back
        if self._host_backup is not None:
            for p, host in zip(self._unique_params, self._host_backup, strict=True):
                p.data = host.to(self.device, non_blocking=True)
            self._host_backup = None
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        elif self.sleep_level == 2:
            for p, shape in zip(self._unique_params, self._shapes, strict=True):
                p.data = torch.empty(shape, dtype=p.dtype, device=self.device)

    # ---- weights -------------------------------------------------------------------------------------------
    def _apply_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        import torch

        with torch.no_grad():
            for name, tensor in bucket:
                self._params[name].data.copy_(tensor, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _flush_cache(self) -> None:
        self._drop_prefixes()

    def _shutdown(self) -> None:
        self._drop_prefixes()
        self._host_backup = None
        self._params = {}
        self._unique_params = []
        self._model = None
        self._free_device_memory()


def hf_generate_tokens_per_second(config: Any, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int) -> float:
    """Tokens/s of plain transformers ``generate`` (greedy, no EOS stop) on the engine's model and device.

    ``genengine bench``'s raw runner for this backend: the same prompts, left-padded into one batch.
    """
    import torch
    import transformers

    config = EngineConfig.from_any(config)
    device = _check_device(config.options.get("device", "cpu"))
    if config.model is None:
        raise ConfigError("hf_generate_tokens_per_second needs config.model")
    dtype = getattr(torch, _checkpoint_dtype(config.model) if config.dtype == "auto" else config.dtype)
    model, mask, input_ids = _hf_model_and_batch(config.model, dtype, device, prompt_token_ids)
    pad = model.generation_config.pad_token_id
    gen = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad if pad is not None else 0
    )
    model.generation_config.eos_token_id = None  # as ignore_eos: every row runs max_new_tokens
    with torch.inference_mode():
        model.generate(input_ids=input_ids, attention_mask=mask, generation_config=gen)  # warm-up
        start = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=gen)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return (out.shape[1] - input_ids.shape[1]) * out.shape[0] / seconds


def _hf_model_and_batch(
    model_dir: str, dtype: torch.dtype, device: str, prompt_token_ids: Sequence[Sequence[int]]
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    import torch
    import transformers

    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        model.to(device).eval()
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    width = max(len(p) for p in prompt_token_ids)
    input_ids = torch.zeros((len(prompt_token_ids), width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for b, ids in enumerate(prompt_token_ids):
        input_ids[b, width - len(ids) :] = torch.tensor(list(ids))
        mask[b, width - len(ids) :] = 1
    return model, mask.to(device), input_ids.to(device)
