"""The genengine config of TRL's trainers, resolved and checked without TRL: every refusal comes before the policy
loads (TRL loads it in the trainer's ``__init__``, minutes at 7B), and a config can be checked where TRL is absent."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from genengine.config import EngineConfig
from genengine.engine.checkpoint import resolve_model_dir
from genengine.errors import ConfigError, InvalidArgumentError, closest
from genengine.plugins.registry import available_backends, get_backend, resolve_ref
from genengine.plugins.registry import check_engine_config as check_backend_config
from genengine.protocol import SamplingParams

__all__ = [
    "CONFIG_KEYS",
    "NO_IMAGES",
    "check_engine_config",
    "check_trl_settings",
    "engine_config_source",
    "no_images",
    "resolve_engine_config",
]

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


NO_IMAGES = ("transformers",)
"""Backends known to take no images (checked before the engine is built; others are asked once built)."""


def no_images(backend: Any) -> str:
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
    get_backend(backend)  # unknown or not installed: the error lists what is, and how to get the rest
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
    if backend in _SETTINGS_CHECKS:
        if model_known:  # the settings read the model's config.json
            resolve_ref(_SETTINGS_CHECKS[backend])(config)
    else:  # the embedded backend or a plugin's: the registry's own check (factory, option names and values)
        check_backend_config(config)
