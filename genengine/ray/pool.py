"""``EnginePool``: N engine replicas as Ray actors behind the ``GenerationEngine`` protocol (and the async one).

The pool lives in the trainer's process (the driver, or a trainer actor for colocated setups); each replica is
an :class:`~genengine.ray.replica.EngineReplica` actor that builds its engine with ``create_engine``, so any
registered backend works. ``generate`` spreads prompts over the replicas with a
:class:`~genengine.ray.router.Router`; control calls go to every replica and wait at most ``timeout_s``; a
failure names the replica (index, actor id, node) and the call. A replica that Ray restarted gets the current
weights, version and sleep/pause state before it is routed to again (docs/deployment.md, "Health").

Importing this module imports neither Ray nor torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from genengine.aio import PauseMode, StreamChunk, normalize_async_request
from genengine.config import EngineConfig, option_int, option_number
from genengine.errors import (
    BackendImportError,
    ConfigError,
    EngineClosedError,
    EngineSleepingError,
    EngineStateError,
    GenEngineError,
    InvalidArgumentError,
    WeightsNotLoadedError,
    closest,
)
from genengine.protocol import TAG_WEIGHTS, EngineState, GenerationResult, LoadReport
from genengine.ray.errors import ReplicaDiedError, ReplicaError, ReplicaTimeoutError, StaleReplicaError
from genengine.ray.router import Router, prefix_key
from genengine.registry import available_backends, get_backend, resolve_config
from genengine.requests import Request, normalize_requests
from genengine.weights import check_load_options, check_named_tensors

if TYPE_CHECKING:
    from types import TracebackType

    import torch

__all__ = ["PLACEMENTS", "EnginePool", "PoolStream", "ReplicaInfo"]

_log = logging.getLogger(__name__)

Placement = Literal["separate", "colocated"]
PLACEMENTS: tuple[Placement, ...] = ("separate", "colocated")
Status = Literal["healthy", "stale", "dead"]


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise BackendImportError("genengine.ray needs Ray: pip install 'genengine[ray]'") from exc
    return ray


@dataclass(frozen=True)
class ReplicaInfo:
    """One replica as the pool sees it (``EnginePool.replicas``)."""

    index: int
    name: str
    """The Ray actor's name (``ray.get_actor(name)``)."""
    actor_id: str
    node_id: str
    node_ip: str
    pid: int
    status: Status
    """``healthy``: routed to; ``stale``: restarted or restarting, not refilled yet (or waiting for the next
    ``load_weights``); ``dead``: Ray gave up restarting it (``remove_replica`` it)."""
    needs_weights: bool
    load: int
    """Requests (counting each of their ``n`` samples) routed to it and not finished."""


@dataclass
class _Replica:
    index: int
    actor: Any
    config: EngineConfig
    bundle_index: int | None
    owned_pg: Any = None
    incarnation: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    status: Status = "stale"
    needs_weights: bool = False
    pending: Any = None  # an info() call in flight to a stale replica
    state: EngineState = field(default_factory=EngineState)
    version: int = 0

    @property
    def where(self) -> str:
        actor_id = self.info.get("actor_id") or self.actor._actor_id.hex()
        node = self.info.get("node_ip", "?")
        node_id = (self.info.get("node_id") or "?")[:12]
        return f"replica {self.index} (actor {actor_id}, node {node} {node_id})"


# ---- validation (all of it before any actor or placement group is made) ---------------------------------------
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


def _resource(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise ConfigError(f"{name}={value!r} must be a finite number >= 0")
    if value > 1 and float(value) != int(value):
        raise ConfigError(f"{name}={value!r}: Ray takes a fraction of one device (< 1) or a whole number")
    return float(value)


_TRANSPORT_OPTIONS = ("bucket_bytes", "checksum", "timeout_s")


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


def _renamed(exc: BaseException, message: str) -> BaseException:
    """``exc``'s type (a genengine error) with ``message``, else a ReplicaError; chained to ``exc``."""
    kind = type(exc) if isinstance(exc, GenEngineError) else ReplicaError
    try:
        error = kind(message)
    except Exception:
        error = ReplicaError(message)
    error.__cause__ = exc
    return error


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _host_tensor(tensor: Any) -> Any:
    """A tensor as the object store should carry it: gathered (DTensor), detached, in host memory. Anything
    else goes as is, for the replica's validation to name."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    device = getattr(tensor, "device", None)
    if device is not None and device.type not in ("cpu", "meta"):
        return tensor.detach().cpu()
    return tensor.detach() if hasattr(tensor, "detach") else tensor


class EnginePool:
    """``num_replicas`` engines as Ray actors, used exactly as one engine from ``create_engine``.

    ``config`` and ``engine_kwargs`` are what ``create_engine`` takes (each replica gets ``seed + index``, so
    unseeded samples differ between replicas). ``placement="separate"`` gives each replica a placement group of
    its own (one bundle of ``num_gpus`` GPUs and ``num_cpus`` CPUs); ``"colocated"`` puts replica ``i`` into
    bundle ``bundle_indices[i]`` of the trainer's ``placement_group`` with fractional ``num_gpus`` (the trainer
    actor of that bundle takes the rest), as verl and OpenRLHF share a GPU between trainer and rollout.

    ``transport`` (``"gloo"``, ``"nccl"``, ``"cuda_ipc"``): weight syncs go through ``genengine.transport``;
    None puts each synced tensor in Ray's object store once and every replica reads it from there.
    ``transport_options`` sets the group's ``TransportSpec`` fields ``bucket_bytes``, ``checksum`` (on by
    default here) and ``timeout_s`` (default: the pool's ``timeout_s``).
    """

    supports_async: ClassVar[bool] = True

    def __init__(
        self,
        config: Any = None,
        /,
        *,
        num_replicas: int = 1,
        placement: Placement = "separate",
        placement_group: Any = None,
        bundle_indices: Sequence[int] | None = None,
        num_gpus: float = 1.0,
        num_cpus: float = 1.0,
        transport: str | None = None,
        transport_options: Mapping[str, Any] | None = None,
        keep_weights: bool = False,
        weights_source: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
        request_retries: int = 0,
        timeout_s: float = 300.0,
        start_timeout_s: float = 900.0,
        request_timeout_s: float = 3600.0,
        max_restarts: int = 3,
        max_imbalance: int = 8,
        prefix_tokens: int = 64,
        runtime_env: Mapping[str, Any] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self._config = _engine_config(config, engine_kwargs)
        num_replicas = option_int("num_replicas", num_replicas)
        if placement not in PLACEMENTS:
            hint = closest(str(placement), PLACEMENTS)
            raise ConfigError(
                f"placement={placement!r}" + (f" (did you mean {hint!r}?)" if hint else "") + "; allowed: "
                "'separate' (replicas on GPUs of their own) or 'colocated' (in the trainer's placement group)"
            )
        self._num_gpus = _resource("num_gpus", num_gpus)
        self._num_cpus = _resource("num_cpus", num_cpus)
        self._placement = placement
        self._pg = placement_group
        self._bundles = self._check_placement(num_replicas, placement_group, bundle_indices)
        if transport is not None:
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
        if not isinstance(keep_weights, bool):
            raise ConfigError(f"keep_weights={keep_weights!r} must be True or False")
        if weights_source is not None and not callable(weights_source):
            raise ConfigError(f"weights_source={weights_source!r} must be a callable returning (name, tensor) pairs")
        self._transport_name = transport
        self._keep_weights = keep_weights
        self._weights_source = weights_source
        self._retries = option_int("request_retries", request_retries, lo=0)
        self._timeout_s = option_number("timeout_s", timeout_s)
        self._transport_options = _transport_options(transport, transport_options, self._timeout_s)
        self._start_timeout_s = option_number("start_timeout_s", start_timeout_s)
        self._request_timeout_s = option_number("request_timeout_s", request_timeout_s)
        self._max_restarts = option_int("max_restarts", max_restarts, lo=-1)
        self._prefix_tokens = option_int("prefix_tokens", prefix_tokens)
        if runtime_env is not None and not isinstance(runtime_env, Mapping):
            raise ConfigError(f"runtime_env={runtime_env!r} must be a mapping (Ray's runtime_env) or None")
        self._runtime_env = dict(runtime_env) if runtime_env is not None else None
        self.router = Router(max_imbalance=max_imbalance)

        self._id = uuid.uuid4().hex[:8]
        self._lock = threading.RLock()
        self._replicas: dict[int, _Replica] = {}
        self._next_index = 0
        self._closed = False
        self._version = 0
        self._paused: tuple[PauseMode, bool] | None = None
        self._loaded_once = False
        self._kept: dict[str, Any] = {}  # name -> object ref of the last synced tensor (keep_weights)
        self._streams: dict[str, PoolStream] = {}
        self._sender: Any = None
        self._group: tuple[tuple[int, str], ...] = ()
        self._group_name = ""
        self._group_count = 0
        self._common: dict[str, Any] = {}
        ray = _ray()
        if not ray.is_initialized():
            ray.init()
        try:
            self._start([self._new_replica(b) for b in self._bundles])
        except BaseException:
            self._teardown(list(self._replicas.values()))
            self._replicas.clear()
            raise
        first = next(iter(self._replicas.values())).info
        self._common = {k: first[k] for k in ("supported_tags", "vocab_size", "supports_images", "supports_async")}

    def _check_placement(self, count: int, pg: Any, bundle_indices: Sequence[int] | None) -> list[int | None]:
        if self._placement == "separate":
            if pg is not None or bundle_indices is not None:
                raise ConfigError(
                    "placement='separate' makes the replicas' placement groups itself: placement_group and "
                    "bundle_indices are for placement='colocated'"
                )
            if self._num_gpus == 0 and self._num_cpus == 0:
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
            for name, want in (("GPU", self._num_gpus), ("CPU", self._num_cpus)):
                if want > specs[i].get(name, 0):
                    raise ConfigError(
                        f"num_{name.lower()}s={want:g} does not fit bundle {i} of the placement group ({specs[i]})"
                    )
        return list(indices)

    # ---- replicas: start, restore, add, remove --------------------------------------------------------------
    def _new_replica(self, bundle_index: int | None) -> _Replica:
        """Create (not start) one replica actor, in its own placement group or the trainer's bundle."""
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from genengine.ray.replica import EngineReplica

        index, self._next_index = self._next_index, self._next_index + 1
        owned = None
        if bundle_index is None:
            bundle = {"CPU": self._num_cpus} if self._num_cpus else {}
            if self._num_gpus:
                bundle["GPU"] = self._num_gpus
            owned = placement_group([bundle], strategy="STRICT_PACK", name=f"genengine-pool-{self._id}-{index}")
            ready, _ = ray.wait([owned.ready()], timeout=self._start_timeout_s)
            if not ready:
                ray.util.remove_placement_group(owned)
                raise ReplicaTimeoutError(
                    f"replica {index}: the cluster could not place a bundle {bundle} within {self._start_timeout_s:g} "
                    f"s (available: {ray.available_resources()})"
                )
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=owned if owned is not None else self._pg,
            placement_group_bundle_index=0 if bundle_index is None else bundle_index,
        )
        options: dict[str, Any] = {
            "num_cpus": self._num_cpus,
            "num_gpus": self._num_gpus,
            "max_restarts": self._max_restarts,
            "max_task_retries": 0,
            "scheduling_strategy": strategy,
            "name": self._actor_name(index),
        }
        if self._runtime_env is not None:
            options["runtime_env"] = self._runtime_env
        actor = ray.remote(EngineReplica).options(**options).remote(index)
        replica = _Replica(index, actor, self._config.replace(seed=self._config.seed + index), bundle_index, owned)
        self._replicas[index] = replica
        return replica

    def _actor_name(self, index: int) -> str:
        return f"genengine-pool-{self._id}-replica-{index}"

    def _start(self, replicas: list[_Replica]) -> None:
        """Start the engines of new (or restarted) replicas, all at once, within ``start_timeout_s``."""
        infos = self._gather("start", [(r, r.actor.info.remote()) for r in replicas], self._start_timeout_s)
        for r, info in infos:
            r.info, r.incarnation = info, info["incarnation"]
        self._gather(
            "start", [(r, r.actor.start.remote(r.incarnation, r.config)) for r in replicas], self._start_timeout_s
        )
        infos = self._gather("start", [(r, r.actor.info.remote()) for r in replicas], self._start_timeout_s)
        for r, info in infos:
            r.info, r.state, r.version = info, info["state"], info["weight_version"]
            r.status, r.needs_weights = "healthy", False
            self.router.add(r.index)

    def _restore(self, replica: _Replica, info: dict[str, Any]) -> None:
        """Bring a restarted (or new) replica to the pool's weights, version, sleep and pause state."""
        with self._lock:
            replica.info, replica.incarnation, replica.pending = info, info["incarnation"], None
            if not info["started"]:
                self._gather("start", [(replica, replica.actor.start.remote(replica.incarnation, replica.config))])
            state = self.state if self._active() else EngineState()
            level = state.sleep_level
            loaded = False

            def load() -> bool:
                if self._weights_source is not None:
                    self._load([replica], self._weights_source(), self._version, None, False)
                elif self._kept:
                    names = list(self._kept)
                    self._load_refs([replica], names, [self._kept[n] for n in names], self._version, None, False)
                else:
                    return False
                return True

            if level != 2 and state.weights_loaded:  # level 1 keeps what was loaded: load before sleeping
                loaded = load()
            if level is not None:
                self._fanout("sleep", lambda r: r.actor.call.remote(r.incarnation, "sleep", level), [replica])
                awake = [t for t in self.supported_tags if t not in state.released_tags]
                if awake:
                    self._fanout("wake", lambda r: r.actor.call.remote(r.incarnation, "wake", awake), [replica])
                if level == 2 and state.weights_loaded and TAG_WEIGHTS in awake:
                    loaded = load()
            if self._paused is not None:
                mode, clear = self._paused
                self._fanout(
                    "pause_generation",
                    lambda r: r.actor.pause_generation.remote(r.incarnation, mode, clear),
                    [replica],
                )
            # Without a source its engine holds the disk checkpoint: no traffic until the next load_weights
            # (unless it refuses to generate anyway, as after a level-2 sleep).
            replica.needs_weights = self._loaded_once and not loaded and replica.state.weights_loaded
            replica.status = "healthy"
            if not replica.needs_weights:
                self.router.add(replica.index)
            _log.warning(
                "%s restored: weight version %d%s",
                replica.where,
                replica.version,
                ", waiting for the next load_weights" if replica.needs_weights else "",
            )

    def _mark_stale(self, replica: _Replica) -> None:
        with self._lock:
            if replica.status == "healthy":
                replica.status = "stale"
                with contextlib.suppress(InvalidArgumentError):
                    self.router.remove(replica.index)
                _log.warning("%s died or restarted: it takes no traffic until it is restored", replica.where)

    def _recover(self, wait: bool = False) -> None:
        """Restore every stale replica whose actor is back; with ``wait``, wait for them (``start_timeout_s``)."""
        ray = _ray()
        deadline = time.monotonic() + (self._start_timeout_s if wait else 0)
        with self._lock:
            while True:
                stale = [r for r in self._replicas.values() if r.status == "stale"]
                if not stale:
                    return
                for r in stale:
                    if r.pending is None:
                        r.pending = r.actor.info.remote()
                refs = [r.pending for r in stale]
                left = max(0.0, deadline - time.monotonic())
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=left)
                for r in stale:
                    if r.pending not in ready:
                        continue
                    try:
                        info = ray.get(r.pending)
                    except ray.exceptions.ActorDiedError:
                        # Not raised here: the caller (a generate retrying elsewhere, check_health) goes on with
                        # the replicas that are up; control calls raise for it (_check_dead) until it is removed.
                        r.status, r.pending = "dead", None
                        _log.error(
                            "%s is dead and Ray will not restart it (max_restarts=%d): it takes no traffic; "
                            "remove_replica(%d) it",
                            r.where,
                            self._max_restarts,
                            r.index,
                        )
                        continue
                    except ray.exceptions.RayActorError:
                        r.pending = None  # restarting: ask again
                        continue
                    self._restore(r, info)
                if not wait:
                    return
                waiting = [r for r in self._replicas.values() if r.status == "stale"]
                if waiting and time.monotonic() >= deadline:
                    raise ReplicaTimeoutError(
                        f"{waiting[0].where} did not come back within {self._start_timeout_s:g} s"
                    )
                if waiting:
                    time.sleep(0.05)

    def check_health(self, *, wait: bool = True) -> list[ReplicaInfo]:
        """Ping every replica (``timeout_s``); a restarted one is restored before this returns (``wait``), one
        that Ray will not restart is reported ``dead``."""
        self._check_open()
        with self._lock:
            alive = [r for r in self._replicas.values() if r.status == "healthy"]
            for r, outcome in self._collect(
                "check_health", [(r, r.actor.info.remote()) for r in alive], self._timeout_s
            ):
                if isinstance(outcome, BaseException) or outcome["incarnation"] != r.incarnation:
                    self._mark_stale(r)
            self._recover(wait=wait)
            return self.replicas

    def add_replica(self, *, bundle_index: int | None = None) -> int:
        """Start one more replica (``bundle_index`` of the trainer's placement group when colocated), give it
        the current weights and state, and route to it; returns its index."""
        self._check_open()
        if self._placement == "colocated":
            (bundle_index,) = self._check_placement(1, self._pg, [bundle_index] if bundle_index is not None else None)
        elif bundle_index is not None:
            raise ConfigError("bundle_index is for placement='colocated'")
        with self._lock:
            replica = self._new_replica(bundle_index)
            try:
                (info,) = (i for _, i in self._gather("start", [(replica, replica.actor.info.remote())]))
                self._restore(replica, info)
            except BaseException:
                self._teardown([replica])
                del self._replicas[replica.index]
                raise
            self._group = ()  # the weight-sync group is formed again with the new member
            return replica.index

    def remove_replica(self, index: int, *, drain_timeout_s: float | None = None) -> None:
        """Stop routing to replica ``index``, wait until its requests finished (``drain_timeout_s``, default
        ``timeout_s``), then shut it down."""
        self._check_open()
        replica = self._replicas.get(index) if isinstance(index, int) else None
        if replica is None:
            raise InvalidArgumentError(f"replica index={index!r} is not in the pool; it has {sorted(self._replicas)}")
        timeout = self._timeout_s if drain_timeout_s is None else option_number("drain_timeout_s", drain_timeout_s)
        with contextlib.suppress(InvalidArgumentError):
            self.router.remove(index)
        deadline = time.monotonic() + timeout
        while any(s._replica is replica and not s._done for s in list(self._streams.values())):
            if time.monotonic() > deadline:
                raise ReplicaTimeoutError(f"{replica.where} still has requests after {timeout:g} s of draining")
            time.sleep(0.05)
        with self._lock:
            del self._replicas[index]
            self._group = ()
        self._teardown([replica])

    def restart_replica(self, index: int) -> None:
        """Kill replica ``index``'s actor and let Ray restart it (a hung engine); it is restored at the next call."""
        self._check_open()
        replica = self._replicas.get(index) if isinstance(index, int) else None
        if replica is None:
            raise InvalidArgumentError(f"replica index={index!r} is not in the pool; it has {sorted(self._replicas)}")
        self._mark_stale(replica)
        _ray().kill(replica.actor, no_restart=False)

    @property
    def replicas(self) -> list[ReplicaInfo]:
        """Every replica, by index."""
        with self._lock:
            return [
                ReplicaInfo(
                    r.index,
                    self._actor_name(r.index),
                    r.info.get("actor_id") or r.actor._actor_id.hex(),
                    r.info.get("node_id", ""),
                    r.info.get("node_ip", ""),
                    int(r.info.get("pid", 0)),
                    r.status,
                    r.needs_weights,
                    self.router.load(r.index) if r.index in self.router.replicas else 0,
                )
                for r in sorted(self._replicas.values(), key=lambda r: r.index)
            ]

    # ---- fan-out ----------------------------------------------------------------------------------------------
    def _active(self) -> list[_Replica]:
        return [r for r in self._replicas.values() if r.status == "healthy"]

    def _translate(self, replica: _Replica, exc: BaseException, what: str) -> BaseException:
        """An error from a replica as the caller should see it: the same genengine error type, naming the replica."""
        ray = _ray()
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = exc.cause
            if isinstance(cause, StaleReplicaError):
                self._mark_stale(replica)
                return cause
            if isinstance(cause, GenEngineError):
                try:
                    renamed = type(cause)(f"{replica.where}: {what}: {cause}")
                except Exception:
                    renamed = ReplicaError(f"{replica.where}: {what} failed: {type(cause).__name__}: {cause}")
                renamed.__cause__ = cause
                return renamed
            error = ReplicaError(f"{replica.where}: {what} failed: {type(cause).__name__}: {cause}")
            error.__cause__ = cause
            return error
        if isinstance(exc, ray.exceptions.RayActorError):
            self._mark_stale(replica)
            error = ReplicaDiedError(f"{replica.where} died during {what}: {type(exc).__name__}: {str(exc)[:300]}")
            error.__cause__ = exc
            return error
        return exc

    def _collect(self, what: str, calls: list[tuple[_Replica, Any]], timeout: float) -> list[tuple[_Replica, Any]]:
        """Wait for one call per replica (at most ``timeout`` seconds in all): each one's value, or its error
        translated (``_translate``), or a ``ReplicaTimeoutError``."""
        ray = _ray()
        if not calls:
            return []
        refs = [ref for _, ref in calls]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        done = set(ready)
        out: list[tuple[_Replica, Any]] = []
        for replica, ref in calls:
            if ref not in done:
                out.append(
                    (replica, ReplicaTimeoutError(f"{replica.where}: {what} did not finish within {timeout:g} s"))
                )
                continue
            try:
                out.append((replica, ray.get(ref)))
            except Exception as exc:
                out.append((replica, self._translate(replica, exc, what)))
        return out

    def _gather(
        self, what: str, calls: list[tuple[_Replica, Any]], timeout: float | None = None, *, skip_stale: bool = False
    ) -> list[tuple[_Replica, Any]]:
        """``_collect``, raising the first failure once every call ended or timed out (all are logged). With
        ``skip_stale``, replicas that refused as restarted (they did nothing) are left out instead."""
        results = []
        errors: list[BaseException] = []
        for replica, outcome in self._collect(what, calls, self._timeout_s if timeout is None else timeout):
            if isinstance(outcome, StaleReplicaError) and skip_stale:
                continue
            if isinstance(outcome, BaseException):
                errors.append(outcome)
            else:
                results.append((replica, outcome))
        if errors:
            if len(errors) > 1:
                _log.error("%s failed on %d replicas: %s", what, len(errors), "; ".join(map(str, errors)))
            raise errors[0]
        return results

    def _fanout(
        self, what: str, submit: Callable[[_Replica], Any], replicas: list[_Replica] | None = None
    ) -> list[tuple[_Replica, Any]]:
        """A call on every replica (or on ``replicas``); ones that refuse as restarted (the call did nothing
        there) are skipped and restored later with the state this call leaves; any other failure raises."""
        self._check_open()
        if replicas is None:
            self._recover()
            self._check_dead()
            replicas = self._active()
            if not replicas:
                raise EngineStateError(f"{what}: no replica is up ({self._describe()})")
        results = []
        for replica, value in self._gather(what, [(r, submit(r)) for r in replicas], skip_stale=True):
            if isinstance(value, tuple) and len(value) == 3 and isinstance(value[1], EngineState):
                replica.state, replica.version = value[1], value[2]
                value = value[0]
            results.append((replica, value))
        return results

    def _check_dead(self) -> None:
        dead = [r for r in self._replicas.values() if r.status == "dead"]
        if dead:
            raise ReplicaDiedError(
                f"{dead[0].where} is dead and Ray will not restart it (max_restarts={self._max_restarts}): "
                f"remove_replica({dead[0].index}) it"
            )

    def _describe(self) -> str:
        return ", ".join(f"{r.index}: {r.status}" for r in sorted(self._replicas.values(), key=lambda r: r.index))

    # ---- state ----------------------------------------------------------------------------------------------
    @property
    def supported_tags(self) -> tuple[str, ...]:
        return tuple(self._common.get("supported_tags", ()))

    @property
    def state(self) -> EngineState:
        """The states of the replicas that take traffic, combined (of every replica up when none does): a tag
        released on any is released, weights are loaded only where each has them. A replica kept out of traffic
        until the next load (it holds a mix after a failed one) does not stop the others serving."""
        active = self._active()
        states = [r.state for r in active if not r.needs_weights] or [r.state for r in active] or [EngineState()]
        levels = [s.sleep_level for s in states if s.sleep_level is not None]
        return EngineState(
            released_tags=frozenset().union(*(s.released_tags for s in states)),
            sleep_level=max(levels) if levels else None,
            weights_loaded=all(s.weights_loaded for s in states),
            closed=self._closed,
        )

    @property
    def is_sleeping(self) -> bool:
        return self.state.is_sleeping

    @property
    def weight_version(self) -> int:
        """The version of the last ``load_weights`` that reached every replica (0 at start)."""
        return self._version

    @property
    def timeout_s(self) -> float:
        """How long a control call waits for every replica before it raises ``ReplicaTimeoutError``."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._timeout_s = option_number("timeout_s", value)

    @property
    def in_flight(self) -> int:
        """Streams submitted through this pool and not finished."""
        return sum(1 for s in list(self._streams.values()) if not s._done)

    @property
    def paused(self) -> PauseMode | None:
        return self._paused[0] if self._paused is not None else None

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the EnginePool was shut down; create a new one")

    def _check_can_generate(self) -> None:
        state = self.state
        if state.released_tags:
            ordered = [t for t in self.supported_tags if t in state.released_tags]
            raise EngineSleepingError(
                f"the pool is asleep (released: {', '.join(ordered)}); call wake() before generate"
            )
        if not state.weights_loaded:
            raise WeightsNotLoadedError(
                "the pool's weights are incomplete (a level-2 sleep or a failed load): load_weights first"
            )

    # ---- generate ----------------------------------------------------------------------------------------------
    def _requests(self, prompts: Any, sampling_params: Any, prompt_token_ids: Any, image_data: Any) -> list[Request]:
        return normalize_requests(
            prompts,
            sampling_params,
            prompt_token_ids=prompt_token_ids,
            image_data=image_data,
            vocab_size=self._common.get("vocab_size"),
            supports_images=bool(self._common.get("supports_images")),
        )

    def _keys(self, requests: list[Request], session_id: str | Sequence[str | None] | None) -> list[str | None]:
        if session_id is None:
            return [prefix_key(r.prompt, r.prompt_token_ids, length=self._prefix_tokens) for r in requests]
        if isinstance(session_id, str):
            return [session_id] * len(requests)
        ids = list(session_id)
        if len(ids) != len(requests) or not all(s is None or isinstance(s, str) for s in ids):
            raise InvalidArgumentError(
                f"session_id={session_id!r}: give one string for every prompt, or a list of {len(requests)} "
                "strings (or None)"
            )
        return [
            s if s is not None else prefix_key(r.prompt, r.prompt_token_ids, length=self._prefix_tokens)
            for s, r in zip(ids, requests, strict=True)
        ]

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: Any = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        image_data: Sequence[Any] | None = None,
        session_id: str | Sequence[str | None] | None = None,
    ) -> list[GenerationResult]:
        """``GenerationEngine.generate`` over the replicas: each prompt goes where the router sends it (its
        ``session_id``, else its prompt prefix, sticks to a replica); results come back in prompt order.

        A replica that dies under a request raises ``ReplicaDiedError`` unless the pool's ``request_retries``
        allows sending the request to another replica.
        """
        self._check_open()
        requests = self._requests(prompts, sampling_params, prompt_token_ids, image_data)
        keys = self._keys(requests, session_id)
        self._check_can_generate()
        results: list[GenerationResult | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        retries = 0
        while todo:
            groups = self._route([(keys[i], requests[i].params.n) for i in todo], todo)
            calls = []
            for index, members in groups.items():
                replica = self._replicas[index]
                batch = [requests[i] for i in members]
                texts = [r.prompt for r in batch] if batch[0].prompt is not None else None
                ids = [list(r.prompt_token_ids or ()) for r in batch] if texts is None else None
                images = [r.image for r in batch] if any(r.image is not None for r in batch) else None
                ref = replica.actor.call.remote(
                    replica.incarnation,
                    "generate",
                    texts,
                    [r.params for r in batch],
                    prompt_token_ids=ids,
                    image_data=images,
                )
                calls.append((replica, ref))
            todo, died = [], False
            errors: list[BaseException] = []
            for replica, outcome in self._collect("generate", calls, self._request_timeout_s):
                members = groups[replica.index]
                self.router.done(replica.index, sum(requests[i].params.n for i in members))
                if isinstance(outcome, StaleReplicaError):
                    todo += members  # it did nothing: send its prompts elsewhere
                elif isinstance(outcome, ReplicaDiedError) and retries < self._retries:
                    _log.warning("%s; sending its %d prompt(s) to another replica", outcome, len(members))
                    todo, died = todo + members, True
                elif isinstance(outcome, BaseException):
                    errors.append(outcome)
                else:
                    for i, result in zip(members, outcome[0], strict=True):
                        results[i] = result
            if errors:
                raise errors[0]
            retries += died
        return [r for r in results if r is not None]

    def _route(self, work: list[tuple[str | None, int]], ids: list[int]) -> dict[int, list[int]]:
        """``ids[j]`` (of key and cost ``work[j]``) grouped by the replica the router picks for each; restores
        the replicas that are back first, and waits for one when none is routed to."""
        self._recover()
        if not self.router.replicas:
            self._recover(wait=True)
        waiting = [r for r in self._active() if r.needs_weights]
        if not self.router.replicas and waiting:
            raise WeightsNotLoadedError(
                f"no replica takes traffic: {', '.join(r.where for r in waiting)} wait(s) for the next "
                "load_weights (restored without a source of the current weights, or a failed sync left a mix)"
            )
        if not self.router.replicas:
            self._check_dead()
        groups: dict[int, list[int]] = {}
        for (key, cost), i in zip(work, ids, strict=True):
            groups.setdefault(self.router.pick(key, cost=cost), []).append(i)
        return groups

    # ---- sleep, wake, weights -------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        self._fanout("sleep", lambda r: r.actor.call.remote(r.incarnation, "sleep", level))

    def wake(self, tags: str | Sequence[str] | None = None) -> None:
        if tags is not None and not isinstance(tags, str):
            tags = list(tags)
        self._fanout("wake", lambda r: r.actor.call.remote(r.incarnation, "wake", tags))

    def flush_cache(self) -> None:
        self._fanout("flush_cache", lambda r: r.actor.call.remote(r.incarnation, "flush_cache"))

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int | None = None,
        check_finite: bool = False,
        version: int | None = None,
    ) -> LoadReport:
        """Every replica loads ``named_tensors`` (labelled ``version``): through the pool's transport if it has
        one, else each tensor is put in Ray's object store once and every replica reads it from there. The
        report is the first replica's, with ``seconds`` the whole call's."""
        self._check_open()
        check_named_tensors(named_tensors)
        check_load_options(bucket_bytes=bucket_bytes, check_finite=check_finite, version=version)
        start = time.perf_counter()
        self._recover()
        with self._lock:
            if self._transport_name is not None:
                self._confirm_members()
            self._check_dead()
            replicas = self._active()
            if not replicas:
                raise EngineStateError(f"load_weights: no replica is up ({self._describe()})")
            if self._transport_name is not None:
                if bucket_bytes is not None:
                    raise InvalidArgumentError(
                        f"bucket_bytes={bucket_bytes!r}: with transport={self._transport_name!r} the buckets are the "
                        "weight-sync group's: pass EnginePool(transport_options={'bucket_bytes': N}) instead"
                    )
                try:
                    report = self._load_transport(replicas, named_tensors, version, check_finite)
                except GenEngineError as exc:
                    # A stream read once (a generator) cannot be sent again: the trainer syncs again itself.
                    if not getattr(exc, "lost_replica", False) or iter(named_tensors) is named_tensors:
                        raise
                    _log.warning("%s; syncing the replicas that are up again", exc)
                    self._confirm_members()
                    self._check_dead()
                    replicas = self._active()
                    if not replicas:
                        raise
                    report = self._load_transport(replicas, named_tensors, version, check_finite)
            else:
                report = self._load(replicas, named_tensors, version, bucket_bytes, check_finite)
            if version is not None:
                self._version = version
            self._loaded_once = True
            for r in replicas:
                if r.needs_weights:
                    r.needs_weights = False
                    self.router.add(r.index)
        return LoadReport(report.num_tensors, report.num_bytes, report.num_buckets, time.perf_counter() - start)

    def _load(
        self,
        replicas: list[_Replica],
        named_tensors: Iterable[tuple[str, Any]],
        version: int | None,
        bucket_bytes: int | None,
        check_finite: bool,
    ) -> Any:
        ray = _ray()
        pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        names: list[str] = []
        refs: list[Any] = []
        for name, tensor in pairs:
            names.append(name)
            refs.append(ray.put(_host_tensor(tensor)))
        report = self._load_refs(replicas, names, refs, version, bucket_bytes, check_finite)
        if self._keep_weights:
            self._kept.update(zip(names, refs, strict=True))
        return report

    def _load_refs(
        self,
        replicas: list[_Replica],
        names: list[str],
        refs: list[Any],
        version: int | None,
        bucket_bytes: int | None,
        check_finite: bool,
    ) -> Any:
        """Every replica loads from the object store. A replica whose load failed after its engine wrote some
        weights refuses to generate from the mix (``state.weights_loaded`` is False): it takes no traffic until a
        whole load reaches it. One error names every replica that failed."""
        self._check_open()
        calls = [
            (r, r.actor.load_weights.remote(r.incarnation, names, refs, version, bucket_bytes, check_finite))
            for r in replicas
        ]
        outcomes = self._collect("load_weights", calls, self._timeout_s)
        done = [(r, o) for r, o in outcomes if not isinstance(o, BaseException)]
        for replica, value in done:
            replica.state, replica.version = value[1], value[2]
        # One that had restarted before the call did nothing: restored later with these weights (as _fanout).
        failed = [(r, o) for r, o in outcomes if isinstance(o, BaseException) and not isinstance(o, StaleReplicaError)]
        if not failed:
            if not done:
                raise EngineStateError(f"load_weights: no replica is up ({self._describe()})")
            return done[0][1][0]
        probes = [(r, r.actor.info.remote()) for r, o in failed if not isinstance(o, ReplicaDiedError)]
        mixed = []
        for replica, info in self._collect("load_weights", probes, self._timeout_s):
            if isinstance(info, Mapping) and info.get("state") is not None:
                replica.state = info["state"]
                if not replica.state.weights_loaded:
                    replica.needs_weights = True
                    mixed.append(replica)
                    with contextlib.suppress(InvalidArgumentError):
                        self.router.remove(replica.index)
        lines = [f"load_weights failed on {len(failed)} of {len(replicas)} replica(s)"]
        lines += [f"{type(o).__name__}: {o}" for _, o in failed]  # each names its replica
        lines.append(
            f"the pool's weight version stays {self._version}"
            + (
                f"; replica(s) {', '.join(str(r.index) for r in mixed)} wrote part of the weights and take no "
                "traffic until a whole load_weights reaches them"
                if mixed
                else ""
            )
        )
        kinds = {type(o) for _, o in failed}
        message = "; ".join(lines)
        error = _renamed(failed[0][1], message) if len(kinds) == 1 else ReplicaError(message)
        raise error from failed[0][1]

    def _confirm_members(self) -> None:
        """Before a transport sync: ping every healthy replica (``timeout_s``; answered at once) so that one
        that restarted unnoticed is restored, or left out, before the group is formed or used. A member that
        is not what the group was formed with would make the sync wait for it until the group's timeout."""
        alive = self._active()
        for r, outcome in self._collect("load_weights", [(r, r.actor.info.remote()) for r in alive], self._timeout_s):
            if isinstance(outcome, BaseException) or outcome["incarnation"] != r.incarnation:
                self._mark_stale(r)
        self._recover()

    def _load_transport(
        self, replicas: list[_Replica], named_tensors: Any, version: int | None, check_finite: bool
    ) -> Any:
        """One sync through the weight-sync group (formed again when its members changed): every receiver is
        started, then the trainer's process sends, then every receiver is waited for. Any failure raises one
        error naming each replica that did not load the sync (and its rank in the group)."""
        from genengine.transport import TransportError, TransportTimeoutError

        self._ensure_group(replicas)
        group = self._group_name
        ranks = {r.index: rank for rank, r in enumerate(replicas, 1)}
        calls = [(r, r.actor.transport_receive.remote(r.incarnation, check_finite)) for r in replicas]
        pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        label = self._version if version is None else version
        sent: BaseException | None = None
        try:
            self._sender.send(pairs, version=label)
        except Exception as exc:
            sent = exc
            if isinstance(exc, TransportTimeoutError) or not isinstance(exc, GenEngineError):
                # The group is out of step: close rank 0's end now, so that the receivers still waiting for it
                # fail at once (their connections drop) instead of at the group's timeout.
                with contextlib.suppress(Exception):
                    self._sender.close()
        # A receiver raises within the group's timeout of the sender's last word; the margin covers Ray.
        outcomes = self._collect("load_weights", calls, self._transport_options["timeout_s"] + self._timeout_s)
        failed = [(r, o) for r, o in outcomes if isinstance(o, BaseException)]
        if sent is None and not failed:
            for replica, value in outcomes:
                replica.state, replica.version = value[1], value[2]
            return outcomes[0][1][0]
        # A timeout, a dead or silent replica, or a failure outside the protocol leave the group out of step.
        broken = isinstance(sent, TransportTimeoutError) or (sent is not None and not isinstance(sent, GenEngineError))
        for r, o in failed:
            cause = o.__cause__ if o.__cause__ is not None else o
            lost = (ReplicaDiedError, ReplicaTimeoutError, StaleReplicaError, TransportTimeoutError)
            broken = broken or isinstance(o, lost) or not isinstance(cause, GenEngineError)
            if int(getattr(cause, "buckets_loaded", 0) or 0) > 0:
                # Some buckets landed: its weights are a mix under the old label. No traffic until a full sync.
                r.needs_weights = True
                with contextlib.suppress(InvalidArgumentError):
                    self.router.remove(r.index)
        for replica, value in outcomes:
            if not isinstance(value, BaseException):
                replica.state, replica.version = value[1], value[2]
        if broken:
            with contextlib.suppress(Exception):
                self._close_group()
        what = f"load_weights of version {label} over transport {self._transport_name!r} (group {group!r})"
        if failed:
            named = ", ".join(f"{r.where} (rank {ranks[r.index]})" for r, _ in failed)
            lines = [f"{what} failed on {len(failed)} of {len(replicas)} replica(s): {named}"]
            lines += [f"rank {ranks[r.index]}: {type(o).__name__}: {o}" for r, o in failed]
        else:
            lines = [f"{what} failed in the trainer's process; every replica answered"]
        if sent is not None:
            lines.append(f"the sender: {type(sent).__name__}: {sent}")
        mixed = [r for r, _ in failed if r.needs_weights]
        lines.append(
            f"the pool's weight version stays {self._version}"
            + (
                f"; replica(s) {', '.join(str(r.index) for r in mixed)} loaded part of the sync and take no traffic "
                "until the next load_weights reaches them"
                if mixed
                else ""
            )
            + ("; the group is closed and formed again at the next sync" if broken else "")
        )
        message = "; ".join(lines)
        kinds = {type(o) for _, o in failed}
        if not failed and sent is not None:
            error = _renamed(sent, message)
        elif len(kinds) == 1:
            error = _renamed(failed[0][1], message)
        else:
            error = TransportError(message)
        # A replica died or restarted under the sync: load_weights syncs the others again once (docs/deployment.md).
        error.lost_replica = any(isinstance(o, (ReplicaDiedError, StaleReplicaError)) for _, o in failed)  # type: ignore[attr-defined]
        raise error from (sent if sent is not None else failed[0][1])

    def _ensure_group(self, replicas: list[_Replica]) -> None:
        ray = _ray()
        from genengine.transport import TransportSpec

        name = self._transport_name
        assert name is not None, "a weight-sync group needs the pool's transport"
        members = tuple((r.index, r.incarnation) for r in replicas)
        if self._sender is not None and members == self._group:
            return
        self._close_group()
        self._group_count += 1
        spec = TransportSpec(
            transport=name,
            address=f"{ray.util.get_node_ip_address()}:{_free_port()}",
            world_size=1 + len(replicas),
            group_name=f"genengine-pool-{self._id}-{self._group_count}",
            device="cpu" if name == "gloo" else "cuda",
            **self._transport_options,
        )
        calls = [(r, r.actor.transport_join.remote(r.incarnation, spec, rank)) for rank, r in enumerate(replicas, 1)]
        sender = self._open_sender(spec, calls)
        self._sender, self._group, self._group_name = sender, members, spec.group_name
        _log.info("weight-sync group %r formed: %s", spec.group_name, ", ".join(r.where for r in replicas))

    def _open_sender(self, spec: Any, calls: list[tuple[_Replica, Any]]) -> Any:
        """Rank 0's end, opened in a thread while the replicas join: a replica whose join fails (it raises at
        once, e.g. a transport its node lacks) is named at once instead of after the group's timeout."""
        ray = _ray()
        from genengine.transport import get_transport

        box: dict[str, Any] = {}

        def open_it() -> None:
            try:
                box["sender"] = get_transport(spec.transport).sender(spec)
            except BaseException as exc:
                box["error"] = exc

        thread = threading.Thread(target=open_it, name=f"{spec.group_name}-sender", daemon=True)
        thread.start()
        waiting = {r.index: (r, ref) for r, ref in calls}  # _Replica is not hashable
        while thread.is_alive() and waiting:
            thread.join(0.05)
            done, _ = ray.wait([ref for _, ref in waiting.values()], num_returns=len(waiting), timeout=0)
            early = [(r, ref) for r, ref in waiting.values() if ref in done]
            for r, outcome in self._collect("transport_join", early, 0):
                del waiting[r.index]
                if isinstance(outcome, BaseException) and thread.is_alive():
                    # The sender gives up at its timeout; the replicas that joined are told so and raise
                    # then. Nothing to close now: the next sync forms a new group.
                    raise outcome
        thread.join()
        if "error" in box:
            exc = box["error"]
            joined = self._collect("transport_join", calls, spec.timeout_s + self._timeout_s)
            notes = [f"rank {rank}: {o}" for rank, (_, o) in enumerate(joined, 1) if isinstance(o, BaseException)]
            raise _renamed(exc, "; ".join([str(exc), *notes])) from exc
        sender = box["sender"]
        try:
            self._gather("transport_join", calls, spec.timeout_s + self._timeout_s)
        except BaseException:
            sender.close()
            raise
        return sender

    def _close_group(self) -> None:
        sender, self._sender, self._group = self._sender, None, ()
        if sender is not None:
            sender.close()
            live = self._active()
            self._collect("transport_close", [(r, r.actor.transport_close.remote()) for r in live], self._timeout_s)

    @property
    def transport_group(self) -> str | None:
        """The name of the current weight-sync group (None before the first transport sync, or when the pool
        has no transport); it changes whenever the group is formed again."""
        return self._group_name if self._sender is not None else None

    def set_weights_source(self, source: Callable[[], Iterable[tuple[str, Any]]] | None) -> None:
        """Where a restarted replica's weights come from: ``source()`` gives the (name, tensor) pairs of the
        version last synced (e.g. ``lambda: policy.state_dict().items()`` in a loop that syncs every step)."""
        if source is not None and not callable(source):
            raise InvalidArgumentError(f"source={source!r} must be a callable returning (name, tensor) pairs or None")
        self._weights_source = source

    # ---- async ----------------------------------------------------------------------------------------------------
    def stream(
        self,
        prompt: str | None = None,
        sampling_params: Any = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        image_data: Any = None,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> PoolStream:
        """``AsyncEngineBase.stream`` through the pool: one prompt, on the replica the router picks."""
        self._check_open()
        request, request_id = normalize_async_request(
            prompt,
            sampling_params,
            prompt_token_ids,
            image_data,
            request_id,
            vocab_size=self._common.get("vocab_size"),
            supports_images=bool(self._common.get("supports_images")),
        )
        if session_id is not None and not isinstance(session_id, str):
            raise InvalidArgumentError(f"session_id={session_id!r} must be a string or None")
        known = self._streams.get(request_id)
        if known is not None and not known._done:
            raise InvalidArgumentError(f"request_id={request_id!r} is already in flight")
        self._check_can_generate()
        (key,) = self._keys([request], session_id)
        handle = PoolStream(self, request, request_id, key)
        for rid in [rid for rid, s in self._streams.items() if s._done]:
            del self._streams[rid]
        self._streams[request_id] = handle
        handle._submit()
        return handle

    async def generate_async(
        self,
        prompt: str | None = None,
        sampling_params: Any = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        image_data: Any = None,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> GenerationResult:
        """One prompt's completions; a replica dying under it raises ``ReplicaDiedError`` unless the pool's
        ``request_retries`` allows submitting it again (from scratch) to another replica."""
        for attempt in range(self._retries + 1):
            stream = self.stream(
                prompt,
                sampling_params,
                prompt_token_ids=prompt_token_ids,
                image_data=image_data,
                request_id=request_id,
                session_id=session_id,
            )
            try:
                return await stream.collect()
            except ReplicaDiedError as exc:
                if attempt == self._retries:
                    raise
                _log.warning("%s; retrying request %s elsewhere", exc, stream.request_id)
        raise AssertionError("unreachable")

    async def abort(self, request_ids: str | Sequence[str] | None = None) -> list[str]:
        """Abort requests (every one in flight when None) on the replicas serving them; returns the ids aborted."""
        self._check_open()
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        elif request_ids is not None and not isinstance(request_ids, Sequence):
            raise InvalidArgumentError(f"request_ids={request_ids!r}: allowed are None, an id, or a list of ids")
        targets: dict[int, list[str] | None] = {}
        if request_ids is None:
            targets = {r.index: None for r in self._active()}
        else:
            for rid in request_ids:
                handle = self._streams.get(str(rid))
                if handle is not None and not handle._done and handle._replica is not None:
                    ids = targets.setdefault(handle._replica.index, [])
                    assert ids is not None
                    ids.append(handle.request_id)
        replicas = [self._replicas[i] for i in targets if i in self._replicas]
        if not replicas:
            return []
        results = await asyncio.to_thread(
            self._fanout, "abort", lambda r: r.actor.abort.remote(r.incarnation, targets[r.index]), replicas
        )
        return [rid for _, ids in results for rid in ids]

    async def pause_generation(self, mode: PauseMode = "keep", *, clear_cache: bool = True) -> None:
        """``AsyncEngineBase.pause_generation`` on every replica (a replica restarted meanwhile is paused too)."""
        await asyncio.to_thread(
            self._fanout,
            "pause_generation",
            lambda r: r.actor.pause_generation.remote(r.incarnation, mode, clear_cache),
        )
        self._paused = (mode, clear_cache)

    async def resume_generation(self) -> None:
        await asyncio.to_thread(
            self._fanout, "resume_generation", lambda r: r.actor.resume_generation.remote(r.incarnation)
        )
        self._paused = None

    # ---- end ----------------------------------------------------------------------------------------------------
    def _teardown(self, replicas: list[_Replica]) -> None:
        ray = _ray()
        self._collect(
            "shutdown", [(r, r.actor.shutdown.remote()) for r in replicas if r.status != "dead"], self._timeout_s
        )
        for r in replicas:
            with contextlib.suppress(Exception):
                ray.kill(r.actor, no_restart=True)
            if r.owned_pg is not None:
                with contextlib.suppress(Exception):
                    ray.util.remove_placement_group(r.owned_pg)
            with contextlib.suppress(InvalidArgumentError):
                self.router.remove(r.index)

    def shutdown(self) -> None:
        """Shut every engine down (``timeout_s``), kill the actors and free the placement groups the pool made.
        Idempotent."""
        if self._closed:
            return
        try:
            with contextlib.suppress(Exception):
                self._close_group()
            self._teardown(list(self._replicas.values()))
        finally:
            self._closed = True
            self._kept.clear()

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"EnginePool({self._config.backend!r}, {self._placement}, replicas {{{self._describe()}}})"


class PoolStream:
    """One request submitted through an ``EnginePool``: the same calls as ``genengine.aio.RequestStream``."""

    def __init__(self, pool: EnginePool, request: Request, request_id: str, key: str | None) -> None:
        self._pool = pool
        self._request = request
        self._request_id = request_id
        self._key = key
        self._replica: _Replica | None = None
        self._gen: Any = None
        self._yielded = False
        self._done = False
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None

    @property
    def request_id(self) -> str:
        return self._request_id

    def _submit(self) -> None:
        pool, request = self._pool, self._request
        ((index, _),) = pool._route([(self._key, request.params.n)], [0]).items()
        replica = pool._replicas[index]
        self._replica = replica
        self._gen = replica.actor.stream.options(num_returns="streaming").remote(
            replica.incarnation,
            request.prompt,
            request.params,
            list(request.prompt_token_ids) if request.prompt_token_ids is not None else None,
            request.image,
            self._request_id,
        )

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            if self._replica is not None:
                self._pool.router.done(self._replica.index, self._request.params.n)

    def __aiter__(self) -> PoolStream:
        return self

    async def __anext__(self) -> StreamChunk:
        while True:
            if self._done:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            assert self._replica is not None
            replica = self._replica
            try:
                ref = await asyncio.wait_for(self._gen.__anext__(), self._pool._request_timeout_s)
                item = await ref
            except StopAsyncIteration:
                self._fail(ReplicaError(f"{replica.where}: the stream of {self._request_id!r} ended without a result"))
                continue
            except asyncio.TimeoutError:
                self._fail(
                    ReplicaTimeoutError(
                        f"{replica.where}: stream {self._request_id!r} got nothing for "
                        f"{self._pool._request_timeout_s:g} s"
                    )
                )
                continue
            except Exception as exc:
                error = self._pool._translate(replica, exc, f"stream {self._request_id!r}")
                if isinstance(error, StaleReplicaError) and not self._yielded:
                    self._pool.router.done(replica.index, self._request.params.n)
                    await asyncio.to_thread(self._submit)  # it never ran: send it elsewhere
                    continue
                self._fail(error)
                continue
            if isinstance(item, GenerationResult):
                self._result = item
                self._finish()
                continue
            self._yielded = True
            return item  # type: ignore[no-any-return]

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._finish()

    async def collect(self) -> GenerationResult:
        """Read the chunks not read yet and return the result; a caller cancelled meanwhile aborts the request."""
        try:
            async for _ in self:
                pass
        except asyncio.CancelledError:
            if not self._done:
                with contextlib.suppress(Exception):
                    await self._pool.abort(self._request_id)
            raise
        return self.result()

    def result(self) -> GenerationResult:
        """Every completion with its tokens, logprobs and weight versions; only once the stream has ended."""
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise EngineStateError(f"request {self._request_id!r} is still running: read its stream to the end first")
        return self._result

    async def aclose(self) -> None:
        """Stop reading: a request still running is aborted, and its stream read to its (aborted) end."""
        if not self._done:
            await self._pool.abort(self._request_id)
            with contextlib.suppress(Exception):
                async for _ in self:
                    pass
