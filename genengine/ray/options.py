"""``PoolOptions``: everything ``EnginePool`` takes, checked before any actor or placement group exists.

Bad input raises ``ConfigError`` naming the value and what is allowed, and the cluster is left as it was.
Importing this module imports neither Ray nor torch (``check_bundles`` imports Ray's placement-group type
when the pool is colocated).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from genengine.config import EngineConfig, option_int, option_number
from genengine.errors import BackendImportError, ConfigError, GenEngineError, InvalidArgumentError, closest
from genengine.plugins.registry import available_backends, get_backend, resolve_config

__all__ = ["PLACEMENTS", "Placement", "PoolOptions", "check_bundles", "ray_module"]

Placement = Literal["separate", "colocated"]
PLACEMENTS: tuple[Placement, ...] = ("separate", "colocated")
_TRANSPORT_OPTIONS = ("bucket_bytes", "checksum", "timeout_s")


def ray_module() -> Any:
    """``ray``, imported now (a pool needs it only once it starts)."""
    try:
        import ray
    except ImportError as exc:
        raise BackendImportError("genengine.ray needs Ray: pip install 'genengine[ray]'") from exc
    return ray


@dataclass(frozen=True)
class PoolOptions:
    """The checked arguments of ``EnginePool`` (see its docstring for what each means)."""

    config: EngineConfig
    placement: Placement
    placement_group: Any
    bundles: tuple[int | None, ...]
    """One entry per replica to start: its bundle of ``placement_group`` (colocated), or None (separate)."""
    num_gpus: float
    num_cpus: float
    transport: str | None
    transport_options: Mapping[str, Any]
    keep_weights: bool
    weights_source: Callable[[], Iterable[tuple[str, Any]]] | None
    request_retries: int
    timeout_s: float
    start_timeout_s: float
    request_timeout_s: float
    max_restarts: int
    prefix_tokens: int
    runtime_env: Mapping[str, Any] | None
    vocab_size: int | None
    """From the model's ``config.json`` when it is on this machine: token ids are checked before they travel."""

    @classmethod
    def check(
        cls,
        config: Any,
        engine_kwargs: Mapping[str, Any],
        *,
        num_replicas: Any,
        placement: Any,
        placement_group: Any,
        bundle_indices: Sequence[int] | None,
        num_gpus: Any,
        num_cpus: Any,
        transport: Any,
        transport_options: Mapping[str, Any] | None,
        keep_weights: Any,
        weights_source: Any,
        request_retries: Any,
        timeout_s: Any,
        start_timeout_s: Any,
        request_timeout_s: Any,
        max_restarts: Any,
        prefix_tokens: Any,
        runtime_env: Any,
    ) -> PoolOptions:
        """Every option checked, in the order ``EnginePool`` has always checked them."""
        cfg = _engine_config(config, engine_kwargs)
        count = option_int("num_replicas", num_replicas)
        if placement not in PLACEMENTS:
            hint = closest(str(placement), PLACEMENTS)
            raise ConfigError(
                f"placement={placement!r}" + (f" (did you mean {hint!r}?)" if hint else "") + "; allowed: "
                "'separate' (replicas on GPUs of their own) or 'colocated' (in the trainer's placement group)"
            )
        gpus, cpus = _resource("num_gpus", num_gpus), _resource("num_cpus", num_cpus)
        bundles = check_bundles(placement, count, placement_group, bundle_indices, gpus, cpus)
        if transport is not None:
            _check_transport(transport, keep_weights)
        if not isinstance(keep_weights, bool):
            raise ConfigError(f"keep_weights={keep_weights!r} must be True or False")
        if weights_source is not None and not callable(weights_source):
            raise ConfigError(f"weights_source={weights_source!r} must be a callable returning (name, tensor) pairs")
        retries = option_int("request_retries", request_retries, lo=0)
        timeout = option_number("timeout_s", timeout_s)
        merged = _transport_options(transport, transport_options, timeout)
        start_timeout = option_number("start_timeout_s", start_timeout_s)
        request_timeout = option_number("request_timeout_s", request_timeout_s)
        restarts = option_int("max_restarts", max_restarts, lo=-1)
        prefix = option_int("prefix_tokens", prefix_tokens)
        if runtime_env is not None and not isinstance(runtime_env, Mapping):
            raise ConfigError(f"runtime_env={runtime_env!r} must be a mapping (Ray's runtime_env) or None")
        return cls(
            config=cfg,
            placement=placement,
            placement_group=placement_group,
            bundles=tuple(bundles),
            num_gpus=gpus,
            num_cpus=cpus,
            transport=transport,
            transport_options=merged,
            keep_weights=keep_weights,
            weights_source=weights_source,
            request_retries=retries,
            timeout_s=timeout,
            start_timeout_s=start_timeout,
            request_timeout_s=request_timeout,
            max_restarts=restarts,
            prefix_tokens=prefix,
            runtime_env=dict(runtime_env) if runtime_env is not None else None,
            vocab_size=_vocab_size(cfg.model),
        )


def _engine_config(config: Any, kwargs: Mapping[str, Any]) -> EngineConfig:
    """The replicas' ``EngineConfig``: ``config`` with ``kwargs`` applied as ``create_engine`` applies them."""
    cfg = resolve_config(config, kwargs)
    backend = cfg.backend
    if isinstance(backend, str):
        known = {b.name: b for b in available_backends()}.get(backend)
        if known is None or known.error is not None:
            get_backend(backend)  # raises the registry's error (lists what is installed)
        # A backend whose engine package is missing here may be installed on the replicas' nodes.
    elif not isinstance(backend, type):
        raise ConfigError(
            f"backend={backend!r}: an EnginePool takes a registered backend name or an engine class (built in "
            "each replica), not an engine instance"
        )
    if cfg.model is None:
        raise ConfigError(f"backend {backend!r} needs a model: pass model=PATH")
    if cfg.tp_size != 1:
        raise ConfigError(
            f"tp_size={cfg.tp_size}: EnginePool replicas run one engine process each (tp_size=1); a replica of "
            "several ranks needs its own torch.distributed group and is not supported yet"
        )
    return cfg


def _vocab_size(model: Any) -> int | None:
    """The vocabulary size in the model's ``config.json``, or None when the model is not a directory here
    (the replicas' nodes may hold it elsewhere; their engines check token ids then)."""
    from genengine.engine.checkpoint import read_model_config, vocab_size

    if not isinstance(model, (str, os.PathLike)) or not os.path.isfile(os.path.join(model, "config.json")):
        return None
    try:
        return vocab_size(read_model_config(os.fspath(model)))
    except GenEngineError:
        return None


def _resource(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise ConfigError(f"{name}={value!r} must be a finite number >= 0")
    if value > 1 and float(value) != int(value):
        raise ConfigError(f"{name}={value!r}: Ray takes a fraction of one device (< 1) or a whole number")
    return float(value)


def check_bundles(
    placement: Placement,
    count: int,
    pg: Any,
    bundle_indices: Sequence[int] | None,
    num_gpus: float,
    num_cpus: float,
) -> list[int | None]:
    """The bundle of each of ``count`` new replicas: None each when separate, else checked indices into the
    trainer's placement group whose bundles hold ``num_gpus`` and ``num_cpus``."""
    if placement == "separate":
        if pg is not None or bundle_indices is not None:
            raise ConfigError(
                "placement='separate' makes the replicas' placement groups itself: placement_group and "
                "bundle_indices are for placement='colocated'"
            )
        if num_gpus == 0 and num_cpus == 0:
            raise ConfigError("num_gpus=0 and num_cpus=0: a separate replica needs some resource to be placed")
        return [None] * count
    from ray.util.placement_group import PlacementGroup

    if not isinstance(pg, PlacementGroup):
        raise ConfigError(
            f"placement='colocated' needs placement_group= (the trainer's ray PlacementGroup), got {pg!r}"
        )
    specs = pg.bundle_specs
    indices = list(range(count)) if bundle_indices is None else list(bundle_indices)
    if len(indices) != count:
        raise ConfigError(f"bundle_indices={list(indices)!r} has {len(indices)} entries for {count} replicas")
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(specs):
            raise ConfigError(f"bundle index {i!r} is not one of the placement group's bundles 0..{len(specs) - 1}")
        for name, want in (("GPU", num_gpus), ("CPU", num_cpus)):
            if want > specs[i].get(name, 0):
                raise ConfigError(
                    f"num_{name.lower()}s={want:g} does not fit bundle {i} of the placement group ({specs[i]})"
                )
    return list(indices)


def _check_transport(transport: Any, keep_weights: Any) -> None:
    if not isinstance(transport, str):
        raise ConfigError(f"transport={transport!r} must be a transport name or None (the object store)")
    try:
        from genengine.transport import get_transport
    except ImportError as exc:
        raise ConfigError(
            f"transport={transport!r} needs genengine.transport, which this genengine does not have; "
            "transport=None syncs weights through Ray's object store"
        ) from exc
    get_transport(transport)  # an unknown name raises, listing the registered ones
    if keep_weights:
        raise ConfigError(
            "keep_weights=True keeps the object store's copy of each sync, and with a transport there is "
            "none: register weights_source= to refill restarted replicas instead"
        )


def _transport_options(transport: str | None, options: Mapping[str, Any] | None, timeout_s: float) -> dict[str, Any]:
    """The ``TransportSpec`` fields the pool's groups get (checksums on, the pool's timeout), checked now by
    building a spec with them."""
    if options is None:
        options = {}
    elif transport is None:
        raise ConfigError(f"transport_options={dict(options)!r} needs transport= (a transport name)")
    if not isinstance(options, Mapping):
        raise ConfigError(f"transport_options={options!r} must be a mapping of TransportSpec fields or None")
    for key in options:
        if key not in _TRANSPORT_OPTIONS:
            hint = closest(str(key), _TRANSPORT_OPTIONS)
            raise ConfigError(
                f"transport_options key {key!r}"
                + (f" (did you mean {hint!r}?)" if hint else "")
                + "; allowed: "
                + ", ".join(_TRANSPORT_OPTIONS)
                + " (the pool sets the address, world size, group name and device itself)"
            )
    merged = {"checksum": True, "timeout_s": timeout_s, **options}
    if transport is not None:
        from genengine.transport import TransportSpec

        try:
            TransportSpec(transport, "127.0.0.1:1", 2, "check", **merged)
        except InvalidArgumentError as exc:
            raise ConfigError(f"transport_options: {str(exc).removeprefix('TransportSpec ')}") from exc
    return merged
