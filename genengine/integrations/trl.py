"""TRL's ``GRPOTrainer`` and ``RLOOTrainer`` generating with any genengine backend, chosen by one config argument.

TRL 1.16 builds ``trl.generation.vllm_generation.VLLMGeneration`` itself, for vLLM only, and its colocated
weight sync calls vLLM's model ``load_weights`` once per parameter. The trainers here are TRL's own, unmodified:
given ``genengine={...}`` (a dict, a YAML path, anything ``genengine.create_engine`` takes) they take TRL's
vLLM code path, with :class:`GenEngineGeneration` built where TRL builds ``VLLMGeneration``. That class keeps
TRL's constructor (the trainer passes its arguments as for vLLM), TRL's FSDP/ZeRO-3/PEFT parameter gathering,
and sends the weights in ONE bucketed ``engine.load_weights`` per sync, labelled with the training step.

Every setting of TRL's vLLM path that genengine cannot honour (server mode, constrained decoding, penalties,
min-p, tensor parallelism, other TRL versions) is refused with the key and what is allowed, before the model
is loaded or any engine or GPU memory is taken. docs/trl.md is the user's page.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import logging
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

from genengine.adapters import AdapterConfig, AdapterInfo
from genengine.config import EngineConfig
from genengine.errors import ConfigError, GenEngineError, InvalidArgumentError
from genengine.integrations.trl_config import (
    CONFIG_KEYS,
    NO_IMAGES,
    check_engine_config,
    check_trl_settings,
    engine_config_source,
    no_images,
    resolve_engine_config,
)
from genengine.integrations.trl_lora import (
    ADAPTER_NAME,
    LORA_SYNC_MODES,
    LoraSync,
    SyncMode,
    check_lora_sync,
    choose_lora_sync,
    log_choice,
    peft_adapter_weights,
    peft_base_weights,
)
from genengine.plugins.registry import create_engine
from genengine.protocol import TAG_KV_CACHE, TAG_WEIGHTS, LoadReport

TRL_VERSION = "1.16.0"
"""The TRL release this integration is written against and tested with (``genengine[trl]`` pins it)."""
INSTALL_HINT = f"pip install trl=={TRL_VERSION}, or in a clone of genengine: pip install -e '.[trl]'"
"""How to get the TRL this integration needs (genengine is installed from a clone: it is not on PyPI)."""


class TRLVersionError(GenEngineError, ImportError):
    """TRL is missing, or is not the release this integration was written for."""


def check_trl_version() -> str:
    """The installed TRL's version, if it is ``TRL_VERSION``; read from its metadata, so a wrong TRL is never
    imported (another release may fail to import, or import and behave differently)."""
    try:
        found = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        raise TRLVersionError(
            f"genengine.integrations.trl needs trl=={TRL_VERSION}, which is not installed: {INSTALL_HINT}"
        ) from None
    if found != TRL_VERSION:
        raise TRLVersionError(
            f"genengine.integrations.trl is written for trl=={TRL_VERSION} (it plugs into TRL's own trainer "
            f"code), but trl {found} is installed; allowed: trl=={TRL_VERSION} ({INSTALL_HINT})"
        )
    return found


check_trl_version()

import torch  # noqa: E402 (after the version check: nothing of TRL is imported before it)
from accelerate.utils import is_peft_model  # noqa: E402
from transformers import ProcessorMixin  # noqa: E402
from trl import GRPOConfig, RLOOConfig  # noqa: E402
from trl import GRPOTrainer as _TRLGRPOTrainer  # noqa: E402
from trl import RLOOTrainer as _TRLRLOOTrainer  # noqa: E402
from trl.generation import vllm_generation as _vllm_generation  # noqa: E402
from trl.trainer import grpo_trainer as _grpo_module  # noqa: E402
from trl.trainer import rloo_trainer as _rloo_module  # noqa: E402
from trl.trainer.utils import get_config_model_id  # noqa: E402

__all__ = [
    "ADAPTER_NAME",
    "CONFIG_KEYS",
    "INSTALL_HINT",
    "LORA_SYNC_MODES",
    "TRL_VERSION",
    "GRPOTrainer",
    "GenEngineGeneration",
    "RLOOTrainer",
    "TRLVersionError",
    "check_engine_config",
    "check_trl_settings",
    "check_trl_version",
    "engine_config_source",
    "resolve_engine_config",
]

_log = logging.getLogger(__name__)


class GenEngineGeneration(_vllm_generation.VLLMGeneration):
    """``VLLMGeneration`` with a genengine engine in place of ``vllm.LLM``: same constructor, same
    ``sync_weights()`` and ``generate(...)`` results, so TRL's trainers use it unchanged.

    ``genengine`` is the engine config (as ``create_engine`` takes it); ``seed`` is the run's seed, to which each
    process adds its index, as TRL seeds one vLLM per process. Colocated only: one engine per training process.
    """

    lora_sync: LoraSync = "auto"
    sync_mode: SyncMode = "full"
    """What each sync sends: the whole model (``"full"``), the PEFT policy merged (``"merge"``), or only its adapter
    (``"adapter"``, after one sync of the base weights)."""
    last_adapter: AdapterInfo | None = None
    """The last adapter-only sync's ``AdapterInfo``."""
    _adapter_config: AdapterConfig | None = None
    _base_synced = False

    def __init__(self, *args: Any, genengine: Any, seed: int = 0, lora_sync: LoraSync = "auto", **kwargs: Any) -> None:
        self._genengine = engine_config_source(genengine)
        self._seed = seed
        self.lora_sync = check_lora_sync(lora_sync)
        self.engine: Any = None
        """The ``GenerationEngine`` (typed loosely: ``load_weights(version=...)``, which every genengine engine takes,
        is not in the protocol class yet)."""
        self.weight_version_fn: Callable[[], int] | None = None
        """Labels each sync's weights (``load_weights(version=...)``); the trainers here set it to the training
        step. None counts the syncs."""
        self.last_load: LoadReport | None = None
        self._syncs = 0
        super().__init__(*args, **kwargs)  # sets TRL's attributes, then calls _init_vllm

    # ---- what TRL reads ----------------------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """This generator's TRL settings under their config field names (what the checks speak)."""
        return {field: getattr(self, attr) for attr, field in CONFIG_KEYS.items()} | {"logprobs": self.logprobs}

    @property
    def max_model_len(self) -> int:
        """Prompt plus completion tokens allowed: ``vllm_max_model_length``, else the model's position limit."""
        if self.max_model_length is not None:
            return int(self.max_model_length)
        config = self.model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return int(text.max_position_embeddings)

    @property
    def llm(self) -> Any:
        """The one piece of ``vllm.LLM`` TRL's tool-calling loop reads (``llm.llm_engine.model_config.max_model_len``);
        nothing else of vLLM is here."""
        model_config = SimpleNamespace(max_model_len=self.max_model_len)
        return SimpleNamespace(llm_engine=SimpleNamespace(model_config=model_config))

    # ---- engine lifetime ---------------------------------------------------------------------------------------
    def _init_vllm(self) -> None:
        """Build the engine where TRL builds ``vllm.LLM``; every check runs before it starts."""
        self._sampling = check_trl_settings(self.settings())
        config = resolve_engine_config(
            self._genengine,
            self.settings(),
            model_name=getattr(self.model, "name_or_path", None),
            seed=int(self._seed),
            process_index=int(self.accelerator.process_index),
        )
        engine = create_engine(config)
        try:
            if isinstance(self.processing_class, ProcessorMixin) and not getattr(engine, "supports_images", False):
                raise ConfigError(no_images(config.backend))
            self._choose_sync(engine)
            if self.enable_sleep_mode:
                engine.sleep(level=self._sleep_level)  # as TRL: nothing held until the first sync
        except BaseException:
            engine.shutdown()
            raise
        self.engine = engine
        self._llm_weights_sleeping = self.enable_sleep_mode
        self.accelerator.wait_for_everyone()

    def _choose_sync(self, engine: Any) -> None:
        """Adapter-only sync for a PEFT policy where the backend serves adapters (``lora_sync``), logged."""
        if not (isinstance(self.model, torch.nn.Module) and is_peft_model(self.model)):
            return
        sharded = "adapter-only sync of a ZeRO-3 or FSDP policy is not written yet"
        self.sync_mode, self._adapter_config, why = choose_lora_sync(
            self.model, engine, self.lora_sync, sharded=sharded if self._dist.is_zero3 or self._dist.is_fsdp else ""
        )
        if self.sync_mode == "adapter":
            self._sampling = dataclasses.replace(self._sampling, adapter=ADAPTER_NAME)
        log_choice(_log, type(self).__name__, self.sync_mode, why)

    @property
    def _sleep_level(self) -> int:
        """2 as TRL (the weights come back with each sync), but 1 under adapter sync: the base never changes."""
        return 1 if self.sync_mode == "adapter" else 2

    def _engine(self) -> Any:
        if self.engine is None:
            raise GenEngineError("this GenEngineGeneration's engine was shut down")
        return self.engine

    def shutdown(self) -> None:
        """Free the engine (its GPU memory and processes). Idempotent."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()

    # ---- weights -----------------------------------------------------------------------------------------------
    def _walk_moves(self) -> bool:
        """True where TRL's walk takes each tensor back as it moves on: ZeRO-3 re-partitions a parameter, FSDP1
        frees the summoned one and PEFT unmerges the adapter."""
        return bool(is_peft_model(self.model) or self._dist.is_zero3 or self._dist.fsdp_version == 1)

    def _named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """TRL's own parameter walk (FSDP1/FSDP2, ZeRO-3, PEFT merged), with each tensor copied where the walk
        takes it back (``_walk_moves``), while the engine holds up to a bucket of tensors before it writes."""
        moves = self._walk_moves()
        with torch.no_grad():
            for name, tensor in self._iter_named_params():
                yield name, (tensor.detach().clone() if moves else tensor)

    def _next_version(self) -> int:
        self._syncs += 1
        return int(self.weight_version_fn()) if self.weight_version_fn is not None else self._syncs

    def sync_weights(self) -> None:
        """Push the policy's weights into the engine: one bucketed ``load_weights`` (which also flushes the
        engine's prefix cache), labelled with the step; with sleep mode the weights are woken first, as TRL does."""
        engine = self._engine()
        if self.enable_sleep_mode:
            _vllm_generation.empty_cache()  # as TRL: avoids an OOM when the weights come back
            engine.wake([TAG_WEIGHTS])
            self._llm_weights_sleeping = False
        walk = self._named_tensors()
        # Without FSDP, ZeRO-3 or PEFT the walk yields the model's own parameters: a list of them holds no memory
        # the model does not hold, and the engine then checks the whole sync before the first write and reads the
        # tensors in place (vLLM: one call, not one per bucket). Any other walk makes a tensor per parameter (a
        # copy, or FSDP2's full_tensor() gather): it stays a stream, bounded by the engine's buckets.
        if self.sync_mode == "adapter":
            self._sync_adapter(engine)
            return
        own = not (self._walk_moves() or self._dist.is_fsdp)
        self.last_load = engine.load_weights(list(walk) if own else walk, version=self._next_version())

    def _sync_adapter(self, engine: Any) -> None:
        """Only the adapter's tensors (PEFT's names), under ``ADAPTER_NAME`` with the step as its version; the first
        time also the base weights (the engine's checkpoint may not be the policy's base), unmerged."""
        version = self._next_version()
        with torch.no_grad():
            if not self._base_synced:
                self.last_load = engine.load_weights(list(peft_base_weights(self.model)), version=version)
                self._base_synced = True
            tensors = peft_adapter_weights(self.model)
            self.last_adapter = engine.load_adapter(ADAPTER_NAME, tensors, self._adapter_config, version=version)

    # ---- generation --------------------------------------------------------------------------------------------
    def _image_data(self, images: list[list[Any] | None] | None, count: int) -> list[Any] | None:
        if images is None or all(not row for row in images):
            return None
        if len(images) != count:
            raise InvalidArgumentError(f"images has {len(images)} entries for {count} prompts")
        data = []
        for i, row in enumerate(images):
            if row is not None and len(row) > 1:
                raise InvalidArgumentError(
                    f"prompt {i} has {len(row)} images; genengine engines take at most one image per prompt"
                )
            data.append(row[0] if row else None)
        return data

    def generate(
        self,
        prompts: list[list[int]],
        images: list[list[Any] | None] | None,
        num_generations: int,
        profiler: Any = None,
    ) -> tuple[
        list[list[int]],
        list[list[int]],
        list[list[list[float | None]]] | None,
        list[list[list[int]]] | None,
    ]:
        """Complete each prompt once (TRL already repeats each prompt ``num_generations`` times, so the count is
        unused here, as in TRL's colocate mode).

        Returns ``(prompt_ids, completion_ids, logprobs, logprob_token_ids)`` shaped as ``VLLMGeneration``'s:
        ``logprobs[i][t] == [processed logprob of token t]`` and ``logprob_token_ids[i][t] == [token t]`` (vLLM's
        ``logprobs=0``), or both None when the trainer asked for no logprobs. The logprobs are the processed ones
        (after temperature, top-k and top-p), which TRL's importance-sampling correction needs.
        """
        engine = self._engine()
        if self.enable_sleep_mode and self._llm_weights_sleeping:
            self.sync_weights()  # level 2 dropped the weights: they come from the policy, as in TRL
        elif self.sync_mode == "adapter" and ADAPTER_NAME not in engine.adapters:
            self.sync_weights()  # the rollouts name the adapter: it must be there
        if self.enable_sleep_mode:
            engine.wake([TAG_KV_CACHE])
        image_data = self._image_data(images, len(prompts))
        with profiler or nullcontext():
            results = engine.generate(
                prompt_token_ids=prompts,
                sampling_params=self._sampling,
                **({"image_data": image_data} if image_data is not None else {}),
            )
        prompt_ids = [list(r.prompt_token_ids) for r in results]
        outputs = [o for r in results for o in r.outputs]
        completion_ids = [list(o.token_ids) for o in outputs]
        logprobs: list[list[list[float | None]]] | None = None
        token_ids: list[list[list[int]]] | None = None
        if self.logprobs is not None:
            logprobs = [[[None if math.isnan(lp) else float(lp)] for lp in (o.logprobs or [])] for o in outputs]
            token_ids = [[[t] for t in o.token_ids] for o in outputs]
        if self.enable_sleep_mode:
            engine.sleep(level=self._sleep_level)
            self._llm_weights_sleeping = self._sleep_level == 2
        return prompt_ids, completion_ids, logprobs, token_ids


# ---- the trainers ------------------------------------------------------------------------------------------------
_swap_lock = threading.Lock()


@contextmanager
def _generation_class(module: ModuleType, genengine: Any, seed: int, lora_sync: LoraSync) -> Iterator[None]:
    """While the trainer's ``__init__`` runs, its module's ``VLLMGeneration`` builds a ``GenEngineGeneration``
    (TRL looks the name up when it builds the generator). Only for this thread: a plain TRL trainer built at the
    same time in another thread still gets TRL's class."""
    original = getattr(module, "VLLMGeneration")  # noqa: B009 (mypy: TRL's modules do not re-export it)
    owner = threading.get_ident()

    def build(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != owner:
            return original(*args, **kwargs)
        return GenEngineGeneration(*args, genengine=genengine, seed=seed, lora_sync=lora_sync, **kwargs)

    with _swap_lock:
        setattr(module, "VLLMGeneration", build)  # noqa: B010
        try:
            yield
        finally:
            setattr(module, "VLLMGeneration", original)  # noqa: B010


class _GenEngineTrainer:
    """A TRL trainer that takes ``genengine=CONFIG``: with it, TRL's vLLM path runs on that engine; without it,
    the trainer is TRL's, unchanged. ``lora_sync`` (``LORA_SYNC_MODES``) says how a PEFT policy is synced."""

    _trl_trainer: ClassVar[type]
    _trl_module: ClassVar[ModuleType]
    _trl_config: ClassVar[type]

    def __init__(self, *args: Any, genengine: Any = None, lora_sync: LoraSync = "auto", **kwargs: Any) -> None:
        if genengine is None:
            super().__init__(*args, **kwargs)
            return
        check_lora_sync(lora_sync)
        bound = inspect.signature(self._trl_trainer).bind(*args, **kwargs)
        model = bound.arguments["model"]
        config = bound.arguments.get("args")
        if config is None:  # what TRL does without args, done here to check it first
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            suffix = self._trl_config.__name__.removesuffix("Config")
            config = self._trl_config(f"{str(name).split('/')[-1]}-{suffix}")
            bound.arguments["args"] = config
        if bound.arguments.get("quantization_config") is not None or (
            getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
        ):
            raise ConfigError(
                "quantized policies are not supported with genengine: the engines take floating-point weights; "
                "allowed: quantization_config=None and a model that is not loaded in 4 or 8 bits"
            )
        settings = {field: getattr(config, field) for field in CONFIG_KEYS.values()}
        check_trl_settings(settings)
        # Every check of the genengine config runs here, before TRL's __init__ loads the policy (minutes at 7B).
        genengine = engine_config_source(genengine)
        given = EngineConfig.from_any(genengine)
        backend = given.backend
        if isinstance(bound.arguments.get("processing_class"), ProcessorMixin) and backend in NO_IMAGES:
            raise ConfigError(no_images(backend))
        model_name = model if isinstance(model, str) else getattr(model, "name_or_path", None)
        resolved = resolve_engine_config(genengine, settings, model_name=model_name, seed=config.seed)
        check_engine_config(resolved, model_given=given.model is not None)
        name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
        both = "; use_vllm=True is set too: genengine's engine runs, TRL builds no vllm.LLM" if config.use_vllm else ""
        _log.info(
            "%s: genengine backend %r generates in place of TRL's vLLM (trainer.vllm_generation.engine)%s",
            type(self).__name__,
            name,
            both,
        )
        use_vllm = config.use_vllm
        config.use_vllm = True  # TRL's vLLM path is the one that calls a generator object
        try:
            with _generation_class(self._trl_module, genengine, config.seed, lora_sync):
                super().__init__(*bound.args, **bound.kwargs)
        finally:
            config.use_vllm = use_vllm  # the caller's config object is left as it was given
        trainer: Any = self
        trainer.vllm_generation.weight_version_fn = lambda: int(trainer.state.global_step)


class GRPOTrainer(_GenEngineTrainer, _TRLGRPOTrainer):
    """``trl.GRPOTrainer``, plus ``genengine=CONFIG`` to generate with a genengine backend."""

    _trl_trainer = _TRLGRPOTrainer
    _trl_module: ClassVar[ModuleType] = _grpo_module
    _trl_config = GRPOConfig


class RLOOTrainer(_GenEngineTrainer, _TRLRLOOTrainer):
    """``trl.RLOOTrainer``, plus ``genengine=CONFIG`` to generate with a genengine backend."""

    _trl_trainer = _TRLRLOOTrainer
    _trl_module: ClassVar[ModuleType] = _rloo_module
    _trl_config = RLOOConfig
