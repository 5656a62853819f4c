"""verl's rollout config → genengine's engine config, checked without verl and without starting anything.

verl passes ``actor_rollout_ref.rollout.engine_kwargs`` through untouched (a plain dict), so genengine's own
settings live under ``engine_kwargs.genengine``::

    actor_rollout_ref.rollout.name=genengine
    +actor_rollout_ref.rollout.engine_kwargs.genengine.backend=sglang
    +actor_rollout_ref.rollout.engine_kwargs.genengine.options.attention_backend=fa3   # optional

The model, dtype, memory share, TP size, seed, max length and sleep come from verl's own rollout fields. Every
refusal is a :class:`~genengine.errors.ConfigError` naming the verl key, raised where the replica (driver) and
the server adapter (each trainer worker) are built, before any engine starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from genengine.config import EngineConfig
from genengine.errors import ConfigError, GenEngineError, closest

__all__ = ["GENENGINE_KEYS", "NAME", "VerlEngineSettings", "engine_settings", "genengine_kwargs", "trl_conflict"]

NAME = "genengine"
"""``actor_rollout_ref.rollout.name`` that selects genengine (and the key under ``engine_kwargs``)."""

GENENGINE_KEYS = ("backend", "options", "transport", "sleep_level", "bucket_megabytes", "timeout_s")
"""Keys allowed under ``rollout.engine_kwargs.genengine``."""

_PREFIX = "actor_rollout_ref.rollout"
_MAX_LEN_OPTION = {"vllm": "max_model_len", "sglang": "context_length"}
"""The option each GPU backend takes verl's ``max_model_len`` as (the embedded backend has none: the server
enforces the bound itself)."""
_EAGER_OPTION = {"vllm": "disable_cuda_graph", "sglang": "disable_cuda_graph"}
"""The option each GPU backend takes verl's ``enforce_eager=True`` as (verl's own servers pass it as vLLM's
``enforce_eager`` and SGLang's ``disable_cuda_graph``): without it the engine captures CUDA graphs, and vLLM
compiles with torch.compile, whose cache verl's runtime env turns off (``VLLM_DISABLE_COMPILE_CACHE=1``)."""
_TRANSPORTS = ("cuda_ipc", "nccl", "gloo")


@dataclass(frozen=True)
class VerlEngineSettings:
    """What the server actor and the server adapter need: the engine config and how weights reach it."""

    engine: EngineConfig
    transport: str
    """Weight-sync transport between the trainer worker (rank 0) and the server actor (rank 1)."""
    sleep_level: int
    """genengine sleep level for verl's ``sleep()`` in hybrid mode (2: weights and KV cache freed)."""
    bucket_bytes: int
    timeout_s: float
    max_model_len: int | None
    prompt_length: int
    response_length: int
    free_cache_engine: bool


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def genengine_kwargs(rollout: Any) -> dict[str, Any]:
    """``rollout.engine_kwargs.genengine`` as a plain dict, its keys checked."""
    engine_kwargs = _get(rollout, "engine_kwargs") or {}
    if not isinstance(engine_kwargs, Mapping):
        raise ConfigError(f"{_PREFIX}.engine_kwargs={engine_kwargs!r} must be a mapping")
    raw = engine_kwargs.get(NAME)
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{_PREFIX}.engine_kwargs.{NAME}={raw!r} must be a mapping such as {{backend: sglang, options: {{...}}}}"
        )
    data = _plain(raw)
    for key in data:
        if key not in GENENGINE_KEYS:
            hint = closest(key, GENENGINE_KEYS)
            raise ConfigError(
                f"unknown key {_PREFIX}.engine_kwargs.{NAME}.{key}"
                + (f" (did you mean {hint!r}?)" if hint else "")
                + f"; allowed: {', '.join(GENENGINE_KEYS)}"
            )
    return data


def _model_path(model: Any) -> str | None:
    for key in ("local_path", "path"):
        value = _get(model, key)
        if isinstance(value, str) and value:
            return value
    return None


def _int(key: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{key}={value!r} must be an integer >= {lo}")
    return value


def engine_settings(rollout: Any, model: Any = None, *, check_backend: bool = True) -> VerlEngineSettings:
    """The engine settings for verl's ``rollout`` config (a ``RolloutConfig``, its DictConfig or a dict) and
    ``model`` config (``HFModelConfig`` or a mapping with ``path``). With ``check_backend`` the backend is
    resolved and its options checked too (``genengine.plugins.registry.check_engine_config``: imports the backend's
    engine module, starts nothing)."""
    from genengine.plugins.registry import available_backends
    from genengine.plugins.registry import check_engine_config as check_backend_config

    name = _get(rollout, "name")
    if name != NAME:
        raise ConfigError(f"{_PREFIX}.name={name!r}: the genengine rollout is selected by name={NAME!r}")
    data = genengine_kwargs(rollout)
    backend = data.get("backend")
    if not isinstance(backend, str) or not backend:
        names = ", ".join(b.name for b in available_backends() if b.error is None)
        raise ConfigError(
            f"{_PREFIX}.engine_kwargs.{NAME}.backend is not set ({backend!r}): give a genengine backend "
            f"(+{_PREFIX}.engine_kwargs.{NAME}.backend=sglang); installed: {names}"
        )
    tp = _int(f"{_PREFIX}.tensor_model_parallel_size", _get(rollout, "tensor_model_parallel_size", 1), 1)
    for key in ("data_parallel_size", "pipeline_model_parallel_size", "expert_parallel_size"):
        value = _get(rollout, key, 1)
        if value not in (None, 1):
            raise ConfigError(
                f"{_PREFIX}.{key}={value!r} is not supported with rollout.name={NAME} yet: genengine runs one "
                "engine per replica with tensor parallelism only; allowed: 1"
            )
    gpus = _int(f"{_PREFIX}.n_gpus_per_node", _get(rollout, "n_gpus_per_node", 1), 1)
    nnodes = _get(rollout, "nnodes", 0) or 1
    if (gpus * nnodes) % tp:
        raise ConfigError(
            f"{_PREFIX}.tensor_model_parallel_size={tp} does not divide the {gpus * nnodes} GPU(s) "
            f"(n_gpus_per_node={gpus} x nnodes={nnodes}): every replica takes tp GPUs of one node; allowed: a "
            f"divisor of {gpus}"
        )
    if tp > gpus:
        raise ConfigError(
            f"{_PREFIX}.tensor_model_parallel_size={tp} is larger than n_gpus_per_node={gpus}: a genengine replica "
            "runs on one node"
        )
    if _get(_get(rollout, "disaggregation") or {}, "enabled", False):
        raise ConfigError(f"{_PREFIX}.disaggregation.enabled=True is not supported with rollout.name={NAME}")
    max_len = _get(rollout, "max_model_len")
    if max_len is not None:
        max_len = _int(f"{_PREFIX}.max_model_len", max_len, 2)
    prompt_length = _int(f"{_PREFIX}.prompt_length", _get(rollout, "prompt_length", 512), 1)
    response_length = _int(f"{_PREFIX}.response_length", _get(rollout, "response_length", 512), 1)
    options = data.get("options") or {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"{_PREFIX}.engine_kwargs.{NAME}.options={options!r} must be a mapping of backend options")
    options = dict(options)
    option = _MAX_LEN_OPTION.get(backend)
    if option is not None and max_len is not None:
        options.setdefault(option, max_len)
    eager = _EAGER_OPTION.get(backend)
    if eager is not None and bool(_get(rollout, "enforce_eager", False)):
        options.setdefault(eager, True)
    free_cache = bool(_get(rollout, "free_cache_engine", True))
    try:
        engine = EngineConfig(
            backend=backend,
            model=_model_path(model) if model is not None else None,
            tp_size=tp,
            mem_util=_get(rollout, "gpu_memory_utilization", 0.5),
            dtype=_get(rollout, "dtype", "bfloat16"),
            enable_sleep=free_cache and bool(_get(rollout, "enable_sleep_mode", True)),
            seed=_get(rollout, "seed", 0),
            options=options,
        )
    except ConfigError as exc:
        raise ConfigError(f"{_PREFIX} (rollout.name={NAME}): {exc}") from exc
    if check_backend:
        try:
            check_backend_config(engine)
        except GenEngineError as exc:  # the backend's own error class (unknown, not installed, bad option)
            raise type(exc)(f"{_PREFIX}.engine_kwargs.{NAME}: {exc}") from exc
    default_transport = "gloo" if backend == "transformers" and options.get("device", "cpu") == "cpu" else "cuda_ipc"
    transport = data.get("transport", default_transport)
    if transport not in _TRANSPORTS:
        hint = closest(str(transport), _TRANSPORTS)
        raise ConfigError(
            f"{_PREFIX}.engine_kwargs.{NAME}.transport={transport!r}"
            + (f" (did you mean {hint!r}?)" if hint else "")
            + f"; allowed: {', '.join(_TRANSPORTS)}"
        )
    level = data.get("sleep_level", 2)
    if level not in (1, 2) or isinstance(level, bool):
        raise ConfigError(
            f"{_PREFIX}.engine_kwargs.{NAME}.sleep_level={level!r}; allowed: 1 (keep weights in host memory) "
            "or 2 (free weights too: verl syncs them after every sleep)"
        )
    mb = _int(f"{_PREFIX}.engine_kwargs.{NAME}.bucket_megabytes", data.get("bucket_megabytes", 512), 1)
    timeout = data.get("timeout_s", 120.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"{_PREFIX}.engine_kwargs.{NAME}.timeout_s={timeout!r} must be a number of seconds > 0")
    return VerlEngineSettings(
        engine=engine,
        transport=transport,
        sleep_level=level,
        bucket_bytes=mb << 20,
        timeout_s=float(timeout),
        max_model_len=max_len,
        prompt_length=prompt_length,
        response_length=response_length,
        free_cache_engine=free_cache,
    )


def trl_conflict() -> str | None:
    """Why the installed TRL breaks verl 0.9.1's FSDP workers, or None. verl patches
    ``AutoModelForCausalLMWithValueHead`` whenever TRL is importable (``verl/models/transformers/monkey_patch.py``)
    and pins trl==0.27.0 for it; TRL 1.x no longer has the class, and the actor dies at init, whichever rollout.
    Read from the distribution's file list and sources, without importing TRL (every verl process runs this)."""
    from importlib import metadata

    try:
        dist = metadata.distribution("trl")
    except metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name.endswith(".py") and "value_head" in file.name:
            try:
                if "class AutoModelForCausalLMWithValueHead" in file.read_text():
                    return None
            except OSError:
                continue
    return (
        f"trl {dist.version} is installed and has no AutoModelForCausalLMWithValueHead, which verl 0.9.1's FSDP "
        "workers import whenever TRL is importable (verl pins trl==0.27.0): the actor will fail at init with an "
        "ImportError. In the verl environment install trl==0.27.0 or uninstall trl"
    )
