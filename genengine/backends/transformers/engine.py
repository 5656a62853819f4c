"""The embedded default backend: PyTorch + transformers on the CPU or one CUDA device.

It runs everywhere, so trainers and tests are real without a GPU, and it is the reference the GPU
backends are held to by the conformance suite: processed logprobs computed exactly as the contract says,
seeded sampling that does not depend on batch composition, and a prompt prefix cache that ``load_weights``
must flush (so a stale-cache bug would show here as on SGLang or vLLM).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from genengine.adapters import Adapter
from genengine.backend import (
    DEFAULT_BUCKET_BYTES,
    TAG_KV_CACHE,
    TAG_WEIGHTS,
    AsyncEngineBase,
    AsyncRequest,
    Completion,
    DriverLock,
    EngineConfig,
    FromConfig,
    GenerationResult,
    Request,
    SamplingParams,
    Seeds,
    WeightInfo,
    check_device,
    module_weight_spec,
    option_int,
    text_decoder,
    torch_dtype,
)
from genengine.backends.transformers._lora import LoraLayers
from genengine.backends.transformers._sampling import PrefixKey, Row, greedy, processed_sample
from genengine.backends.transformers._scheduler import DecodeBatch, Decoder, Prefix, Scheduler
from genengine.engine.environ import malloc_trim
from genengine.errors import ConfigError, EngineClosedError, InvalidArgumentError

if TYPE_CHECKING:
    import torch

    from genengine.backend import LoadSession

__all__ = ["OPTIONS", "HFRawEngine", "TransformersEngine", "hf_generate_tokens_per_second"]

OPTIONS = (
    "device",
    "max_batch_size",
    "bucket_bytes",
    "attn_implementation",
    "prefix_cache_bytes",
    "keep_prefix_cache_on_sleep",
    "max_lora_rank",
)
"""Backend options (``EngineConfig.options``) this backend accepts."""

_ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")


class TransformersEngine(FromConfig, AsyncEngineBase):
    """A ``GenerationEngine`` running a transformers causal LM in this process.

    Options: ``device`` ("cpu", "cuda", "cuda:N"), ``max_batch_size`` (rows decoded together),
    ``bucket_bytes``, ``attn_implementation`` (transformers' name, default its own choice),
    ``prefix_cache_bytes`` (prompt KV kept across calls; 0 disables), ``keep_prefix_cache_on_sleep`` (CPU
    only: a level-1 sleep keeps the prefix cache, as SGLang's does, so the flush a load owes while the KV
    cache sleeps can be seen to happen at wake; see ``prefix_cache_hits``). ``mem_util`` is not used: memory
    grows with the batch. Sleep level 1 moves the weights to host memory (on CPU there is nothing to
    move) and drops the prefix cache (unless ``keep_prefix_cache_on_sleep``); level 2 frees the weights'
    storage and the cache. LoRA adapters (``load_adapter``) up to rank ``max_lora_rank`` are served per request
    on every linear layer, through forward hooks: the base weights are never merged.
    """

    supported_tags = (TAG_WEIGHTS, TAG_KV_CACHE)
    validate_all_weights_first = True
    supports_adapters = True
    backend_name = "transformers"
    config_options = OPTIONS

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
        max_lora_rank: int = 64,
    ) -> None:
        model_dir = os.fspath(model)
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise ConfigError(f"model={model_dir!r} is not a model directory (no config.json there)")
        device = check_device(device)
        if dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype={dtype!r}: allowed are auto, bfloat16, float16, float32")
        option_int("max_batch_size", max_batch_size)
        option_int("max_lora_rank", max_lora_rank)
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
        self.dtype = torch_dtype(dtype, model_dir)
        self.max_batch_size = max_batch_size
        self.prefix_cache_bytes = prefix_cache_bytes
        self.keep_prefix_cache_on_sleep = keep_prefix_cache_on_sleep
        self._seeds = Seeds(seed)

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
        self._decode_text = text_decoder(self._tokenizer)
        pad = self._tokenizer.pad_token_id
        self._pad = int(pad if pad is not None else min(eos, default=0))

        # Parameters by every HF name (a tied lm_head appears under both names, as one Parameter).
        self._params = dict(self._model.named_parameters(remove_duplicate=False))
        self._spec = module_weight_spec(self._model)
        self._unique_params = list({id(p): p for p in self._params.values()}.values())
        self._shapes = [tuple(p.shape) for p in self._unique_params]
        self._host_backup: list[torch.Tensor] | None = None
        self.max_lora_rank_option = max_lora_rank
        self._loras = LoraLayers(self._model, self.device, self.dtype)
        self._prefixes: OrderedDict[PrefixKey, Prefix] = OrderedDict()
        self._prefix_nbytes = 0
        self._prefix_hits = 0
        self._lock = DriverLock()  # the scheduler steps under it and lets waiting callers in first
        self._scheduler: Scheduler | None = None

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

    def _checked_prompt(self, request: Request) -> tuple[int, ...]:
        ids = self._encode(request)
        if len(ids) + request.params.max_new_tokens > self._max_len:
            raise InvalidArgumentError(
                f"prompt {request.index} has {len(ids)} tokens; with max_new_tokens={request.params.max_new_tokens} "
                f"it exceeds the model's context of {self._max_len} tokens"
            )
        return ids

    def _new_rows(self, ids: tuple[int, ...], request: Request) -> list[Row]:
        p, lora = request.params, None if request.lora is None else request.lora.handle
        return [Row(ids, self._seeds.sample(p, j), self._completion(p), lora=lora) for j in range(p.n)]

    def _generate(self, requests: list[Request]) -> list[GenerationResult]:
        import torch

        prompts = [self._checked_prompt(r) for r in requests]
        with self._locked():
            rows = [self._new_rows(ids, r) for r, ids in zip(requests, prompts, strict=True)]
            flat = [row for per_request in rows for row in per_request]
            with torch.inference_mode():
                prefixes = self._prefill(list(dict.fromkeys(row.key for row in flat)))
                # Rows of similar prompt length decode together: less padding.
                ordered = sorted(flat, key=lambda row: len(row.prompt))
                for start in range(0, len(ordered), self.max_batch_size):
                    self._decode(ordered[start : start + self.max_batch_size], prefixes)
        return [
            GenerationResult(
                prompt_token_ids=list(ids),
                outputs=[row.out.output() for row in per_request],
            )
            for ids, per_request in zip(prompts, rows, strict=True)
        ]

    def _completion(self, params: SamplingParams) -> Completion:
        return Completion(params, eos_token_ids=self._eos, decode=self._decode_text)

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self._config)

    def _prefill(self, prompts: list[PrefixKey]) -> dict[PrefixKey, Prefix]:
        """KV and next-token logits of each distinct (adapter, prompt), from the prefix cache or computed in
        batches."""
        import torch

        found: dict[PrefixKey, Prefix] = {}
        todo = []
        for key in prompts:
            hit = self._prefixes.get(key)
            if hit is not None:
                self._prefixes.move_to_end(key)
                found[key] = hit
                self._prefix_hits += 1
            else:
                todo.append(key)
        todo.sort(key=lambda key: len(key[1]))
        for start in range(0, len(todo), self.max_batch_size):
            chunk = todo[start : start + self.max_batch_size]
            batch = [ids for _, ids in chunk]
            width = max(len(ids) for ids in batch)
            input_ids = torch.full((len(batch), width), self._pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for b, ids in enumerate(batch):
                input_ids[b, width - len(ids) :] = torch.tensor(ids)
                mask[b, width - len(ids) :] = 1
            input_ids, mask = input_ids.to(self.device), mask.to(self.device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            cache = self._new_cache()
            with self._loras.rows([lora for lora, _ in chunk]):
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
            for b, (key, ids) in enumerate(zip(chunk, batch, strict=True)):
                keep = slice(width - len(ids), width)
                keys = [layer.keys[b, :, keep].clone() for layer in layers]
                values = [layer.values[b, :, keep].clone() for layer in layers]
                nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values))
                entry = Prefix(keys, values, logits[b].clone(), nbytes)
                found[key] = entry
                self._remember(key, entry)
        return found

    def _remember(self, key: PrefixKey, entry: Prefix) -> None:
        if entry.nbytes > self.prefix_cache_bytes:
            return
        self._prefixes[key] = entry
        self._prefix_nbytes += entry.nbytes
        while self._prefix_nbytes > self.prefix_cache_bytes:
            _, old = self._prefixes.popitem(last=False)
            self._prefix_nbytes -= old.nbytes

    def _decoder(self) -> Decoder:
        """The engine as the decode loop sees it."""
        return Decoder(
            self.device, self.max_batch_size, self._lock, self._new_cache, self._forward, self._sample, self._prefill
        )

    def _forward(self, ids: Any, allowed: torch.Tensor, positions: torch.Tensor, cache: Any, loras: Any) -> Any:
        """One decode step of the model: each row's next-token logits after its newest token."""
        with self._loras.rows(loras):
            out = self._model(
                input_ids=ids[:, None],
                attention_mask=self._decode_mask(allowed),
                position_ids=positions[:, None],
                use_cache=True,
                **{self._cache_kwarg: cache},
            )
        return out.logits[:, -1].float()

    def _decode(self, rows: list[Row], prefixes: dict[PrefixKey, Prefix]) -> None:
        batch = DecodeBatch(self._decoder(), rows, prefixes)
        while batch.step():
            pass

    def _decode_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """A ready 4-D mask (transformers passes those through untouched) where the kernel's format is known."""
        import torch

        if self._attn == "sdpa":
            return allowed
        if self._attn == "eager":
            zero = torch.zeros((), dtype=self.dtype, device=allowed.device)
            return torch.where(allowed, zero, torch.finfo(self.dtype).min)
        return allowed[:, 0, 0].long()  # other kernels: the plain 2-D padding mask

    def _sample(self, logits: torch.Tensor, rows: list[Row]) -> tuple[torch.Tensor, list[int]]:
        """Pick each row's next token and record it with its processed logprob; returns the tokens and the
        indices of the rows that go on (the stop rules are ``Completion``'s)."""
        import torch

        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not sampled:
            tokens, chosen = greedy(logits)
        elif len(sampled) == len(rows):
            tokens, chosen = processed_sample(logits, rows)
        else:
            tokens, chosen = greedy(logits)
            index = torch.tensor(sampled, device=logits.device)
            pick, picked = processed_sample(logits[index], [rows[i] for i in sampled])
            tokens = tokens.index_put((index,), pick)
            chosen = chosen.index_put((index,), picked)
        steps = zip(rows, tokens.tolist(), chosen.tolist(), strict=True)
        return tokens, [j for j, (row, tok, lp) in enumerate(steps) if row.out.add(tok, lp)]

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        """The engine's lock for a call from outside the scheduler (which steps under the same lock)."""
        return self._lock()

    # ---- async (genengine.engine.aio's hooks) --------------------------------------------------------------------
    def _ensure_scheduler(self) -> Scheduler:
        if self._scheduler is None:
            self._scheduler = Scheduler(self._decoder())
        return self._scheduler

    def _async_start(self, request: AsyncRequest) -> None:
        ids = self._checked_prompt(request.request)
        request.prompt_token_ids = ids
        rows = self._new_rows(ids, request.request)
        for j, row in enumerate(rows):
            row.sink, row.index = request, j
        with self._locked():
            scheduler = self._ensure_scheduler()
            scheduler.pending.extend(rows)
            scheduler.wakeup.notify()

    def _async_abort(self, requests: list[AsyncRequest]) -> None:
        wanted = {id(r) for r in requests}
        with self._locked():
            if self._scheduler is None:
                return
            hit = [row for row in self._scheduler.live_rows() if id(row.sink) in wanted]
            self._scheduler.pending = [row for row in self._scheduler.pending if id(row.sink) not in wanted]
            for row in hit:  # its batch drops the row at the next step
                row.out.abort()
                row.report()

    def _async_hold(self, clear_cache: bool) -> None:
        with self._locked():
            scheduler = self._ensure_scheduler()
            scheduler.held = True
            scheduler.rebuild = scheduler.rebuild or clear_cache

    def _async_release_hold(self) -> None:
        with self._locked():
            scheduler = self._ensure_scheduler()
            scheduler.held = False
            scheduler.wakeup.notify()

    # ---- adapters (genengine.engine.adapters' hooks) -------------------------------------------------------------
    def _max_lora_rank(self) -> int:
        return self.max_lora_rank_option

    def _add_adapter(self, adapter: Adapter, replaced: Adapter | None) -> None:
        with self._locked():
            adapter.handle = self._loras.prepare(adapter)

    def _drop_adapter(self, adapter: Adapter) -> None:
        """Rows bound to it keep its tensors until they finish; its cached prefills go now."""
        with self._locked():
            for key in [key for key in self._prefixes if key[0] is adapter.handle]:
                self._prefix_nbytes -= self._prefixes.pop(key).nbytes

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

        with self._locked():
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

        with self._locked():
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
    def _apply_weights(self, bucket: list[tuple[str, torch.Tensor]], session: LoadSession) -> None:
        import torch

        with self._locked():
            with torch.no_grad():
                for name, tensor in bucket:
                    self._params[name].data.copy_(tensor, non_blocking=self.device.type == "cuda")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def _flush_cache(self) -> None:
        with self._locked():
            self._drop_prefixes()

    def _shutdown(self) -> None:
        if self._scheduler is not None:
            with self._locked():  # requests in flight end "abort" with their tokens, as on every backend
                for row in self._scheduler.live_rows():
                    if row.sink is not None:
                        row.out.abort()
                        row.report()
            self._scheduler.stop(EngineClosedError("the engine was shut down while the request was running"))
        self._drop_prefixes()
        self._loras.close()
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
    device = check_device(config.options.get("device", "cpu"))
    if config.model is None:
        raise ConfigError("hf_generate_tokens_per_second needs config.model")
    dtype = torch_dtype(config.dtype, config.model)
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


class HFRawEngine:
    """Plain transformers ``generate`` on the engine's model and device, kept loaded: the ``raw_engine`` that
    ``genengine bench`` pairs with ours (greedy, no EOS stop, the prompts left-padded into one batch)."""

    def __init__(self, config: Any) -> None:
        config = EngineConfig.from_any(config)
        if config.model is None:
            raise ConfigError("HFRawEngine needs config.model")
        self.device = check_device(config.options.get("device", "cpu"))
        dtype = torch_dtype(config.dtype, config.model)
        self.model, _, _ = _hf_model_and_batch(config.model, dtype, self.device, [[0]])
        self.model.generation_config.eos_token_id = None  # as ignore_eos: every row runs max_new_tokens

    def generate_tokens(self, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int) -> int:
        import torch
        import transformers

        mask, input_ids = _hf_batch(prompt_token_ids, self.device)
        pad = self.model.generation_config.pad_token_id
        gen = transformers.GenerationConfig(
            do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad if pad is not None else 0
        )
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=gen)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return int((out.shape[1] - input_ids.shape[1]) * out.shape[0])

    def close(self) -> None:
        del self.model


def _hf_model_and_batch(
    model_dir: str, dtype: torch.dtype, device: str, prompt_token_ids: Sequence[Sequence[int]]
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    import transformers

    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        model.to(device).eval()
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    mask, input_ids = _hf_batch(prompt_token_ids, device)
    return model, mask, input_ids


def _hf_batch(prompt_token_ids: Sequence[Sequence[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    width = max(len(p) for p in prompt_token_ids)
    input_ids = torch.zeros((len(prompt_token_ids), width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for b, ids in enumerate(prompt_token_ids):
        input_ids[b, width - len(ids) :] = torch.tensor(list(ids))
        mask[b, width - len(ids) :] = 1
    return mask.to(device), input_ids.to(device)
