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

import importlib.metadata
import inspect
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

from genengine.backend import FromConfig, check_device
from genengine.checkpoint import resolve_model_dir
from genengine.config import EngineConfig, check_options
from genengine.errors import BackendImportError, ConfigError, GenEngineError, InvalidArgumentError, closest
from genengine.protocol import TAG_KV_CACHE, TAG_WEIGHTS, LoadReport, SamplingParams
from genengine.registry import available_backends, create_engine, get_backend, resolve_ref

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
    "CONFIG_KEYS",
    "INSTALL_HINT",
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

CONFIG_KEYS: Mapping[str, str] = {
    "mode": "vllm_mode",
    "structured_outputs_regex": "vllm_structured_outputs_regex",
    "tensor_parallel_size": "vllm_tensor_parallel_size",
    "gpu_memory_utilization": "vllm_gpu_memory_utilization",
    "max_model_length": "vllm_max_model_length",
    "enable_sleep_mode": "vllm_enable_sleep_mode",
    "model_impl": "vllm_model_impl",
    "trust_remote_code": "trust_remote_code",
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_completion_length": "max_completion_length",
    "generation_kwargs": "generation_kwargs",
}
"""``VLLMGeneration``'s arguments → the ``GRPOConfig``/``RLOOConfig`` fields the trainer fills them from: errors
name the config field, which is what a TRL user sets."""

_VLLM_SAMPLING_NAMES = {"max_tokens": "max_new_tokens"}
"""vLLM ``SamplingParams`` names in ``generation_kwargs`` that genengine spells otherwise."""

_REFUSED_GENERATION_KWARGS = {
    "n": "TRL's colocated path makes one completion per prompt copy (each prompt comes num_generations times); "
    "set num_generations instead",
    "seed": "a per-request seed would give every copy of a prompt the same completion; seed the engine with "
    "genengine={'seed': ...} instead",
    "logprobs": "the trainer sets it (the sampled token's processed logprob, for the importance-sampling correction)",
    "structured_outputs": "genengine has no constrained decoding",
}

_BACKEND_OPTIONS: Mapping[str, Mapping[str, str]] = {
    "vllm": {"vllm_max_model_length": "max_model_len", "trust_remote_code": "trust_remote_code"},
    "sglang": {"vllm_max_model_length": "context_length", "trust_remote_code": "trust_remote_code"},
}
"""TRL settings the GPU engines take as options, under their own names (``options`` given in the genengine
config win)."""


_NO_IMAGES = ("transformers",)
"""Backends known to take no images (checked before the engine is built; others are asked once built)."""


def _no_images(backend: Any) -> str:
    return (
        f"the processing class is a multimodal processor but genengine backend {backend!r} takes no images; "
        "allowed: backend 'sglang' or 'vllm'"
    )


def check_trl_settings(settings: Mapping[str, Any]) -> SamplingParams:
    """The engine's ``SamplingParams`` for TRL's generation settings (keyed by config field name, plus the
    trainer's ``logprobs``), or a ``ConfigError`` naming the first setting genengine cannot honour and what is
    allowed. Pure: it starts nothing, so the trainer calls it before the model or any engine is loaded."""

    def refuse(key: str, value: Any, why: str, allowed: str) -> ConfigError:
        return ConfigError(f"{key}={value!r} is not supported with genengine: {why}; allowed: {allowed}")

    mode = settings.get("vllm_mode", "colocate")
    if mode != "colocate":
        raise refuse(
            "vllm_mode",
            mode,
            "the engine runs inside the training processes (TRL's colocate mode); there is no server mode",
            "'colocate'",
        )
    regex = settings.get("vllm_structured_outputs_regex")
    if regex is not None:
        raise refuse("vllm_structured_outputs_regex", regex, "genengine has no constrained decoding", "None")
    tp = settings.get("vllm_tensor_parallel_size", 1)
    if tp != 1:
        raise refuse(
            "vllm_tensor_parallel_size", tp, "the integration runs one engine per training process", "1 (the default)"
        )
    impl = settings.get("vllm_model_impl", "vllm")
    if impl not in ("vllm", "auto"):
        raise refuse(
            "vllm_model_impl",
            impl,
            "the backend picks its model code (for the vllm backend give genengine={'options': {'model_impl': ...}})",
            "'vllm' (the default) or 'auto'",
        )
    penalty = settings.get("repetition_penalty", 1.0)
    if penalty != 1.0:
        raise refuse("repetition_penalty", penalty, "genengine's sampling has no penalties", "1.0 (the default)")
    min_p = settings.get("min_p")
    if min_p not in (None, 0, 0.0):
        raise refuse("min_p", min_p, "genengine's sampling has no min-p (use top_p or top_k)", "None or 0.0")
    logprobs = settings.get("logprobs", 0)
    if logprobs not in (None, 0) or isinstance(logprobs, bool):
        raise refuse("logprobs", logprobs, "engines return only the sampled token's logprob", "None or 0")
    length = settings.get("max_completion_length")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise refuse("max_completion_length", length, "the engine needs a bound on each completion", "an int >= 1")
    top_k = settings.get("top_k", 0)
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": settings.get("temperature", 1.0),
        "top_p": settings.get("top_p", 1.0),
        "top_k": None if top_k in (0, -1, None) else top_k,  # vLLM's 0 and -1 both mean off
        "max_new_tokens": length,
        "logprobs": logprobs is not None,
    }
    extra = settings.get("generation_kwargs")
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError(f"generation_kwargs={extra!r} must be a dict of sampling parameters or None")
    for raw_key, value in (extra or {}).items():
        key = str(raw_key)
        if key in _REFUSED_GENERATION_KWARGS:
            raise ConfigError(
                f"generation_kwargs[{key!r}] is not supported with genengine: {_REFUSED_GENERATION_KWARGS[key]}"
            )
        name = _VLLM_SAMPLING_NAMES.get(key, key)
        kwargs[name] = None if name == "top_k" and value in (0, -1) else value
    try:
        return SamplingParams.coerce(kwargs)
    except InvalidArgumentError as exc:
        raise ConfigError(
            f"TRL's sampling settings (temperature, top_p, top_k, max_completion_length, generation_kwargs): {exc}"
        ) from exc


def engine_config_source(genengine: Any) -> Any:
    """``genengine=`` as ``EngineConfig.from_any`` takes it: a backend name given alone (``"transformers"``) becomes
    ``{"backend": name}``; a string naming an existing file stays a YAML path; any other string is refused with how
    to write it, before anything is loaded."""
    if not isinstance(genengine, str) or os.path.exists(genengine):
        return genengine
    names = sorted({b.name for b in available_backends()})
    if genengine in names:
        return {"backend": genengine}
    hint = closest(genengine, names)
    raise ConfigError(
        f"genengine={genengine!r} is neither a registered backend name nor an existing YAML file"
        + (f" (did you mean {hint!r}?)" if hint else "")
        + f"; allowed: a backend name ({', '.join(names)}), the path of a YAML file that exists, or a dict such "
        "as genengine={'backend': 'transformers', 'dtype': 'float32'}"
    )


def _given_keys(value: Any) -> set[str] | None:
    """The engine-config keys the user wrote (a mapping's or a YAML file's); None when every field counts as
    given (an ``EngineConfig`` or a dataclass)."""
    if isinstance(value, Mapping):
        return {str(k) for k in value}
    if isinstance(value, (str, os.PathLike)):
        import yaml

        EngineConfig.from_yaml(value)  # its errors, for an unreadable or malformed file
        with open(value, encoding="utf-8") as fh:
            return {str(k) for k in yaml.safe_load(fh)}
    return None


def _local_model_dir(name: str) -> str:
    """A hub id that TRL loaded the policy from, as its folder in the local cache (engines such as the embedded
    one take folders only); anything else unchanged. Looks in the cache only: nothing is downloaded."""
    if os.path.isdir(name):
        return name
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(name, local_files_only=True))
    except Exception:  # not a hub id, or not cached: the backend says what it takes
        return name


def resolve_engine_config(
    genengine: Any, settings: Mapping[str, Any], *, model_name: str | None, seed: int, process_index: int = 0
) -> EngineConfig:
    """The ``EngineConfig`` for TRL's run: the user's genengine config, with what it leaves out taken from TRL's
    settings (the model TRL trains, ``vllm_gpu_memory_utilization``, ``vllm_enable_sleep_mode``, the seed).

    The engine's seed is the config's ``seed`` (else TRL's ``seed``) plus ``process_index``: with several training
    processes each engine samples its own completions, as TRL seeds one vLLM per process. Checks that the two
    configs agree; imports no backend and starts nothing (``check_engine_config`` runs the backend's checks).
    """
    genengine = engine_config_source(genengine)
    given = _given_keys(genengine)
    config = EngineConfig.from_any(genengine)

    def set_by_user(key: str) -> bool:
        return given is None or key in given

    if config.tp_size != 1:
        raise ConfigError(
            f"tp_size={config.tp_size} is not supported with TRL: the integration runs one engine per training "
            "process; allowed: 1"
        )
    if isinstance(process_index, bool) or not isinstance(process_index, int) or process_index < 0:
        raise InvalidArgumentError(f"process_index={process_index!r} must be an int >= 0 (the accelerator's)")
    changes: dict[str, Any] = {}
    if config.model is None:
        if not model_name:
            raise ConfigError("the policy has no name_or_path to build the engine from: give genengine={'model': PATH}")
        changes["model"] = _local_model_dir(model_name)
    if not set_by_user("mem_util"):
        mem = settings.get("vllm_gpu_memory_utilization", config.mem_util)
        if isinstance(mem, bool) or not isinstance(mem, (int, float)) or not 0 < mem <= 1:
            raise ConfigError(
                f"vllm_gpu_memory_utilization={mem!r} is not supported with genengine: it becomes the engine's "
                "mem_util (its share of the GPU's memory); allowed: a number in (0, 1], or mem_util in the "
                "genengine config"
            )
        changes["mem_util"] = mem
    sleep_mode = bool(settings.get("vllm_enable_sleep_mode", False))
    if set_by_user("enable_sleep"):
        if sleep_mode and not config.enable_sleep:
            raise ConfigError(
                "vllm_enable_sleep_mode=True needs an engine that can sleep, but the genengine config sets "
                "enable_sleep=False; allowed: enable_sleep=True, or vllm_enable_sleep_mode=False"
            )
    else:
        changes["enable_sleep"] = sleep_mode
    changes["seed"] = (config.seed if set_by_user("seed") else int(seed)) + process_index
    backend = config.backend
    options = dict(config.options)
    names = _BACKEND_OPTIONS.get(backend, {}) if isinstance(backend, str) else {}
    if settings.get("trust_remote_code") and "trust_remote_code" not in names:
        raise ConfigError(
            f"trust_remote_code=True is not supported with genengine backend {backend!r}, which loads no remote "
            "code; allowed: False, or backend 'vllm' or 'sglang'"
        )
    for key, option in names.items():
        value = settings.get(key)
        if value not in (None, False) and option not in options:
            options[option] = value
    if options != config.options:
        changes["options"] = options
    return config.replace(**changes)


_SETTINGS_CHECKS: Mapping[str, str] = {
    "sglang": "genengine_sglang.settings:resolve_settings",
    "vllm": "genengine_vllm.settings:resolve_settings",
}
"""The GPU backends' own validation of a whole ``EngineConfig``: plain functions that start and import no engine."""


def check_engine_config(config: EngineConfig, *, model_given: bool) -> None:
    """The checks ``create_engine`` would make, run before TRL loads the policy (minutes at 7B) so that a bad
    genengine config fails first: the backend is registered and installed, the model folder exists (``model_given``:
    the user's genengine config named it), and the backend's options (and, for sglang and vllm, every setting).

    A policy given by a hub id that is not in the local cache yet has no folder until TRL downloads it: then the
    checks that read the model wait for ``create_engine``. Starts nothing.
    """
    backend = config.backend
    if not isinstance(backend, str):
        return  # an engine class or instance: its own from_config checks, when TRL builds the generator
    info = get_backend(backend)  # unknown or not installed: the error lists what is, and how to get the rest
    model_known = config.model is not None and (model_given or os.path.isdir(config.model))
    if model_known:
        try:
            resolve_model_dir(config.model)
        except ConfigError as exc:
            source = (
                "the genengine config's model (leave it out and the engine serves the policy's own path)"
                if model_given
                else "the policy's path, which the engine serves"
            )
            raise ConfigError(f"{exc} ({source})") from exc
    options = config.options
    if backend == "transformers":
        from genengine.backends.transformers import OPTIONS

        check_options(backend, options, OPTIONS)
        check_device(options.get("device", "cpu"))
    elif backend in _SETTINGS_CHECKS:
        if model_known:  # the settings read the model's config.json
            resolve_ref(_SETTINGS_CHECKS[backend])(config)
    else:  # a plugin's backend: the option names, where it is built with genengine's FromConfig
        try:
            factory = resolve_ref(info.factory)
        except (ImportError, AttributeError) as exc:
            raise BackendImportError(
                f"backend {backend!r} (distribution {info.distribution!r}) failed to import its engine: {exc}"
            ) from exc
        owner = getattr(factory, "__self__", None)
        if isinstance(owner, type) and issubclass(owner, FromConfig):
            check_options(owner.backend_name or backend, options, owner.config_options)


class GenEngineGeneration(_vllm_generation.VLLMGeneration):
    """``VLLMGeneration`` with a genengine engine in place of ``vllm.LLM``: same constructor, same
    ``sync_weights()`` and ``generate(...)`` results, so TRL's trainers use it unchanged.

    ``genengine`` is the engine config (as ``create_engine`` takes it); ``seed`` is the run's seed, to which each
    process adds its index, as TRL seeds one vLLM per process. Colocated only: one engine per training process.
    """

    def __init__(self, *args: Any, genengine: Any, seed: int = 0, **kwargs: Any) -> None:
        self._genengine = engine_config_source(genengine)
        self._seed = seed
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
                raise ConfigError(_no_images(config.backend))
            if self.enable_sleep_mode:
                engine.sleep(level=2)  # as TRL: nothing held until the first sync
        except BaseException:
            engine.shutdown()
            raise
        self.engine = engine
        self._llm_weights_sleeping = self.enable_sleep_mode
        self.accelerator.wait_for_everyone()

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
        own = not (self._walk_moves() or self._dist.is_fsdp)
        self.last_load = engine.load_weights(list(walk) if own else walk, version=self._next_version())

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
            engine.sleep(level=2)
            self._llm_weights_sleeping = True
        return prompt_ids, completion_ids, logprobs, token_ids


# ---- the trainers ------------------------------------------------------------------------------------------------
_swap_lock = threading.Lock()


@contextmanager
def _generation_class(module: ModuleType, genengine: Any, seed: int) -> Iterator[None]:
    """While the trainer's ``__init__`` runs, its module's ``VLLMGeneration`` builds a ``GenEngineGeneration``
    (TRL looks the name up when it builds the generator). Only for this thread: a plain TRL trainer built at the
    same time in another thread still gets TRL's class."""
    original = getattr(module, "VLLMGeneration")  # noqa: B009 (mypy: TRL's modules do not re-export it)
    owner = threading.get_ident()

    def build(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != owner:
            return original(*args, **kwargs)
        return GenEngineGeneration(*args, genengine=genengine, seed=seed, **kwargs)

    with _swap_lock:
        setattr(module, "VLLMGeneration", build)  # noqa: B010
        try:
            yield
        finally:
            setattr(module, "VLLMGeneration", original)  # noqa: B010


class _GenEngineTrainer:
    """A TRL trainer that takes ``genengine=CONFIG``: with it, TRL's vLLM path runs on that engine; without it,
    the trainer is TRL's, unchanged."""

    _trl_trainer: ClassVar[type]
    _trl_module: ClassVar[ModuleType]
    _trl_config: ClassVar[type]

    def __init__(self, *args: Any, genengine: Any = None, **kwargs: Any) -> None:
        if genengine is None:
            super().__init__(*args, **kwargs)
            return
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
        if isinstance(bound.arguments.get("processing_class"), ProcessorMixin) and backend in _NO_IMAGES:
            raise ConfigError(_no_images(backend))
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
            with _generation_class(self._trl_module, genengine, config.seed):
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
