"""``TemplateEngine``: the template's loop behind the ``GenerationEngine`` protocol.

``genengine.base.EngineBase`` already does the argument checks, the sleep/wake/load state machine,
weight validation and bucketing; a backend only fills in the ``_methods`` below with calls into its
own engine. Everything that is not possible (images, tensor parallelism) is rejected up front with an
error naming the value.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from genengine.base import EngineBase
from genengine.config import EngineConfig, check_options
from genengine.errors import ConfigError, InvalidArgumentError
from genengine.protocol import TAG_KV_CACHE, TAG_WEIGHTS, GenerationOutput, GenerationResult, SamplingParams
from genengine.weights import DEFAULT_BUCKET_BYTES, WeightInfo

if TYPE_CHECKING:
    import torch

    from genengine.requests import Request
    from genengine_template.loop import TinyLoop

__all__ = ["OPTIONS", "TemplateEngine"]

OPTIONS = ("device", "bucket_bytes")
"""Backend-specific settings this backend accepts under ``EngineConfig.options``."""


def _torch_dtype(name: str, model_path: str) -> torch.dtype:
    import torch

    if name == "auto":
        from transformers import AutoConfig

        found = getattr(AutoConfig.from_pretrained(model_path), "dtype", None)
        return found if isinstance(found, torch.dtype) else torch.float32
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def _check_device(device: str) -> str:
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"option device={device!r} is not a device; allowed: 'cpu', 'cuda', 'cuda:N'") from exc
    if parsed.type not in ("cpu", "cuda"):
        raise ConfigError(f"option device={device!r}: allowed are 'cpu', 'cuda', 'cuda:N'")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"option device={device!r} but no CUDA device is available; use device='cpu'")
    return device


class TemplateEngine(EngineBase):
    """A one-device engine; its memory tags are its weights and its prefix cache (the "KV cache")."""

    supported_tags: tuple[str, ...] = (TAG_WEIGHTS, TAG_KV_CACHE)
    supports_images: ClassVar[bool] = False

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "float32",
        device: str | None = None,
        seed: int = 0,
        enable_sleep: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        # Every check happens before the model is loaded: bad input costs no memory.
        super().__init__(sleep_enabled=enable_sleep, bucket_bytes=bucket_bytes)
        if not os.path.isdir(model):
            raise ConfigError(f"model={model!r} is not a local model folder (this backend reads no hub names)")
        import torch

        from genengine_template.loop import TinyLoop

        device = _check_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._loop: TinyLoop = TinyLoop(model, dtype=_torch_dtype(dtype, model), device=device)
        self._rng = random.Random(seed)
        self._spec = self._build_spec()

    @classmethod
    def from_config(cls, config: EngineConfig) -> TemplateEngine:
        """The factory the plugin registers: an ``EngineConfig`` in, an engine out."""
        check_options("template", config.options, OPTIONS)
        if config.tp_size != 1:
            raise ConfigError(f"tp_size={config.tp_size}: the template backend runs on one device; allowed: 1")
        if config.model is None:
            raise ConfigError("the template backend needs model=PATH (a local Hugging Face model folder)")
        engine = cls(
            config.model,
            dtype=config.dtype,
            device=config.options.get("device"),
            seed=config.seed,
            enable_sleep=config.enable_sleep,
            bucket_bytes=config.options.get("bucket_bytes", DEFAULT_BUCKET_BYTES),
        )
        engine.config = config
        return engine

    config: EngineConfig | None = None

    def _build_spec(self) -> dict[str, WeightInfo]:
        spec: dict[str, WeightInfo] = {}
        seen: set[int] = set()
        for name, p in self._loop.model.named_parameters(remove_duplicate=False):
            # A tied alias (lm_head.weight sharing the embedding's tensor) is accepted but not required.
            spec[name] = WeightInfo(tuple(p.shape), str(p.dtype).removeprefix("torch."), required=id(p) not in seen)
            seen.add(id(p))
        return spec

    # ---- EngineBase hooks ------------------------------------------------------------------------------
    def _vocab_size(self) -> int | None:
        return self._loop.vocab_size

    def _weight_spec(self) -> Mapping[str, WeightInfo]:
        return self._spec

    def _generate(self, requests: list[Request]) -> list[GenerationResult]:
        return [self._one(request) for request in requests]

    def _one(self, request: Request) -> GenerationResult:
        import torch

        tokenizer = self._loop.tokenizer
        if request.prompt_token_ids is not None:
            prompt = list(request.prompt_token_ids)
        elif tokenizer is None:
            raise InvalidArgumentError("this model folder has no tokenizer: pass prompt_token_ids instead of text")
        else:
            prompt = list(tokenizer.encode(request.prompt))
        params = request.params
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        generator = torch.Generator().manual_seed(seed)  # per request: reproducible whatever else is batched
        outputs = [self._sample(prompt, params, generator) for _ in range(params.n)]
        return GenerationResult(prompt_token_ids=prompt, outputs=outputs)

    def _sample(self, prompt: list[int], params: SamplingParams, generator: torch.Generator) -> GenerationOutput:
        tokenizer = self._loop.tokenizer
        stop_ids = set(params.stop_token_ids)
        eos = set() if params.ignore_eos else set(self._loop.eos_token_ids)
        tokens: list[int] = []
        logprobs: list[float] = []
        finish: Any = "length"
        stop_reason: str | int | None = None
        text: str | None = None
        for token, logprob in self._loop.stream(
            prompt,
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_k=params.top_k_or_none,
            top_p=params.top_p,
            generator=generator,
        ):
            tokens.append(token)
            logprobs.append(logprob)
            if token in stop_ids or token in eos:
                finish, stop_reason = "stop", (token if token in stop_ids else None)
                break
            if params.stop and tokenizer is not None:
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                hit = min(((text.find(s), s) for s in params.stop if s in text), default=None)
                if hit is not None:
                    finish, stop_reason, text = "stop", hit[1], text[: hit[0]]
                    break
        if tokenizer is not None and not isinstance(stop_reason, str):
            kept = tokens[:-1] if finish == "stop" else tokens  # a stop/EOS token is not part of the text
            text = tokenizer.decode(kept, skip_special_tokens=True)
        return GenerationOutput(
            token_ids=tokens,
            text=text,
            finish_reason=finish,
            logprobs=logprobs if params.logprobs else None,
            stop_reason=stop_reason,
        )

    def _release(self, level: int) -> None:
        # Every tag goes; level 1 keeps a host copy of the weights, level 2 lets the trainer re-send them.
        self._loop.release_cache()
        self._loop.release_weights(keep_host_copy=level == 1)

    def _resume(self, tags: tuple[str, ...]) -> None:
        # Called with the released tags asked for, weights first (EngineBase orders them).
        if TAG_WEIGHTS in tags:
            self._loop.restore_weights()
        if TAG_KV_CACHE in tags:
            self._loop.resume_cache()

    def _apply_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in bucket:
            self._loop.write_weight(name, tensor)

    def _flush_cache(self) -> None:
        # EngineBase calls this after every load_weights (or when the cache wakes after one).
        self._loop.flush_cache()

    def _shutdown(self) -> None:
        self._loop.close()
