"""Settings of one SGLang engine: validated options and the ``sglang.Engine`` keyword arguments they become.

Pure Python (no torch, no sglang), so every check runs, and is tested, on machines without a GPU or SGLang:
bad input fails here, before any process or GPU memory is taken.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from genengine.backend import EngineConfig, check_options, option_bool, option_int, option_number
from genengine.engine.checkpoint import resolve_model_dir
from genengine.errors import ConfigError, InvalidArgumentError
from genengine_sglang.adapters import adapter_settings
from genengine_sglang.compat import check_installed, recorded_server_args, split_graph_options

__all__ = [
    "BACKEND",
    "DEFAULT_BUCKET_BYTES",
    "GRAPH_SAVER_ENV",
    "LOGIT_PROCESSOR_PARAM",
    "OPTIONS_ENV",
    "OUR_OPTIONS",
    "SYNC_LOADER",
    "WEIGHT_SYNC_MODES",
    "SGLangSettings",
    "check_graph_memory_saver",
    "check_model_dir",
    "options_from_env",
    "passthrough_options",
    "resolve_settings",
    "server_kwargs",
]

BACKEND = "sglang"

OPTIONS_ENV = "GENENGINE_SGLANG_OPTIONS"
"""JSON object of engine options applied to every SGLang engine of this process (explicit options win).

For machine settings that ``get_sglang_engine``'s fixed signature cannot carry, e.g.
``{"attention_backend": "triton", "sampling_backend": "pytorch"}`` where FlashAttention 3 is not installed.
"""

WEIGHT_SYNC_MODES = ("handles", "flattened", "per_param")
"""How ``load_weights`` hands tensors to SGLang (all through CUDA IPC, gathered to the TP leader):

``handles``: one call per bucket carrying every tensor's IPC handle (no copy on our side);
``flattened``: one flat buffer per bucket, SGLang's ``load_format="flattened_bucket"`` (one copy);
``per_param``: one call per tensor, as LightRFT does (the benchmark baseline).
"""

DEFAULT_BUCKET_BYTES = {"handles": 1 << 30, "flattened": 512 << 20, "per_param": 512 << 20}
"""What a bucket may copy. A handle to a tensor already on the engine's GPU copies nothing and counts 0
(``SGLangEngine._bucket_cost``): such tensors all go in one call, whatever the bucket; host tensors and
flattened buckets are copies, bounded by these."""

SYNC_LOADER = "genengine_sglang._scheduler_hooks.load_weights_and_sync"
"""Registered as SGLang's ``custom_weight_loader``: loads, then synchronises the scheduler's GPU, so the
reply to an ``update_weights_from_tensor`` call means the trainer's tensors have been read."""

LOGIT_PROCESSOR_PARAM = "genengine_filter"
"""Key of our per-request parameters (temperature, top-k, top-p) in SGLang's ``custom_params``."""

OUR_OPTIONS: dict[str, Any] = {
    "weight_sync_mode": "handles",
    "bucket_bytes": None,
    "weight_sync_barrier": "loader",
    "enable_weights_cpu_backup": False,
    "release_timeout_s": 10.0,
    "base_port": 40000,
    "base_gpu_id": None,
    "collective_timeout_s": None,
    "check_inputs": True,
    "server_args": {},
    "allow_unverified_version": False,
}
"""genengine's own options, with defaults (``allow_unverified_version``: see ``genengine_sglang.compat``)."""

_RESERVED_SERVER_ARGS = {
    "model_path": "model",
    "tp_size": "tp_size",
    "mem_fraction_static": "mem_util",
    "dtype": "dtype",
    "enable_memory_saver": "enable_sleep",
    "random_seed": "seed",
    "base_gpu_id": "options['base_gpu_id']",
    "custom_weight_loader": "(set by genengine)",
    "enable_custom_logit_processor": "(set by genengine)",
    "nnodes": "(single-node engines only)",
    "node_rank": "(single-node engines only)",
}
"""Server arguments genengine sets itself, each with what to use instead."""


@functools.cache
def passthrough_options() -> frozenset[str]:
    """The SGLang server arguments accepted as options and passed to ``sglang.Engine`` unchanged.

    Every field of the installed ``sglang.srt.server_args.ServerArgs`` (where SGLang is not installed or fails
    to import, which the engine's start reports: the recorded fields of the installed release, or of the newest
    verified one, ``compat.recorded_server_args``, made from each release's wheel by tools/engine_surface.py),
    less those genengine sets itself and genengine's own option names. Imported here, at
    resolve time, so that importing this module stays free of SGLang.
    """
    names: Iterable[str] | None = None
    if importlib.util.find_spec("sglang") is not None:
        try:
            from sglang.srt.server_args import ServerArgs

            names = [f.name for f in fields(ServerArgs)]
        except Exception:
            pass
    if names is None:
        names = recorded_server_args()
    return frozenset(names) - set(_RESERVED_SERVER_ARGS) - set(OUR_OPTIONS)


@dataclass(frozen=True)
class SGLangSettings:
    """Everything needed to start and drive one engine, validated."""

    model_path: str
    tp_size: int = 1
    mem_util: float = 0.8
    dtype: str = "bfloat16"
    enable_sleep: bool = True
    seed: int = 0
    skip_tokenizer_init: bool = False
    disable_cuda_graph: bool = False
    trust_remote_code: bool = True
    weight_sync_mode: str = "handles"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES["handles"]
    weight_sync_barrier: str = "loader"
    weights_cpu_backup: bool = False
    release_timeout_s: float = 10.0
    base_port: int = 40000
    base_gpu_id: int | None = None
    collective_timeout_s: float | None = None
    check_inputs: bool = True
    deterministic: bool = False
    server_overrides: Mapping[str, Any] = field(default_factory=dict)
    """SGLang server arguments from options (passthrough names and ``server_args``)."""


def options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The options in ``$GENENGINE_SGLANG_OPTIONS`` (a JSON object), or {} when unset."""
    raw = (os.environ if environ is None else environ).get(OPTIONS_ENV, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{OPTIONS_ENV}={raw!r} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{OPTIONS_ENV} must hold a JSON object of engine options, got {type(value).__name__}")
    return value


def check_model_dir(model: Any, *, what: str = "model") -> str:
    """The model's local directory (see ``genengine.engine.checkpoint.resolve_model_dir``); bad input is an
    ``InvalidArgumentError`` here, as the reference's callers expect."""
    return resolve_model_dir(model, what=what, error=InvalidArgumentError)


def resolve_settings(config: EngineConfig, *, environ: Mapping[str, str] | None = None) -> SGLangSettings:
    """Validate an ``EngineConfig`` (and ``$GENENGINE_SGLANG_OPTIONS``) into ``SGLangSettings``."""
    if config.model is None:
        raise ConfigError("the sglang backend needs a model: pass model=PATH")
    model_path = check_model_dir(config.model)
    options = {**options_from_env(environ), **dict(config.options)}
    passthrough = passthrough_options()
    check_options(BACKEND, options, OUR_OPTIONS, passthrough=sorted(passthrough), passthrough_from="sglang.ServerArgs")
    check_installed(options)  # an SGLang outside the verified range: refused before any process starts

    mode = options.get("weight_sync_mode", OUR_OPTIONS["weight_sync_mode"])
    if mode not in WEIGHT_SYNC_MODES:
        raise ConfigError(f"option weight_sync_mode={mode!r}: allowed are {', '.join(WEIGHT_SYNC_MODES)}")
    bucket = options.get("bucket_bytes")
    if bucket is None:
        bucket = DEFAULT_BUCKET_BYTES[mode]
    bucket = option_int("bucket_bytes", bucket, 1, 1 << 50)
    barrier = options.get("weight_sync_barrier", "loader")
    if barrier not in ("loader", "none"):
        raise ConfigError(
            f"option weight_sync_barrier={barrier!r}: allowed are 'loader' (the scheduler synchronises before "
            "it answers, so the trainer may reuse its tensors) and 'none' (trust CUDA-IPC release alone)"
        )
    base_gpu_id = options.get("base_gpu_id")
    if base_gpu_id is not None:
        base_gpu_id = option_int("base_gpu_id", base_gpu_id, 0, 1023)
    timeout = options.get("collective_timeout_s")
    if timeout is not None:
        timeout = option_number("collective_timeout_s", timeout)
    server_args = options.get("server_args", {})
    if not isinstance(server_args, Mapping):
        raise ConfigError(f"option server_args={server_args!r} must be a mapping of SGLang server arguments")
    overrides = {k: v for k, v in options.items() if k in passthrough}
    overrides.update(server_args)
    for key in overrides:
        if key in _RESERVED_SERVER_ARGS:
            raise ConfigError(f"server argument {key!r} is set by genengine; use {_RESERVED_SERVER_ARGS[key]} instead")
    for key in ("disable_cuda_graph", "skip_tokenizer_init", "trust_remote_code", "enable_deterministic_inference"):
        if key in overrides:
            option_bool(key, overrides[key])
    adapter_settings(overrides)  # enable_lora needs max_lora_rank and lora_target_modules: refused before a GPU is used

    return SGLangSettings(
        model_path=model_path,
        tp_size=config.tp_size,
        mem_util=float(config.mem_util),
        dtype=config.dtype,
        enable_sleep=config.enable_sleep,
        seed=config.seed,
        skip_tokenizer_init=bool(overrides.pop("skip_tokenizer_init", False)),
        disable_cuda_graph=bool(overrides.pop("disable_cuda_graph", False)),
        trust_remote_code=bool(overrides.pop("trust_remote_code", True)),
        weight_sync_mode=mode,
        bucket_bytes=bucket,
        weight_sync_barrier=barrier,
        weights_cpu_backup=option_bool("enable_weights_cpu_backup", options.get("enable_weights_cpu_backup", False)),
        release_timeout_s=option_number("release_timeout_s", options.get("release_timeout_s", 10.0)),
        base_port=option_int("base_port", options.get("base_port", 40000), 1, 65535),
        base_gpu_id=base_gpu_id,
        collective_timeout_s=timeout,
        check_inputs=option_bool("check_inputs", options.get("check_inputs", True)),
        deterministic=bool(overrides.get("enable_deterministic_inference", False)),
        server_overrides=overrides,
    )


def server_kwargs(settings: SGLangSettings, *, base_gpu_id: int, port: int, group_seed: int) -> dict[str, Any]:
    """``sglang.Engine(**kwargs)`` for these settings: the reference's arguments plus what genengine needs.

    ``group_seed`` is SGLang's ``random_seed``: ``settings.seed`` plus the TP group's index
    (``genengine.distributed.group_seed``), the same on every rank of the group.
    """
    kwargs: dict[str, Any] = {
        "model_path": settings.model_path,
        "tp_size": settings.tp_size,
        "mem_fraction_static": settings.mem_util,
        "dtype": settings.dtype,
        "base_gpu_id": base_gpu_id,
        "gpu_id_step": 1,
        "port": port,
        "skip_tokenizer_init": settings.skip_tokenizer_init,
        "trust_remote_code": settings.trust_remote_code,
        "disable_cuda_graph": settings.disable_cuda_graph,
        "random_seed": group_seed,
        # Sleep: the memory saver makes release_memory_occupation free memory at all (without it, nothing).
        "enable_memory_saver": settings.enable_sleep,
        "enable_weights_cpu_backup": settings.weights_cpu_backup,
        # Ours, run inside the scheduler: the synchronising weight loader, and the top-k/top-p filter that
        # makes SGLang's logprobs the processed kind.
        "custom_weight_loader": [SYNC_LOADER],
        "enable_custom_logit_processor": True,
    }
    kwargs.update(settings.server_overrides)
    return kwargs


GRAPH_SAVER_ENV = "SGLANG_MEMORY_SAVER_CUDA_GRAPH"


def check_graph_memory_saver(
    kwargs: Mapping[str, Any], environ: Mapping[str, str], server_args: Iterable[str] | None = None
) -> None:
    """Refuse, before any process starts, what SGLang 0.5.17 would crash on after loading the model.

    With ``$SGLANG_MEMORY_SAVER_CUDA_GRAPH`` true (so that a release frees the CUDA graphs' pool too, as
    slime sets it) and the memory saver on, SGLang's "breakable" CUDA graphs, its default for prefill on
    CUDA, raise ``NotImplementedError`` in the scheduler, and SGLang's launcher answers a failed child with
    SIGQUIT, which kills the trainer. Only the combination is refused. ``server_args``: the installed
    ``ServerArgs`` fields; before 0.5.14 (no per-phase graph backends, ``compat.split_graph_options``)
    breakable graphs are off unless ``enable_breakable_cuda_graph=True``, and only that is refused.
    """
    if environ.get(GRAPH_SAVER_ENV, "").strip().lower() not in ("1", "true"):
        return
    if not kwargs.get("enable_memory_saver") or kwargs.get("disable_cuda_graph"):
        return
    if server_args is not None and not split_graph_options(server_args):
        if kwargs.get("enable_breakable_cuda_graph"):
            raise ConfigError(
                f"{GRAPH_SAVER_ENV}={environ[GRAPH_SAVER_ENV]!r} with sleep on and enable_breakable_cuda_graph=True:"
                " SGLang's breakable CUDA graphs refuse the memory saver and its failure kills this process. "
                "Allowed: unset it, or leave enable_breakable_cuda_graph off, or disable_cuda_graph=True"
            )
        return
    prefill = kwargs.get("cuda_graph_backend_prefill")
    prefill_breakable = (
        prefill in (None, "breakable")
        and not kwargs.get("disable_prefill_cuda_graph")
        # a cuda_graph_config is SGLang's to resolve (it wins over the per-phase flags)
        and (prefill == "breakable" or kwargs.get("cuda_graph_config") is None)
    )
    decode_breakable = kwargs.get("cuda_graph_backend_decode") == "breakable"
    if prefill_breakable or decode_breakable:
        phase = "prefill" if prefill_breakable else "decode"
        raise ConfigError(
            f"{GRAPH_SAVER_ENV}={environ[GRAPH_SAVER_ENV]!r} with sleep on: SGLang 0.5.17's 'breakable' CUDA "
            f"graphs ({phase}{', its default' if prefill is None and phase == 'prefill' else ''}) refuse the "
            "memory saver and its failure kills this process. Allowed: unset it (a release then keeps the CUDA "
            "graphs' pool), or pass disable_prefill_cuda_graph=True or cuda_graph_backend_prefill='tc_piecewise' "
            "(and a decode backend other than 'breakable'), or disable_cuda_graph=True"
        )
