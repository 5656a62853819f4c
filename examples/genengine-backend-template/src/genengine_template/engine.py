"""``TemplateEngine``: the template's loop behind the ``GenerationEngine`` protocol.

``EngineBase`` does the argument checks, the sleep/wake/load state machine, weight validation and bucketing;
``genengine.backend``'s helpers do the bookkeeping (``from_config``, the weight list, stop/EOS rules, seeds).
Left here: the ``_methods``, each a call into the engine. What it cannot do (images, tensor parallelism) is
refused up front with an error naming the value. Only creating a ``template`` engine imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from genengine import backend
from genengine.errors import ConfigError, InvalidArgumentError
from genengine_template.loop import TinyLoop

__all__ = ["OPTIONS", "TemplateEngine"]

OPTIONS = ("device", "bucket_bytes")
"""Backend-specific settings this backend accepts under ``EngineConfig.options``."""


class TemplateEngine(backend.FromConfig, backend.EngineBase):
    """A one-device engine; its memory tags are its weights and its prefix cache (the "KV cache")."""

    supported_tags = (backend.TAG_WEIGHTS, backend.TAG_KV_CACHE)
    backend_name = "template"  # for FromConfig.from_config, the factory plugin.py registers
    config_options = OPTIONS

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "float32",
        device: str | None = None,
        seed: int = 0,
        enable_sleep: bool = True,
        bucket_bytes: int = backend.DEFAULT_BUCKET_BYTES,
    ) -> None:
        # Every check happens before the model is loaded: bad input costs no memory.
        super().__init__(sleep_enabled=enable_sleep, bucket_bytes=bucket_bytes)
        if not os.path.isdir(model):
            raise ConfigError(f"model={model!r} is not a local model folder (this backend reads no hub names)")
        device = backend.check_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._loop = TinyLoop(model, dtype=backend.torch_dtype(dtype, model), device=device)
        self._seeds = backend.Seeds(seed)
        self._spec = backend.module_weight_spec(self._loop.model, buffers=False)  # a tied lm_head is optional
        tokenizer = self._loop.tokenizer
        self._decode = None if tokenizer is None else backend.text_decoder(tokenizer)

    # ---- EngineBase hooks --------------------------------------------------------------------------------
    def _vocab_size(self) -> int | None:
        return self._loop.vocab_size

    def _weight_spec(self) -> Mapping[str, backend.WeightInfo]:
        return self._spec

    def _generate(self, requests: list[backend.Request]) -> list[backend.GenerationResult]:
        return [self._one(request) for request in requests]

    def _one(self, request: backend.Request) -> backend.GenerationResult:
        tokenizer = self._loop.tokenizer
        if request.prompt_token_ids is None and tokenizer is None:
            raise InvalidArgumentError("this model folder has no tokenizer: pass prompt_token_ids instead of text")
        prompt = list(request.prompt_token_ids or tokenizer.encode(request.prompt))
        generator = torch.Generator().manual_seed(self._seeds.request(request.params))  # batch-independent
        outputs = [self._sample(prompt, request.params, generator) for _ in range(request.params.n)]
        return backend.GenerationResult(prompt_token_ids=prompt, outputs=outputs)

    def _sample(self, prompt: list[int], p: backend.SamplingParams, gen: torch.Generator) -> backend.GenerationOutput:
        stream = self._loop.stream(
            prompt,
            max_new_tokens=p.max_new_tokens,
            temperature=p.temperature,
            top_k=p.top_k_or_none,
            top_p=p.top_p,
            generator=gen,
        )
        # The stop/EOS rules end the stream and give finish_reason, stop_reason and the text.
        return backend.complete(stream, p, eos_token_ids=self._loop.eos_token_ids, decode=self._decode)

    def _release(self, level: int) -> None:
        # Every tag goes; level 1 keeps a host copy of the weights, level 2 lets the trainer re-send them.
        self._loop.release_cache()
        self._loop.release_weights(keep_host_copy=level == 1)

    def _resume(self, tags: tuple[str, ...]) -> None:
        # Called with the released tags asked for, weights first (EngineBase orders them).
        if backend.TAG_WEIGHTS in tags:
            self._loop.restore_weights()
        if backend.TAG_KV_CACHE in tags:
            self._loop.resume_cache()

    def _apply_weights(self, bucket: list[tuple[str, torch.Tensor]], session: backend.LoadSession) -> None:
        for name, tensor in bucket:
            self._loop.write_weight(name, tensor)

    def _flush_cache(self) -> None:
        # EngineBase calls this after every load_weights (or when the cache wakes after one).
        self._loop.flush_cache()

    def _shutdown(self) -> None:
        self._loop.close()
