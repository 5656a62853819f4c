"""``EnginePool``: N engine replicas as Ray actors behind the ``GenerationEngine`` protocol (and the async one).

The pool lives in the trainer's process (the driver, or a trainer actor for colocated setups); each replica is
an :class:`~genengine.ray.replica.EngineReplica` actor that builds its engine with ``create_engine``, so any
registered backend works. ``generate`` spreads prompts over the replicas with a
:class:`~genengine.ray.router.Router`; control calls go to every replica and wait at most ``timeout_s``; a
failure names the replica (index, actor id, node) and the call. A replica that Ray restarted gets the current
weights, version and sleep/pause state before it is routed to again (docs/deployment.md, "Health").

This class is a facade over one-way parts: :mod:`~genengine.ray.options` (every argument checked before any
actor exists), :mod:`~genengine.ray.fleet` (what the pool knows of its replicas, changed only through its
verbs), :mod:`~genengine.ray.lifecycle` (placement, start, health, restore), :mod:`~genengine.ray.dispatch`
(routing), :mod:`~genengine.ray.fanout` (the one fan-out, side-effect free), :mod:`~genengine.ray.handle` (the
typed calls on a replica), :mod:`~genengine.ray.sync` (weight syncs), :mod:`~genengine.ray.stream`
(``PoolStream``) and :mod:`~genengine.ray.asynchronous` (the async calls, inherited). Importing this module
imports neither Ray nor torch.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from genengine.config import option_number
from genengine.errors import ConfigError, InvalidArgumentError
from genengine.protocol import EngineState, GenerationResult, LoadReport
from genengine.ray.asynchronous import AsyncPoolCalls
from genengine.ray.dispatch import Dispatch
from genengine.ray.errors import ReplicaTimeoutError
from genengine.ray.fleet import Fleet
from genengine.ray.handle import Replica, ReplicaInfo
from genengine.ray.lifecycle import Lifecycle
from genengine.ray.options import PLACEMENTS, Placement, PoolOptions, check_bundles
from genengine.ray.router import Router
from genengine.ray.stream import PoolStream, StreamRegistry
from genengine.ray.sync import WeightSync
from genengine.requests import normalize_requests

if TYPE_CHECKING:
    from types import TracebackType

    import torch

__all__ = ["PLACEMENTS", "EnginePool", "PoolStream", "ReplicaInfo"]

_log = logging.getLogger(__name__)


class EnginePool(AsyncPoolCalls):
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
        arguments = {k: v for k, v in locals().items() if k not in ("self", "config", "engine_kwargs", "max_imbalance")}
        self._options = PoolOptions.check(config, engine_kwargs, **arguments)
        self.router = Router(max_imbalance=max_imbalance)
        self._id = uuid.uuid4().hex[:8]
        self._fleet = Fleet(self._options, self.router, self._id)
        self._life = Lifecycle(self._fleet, refill=lambda replica: self._sync.refill(replica))
        self._dispatch = Dispatch(self._fleet, self._life)
        self._sync = WeightSync(self._fleet, self._life)
        self._streams = StreamRegistry()
        self._life.start()

    # ---- replicas ---------------------------------------------------------------------------------------------
    def check_health(self, *, wait: bool = True) -> list[ReplicaInfo]:
        """Ping every replica (``timeout_s``); a restarted one is restored before this returns (``wait``), one
        that Ray will not restart is reported ``dead``."""
        self._fleet.check_open()
        with self._fleet.lock:
            self._life.ping("check_health")
            self._life.recover(wait=wait)
            return self.replicas

    def add_replica(self, *, bundle_index: int | None = None) -> int:
        """Start one more replica (``bundle_index`` of the trainer's placement group when colocated), give it
        the current weights and state, and route to it; returns its index."""
        fleet, opts = self._fleet, self._options
        fleet.check_open()
        if opts.placement == "colocated":
            wanted = [bundle_index] if bundle_index is not None else None
            (bundle_index,) = check_bundles("colocated", 1, opts.placement_group, wanted, opts.num_gpus, opts.num_cpus)
        elif bundle_index is not None:
            raise ConfigError("bundle_index is for placement='colocated'")
        with fleet.lock:
            replica = self._life.add(bundle_index)
            self._sync.forget_group()  # the weight-sync group is formed again with the new member
            return replica.index

    def remove_replica(self, index: int, *, drain_timeout_s: float | None = None) -> None:
        """Stop routing to replica ``index``, wait until its requests finished (``drain_timeout_s``, default
        ``timeout_s``), then shut it down."""
        fleet = self._fleet
        fleet.check_open()
        replica = fleet.replicas.get(index) if isinstance(index, int) else None
        if replica is None:
            raise InvalidArgumentError(f"replica index={index!r} is not in the pool; it has {sorted(fleet.replicas)}")
        timeout = fleet.timeout_s if drain_timeout_s is None else option_number("drain_timeout_s", drain_timeout_s)
        fleet.unroute(replica)
        deadline = time.monotonic() + timeout
        while self._streams.by_replica().get(index):
            if time.monotonic() > deadline:
                raise ReplicaTimeoutError(f"{replica.where} still has requests after {timeout:g} s of draining")
            time.sleep(0.05)
        with fleet.lock:
            fleet.drop(replica)
            self._sync.forget_group()
        self._life.teardown([replica])

    def restart_replica(self, index: int) -> None:
        """Kill replica ``index``'s actor and let Ray restart it (a hung engine); it is restored at the next call."""
        fleet = self._fleet
        fleet.check_open()
        replica = fleet.replicas.get(index) if isinstance(index, int) else None
        if replica is None:
            raise InvalidArgumentError(f"replica index={index!r} is not in the pool; it has {sorted(fleet.replicas)}")
        fleet.mark_killed(replica)
        replica.kill(restart=True)

    @property
    def replicas(self) -> list[ReplicaInfo]:
        """Every replica, by index."""
        return self._fleet.infos()

    # ---- state ----------------------------------------------------------------------------------------------
    @property
    def supported_tags(self) -> tuple[str, ...]:
        return self._fleet.supported_tags

    @property
    def state(self) -> EngineState:
        """The states of the replicas that take traffic, combined (of every replica up when none does): a tag
        released on any is released, weights are loaded only where each has them. A replica kept out of traffic
        until the next load (it holds a mix after a failed one) does not stop the others serving."""
        return self._fleet.state()

    @property
    def is_sleeping(self) -> bool:
        return self.state.is_sleeping

    @property
    def weight_version(self) -> int:
        """The version of the last ``load_weights`` that reached every replica (0 at start)."""
        return self._fleet.version

    @property
    def timeout_s(self) -> float:
        """How long a control call waits for every replica before it raises ``ReplicaTimeoutError``."""
        return self._fleet.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._fleet.set_timeout(option_number("timeout_s", value))

    # ---- generate ----------------------------------------------------------------------------------------------
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
        allows sending the request to another replica. Images pass to the replicas, whose engines take them
        or refuse them.
        """
        self._fleet.check_open()
        requests = normalize_requests(
            prompts,
            sampling_params,
            prompt_token_ids=prompt_token_ids,
            image_data=image_data,
            vocab_size=self._options.vocab_size,
            supports_images=True,
        )
        keys = self._dispatch.keys(requests, session_id)
        self._fleet.check_can_generate()
        return self._dispatch.generate(requests, keys)

    # ---- sleep, wake, weights -------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        self._life.each("sleep", lambda r: r.sleep(level))

    def wake(self, tags: str | Sequence[str] | None = None) -> None:
        if tags is not None and not isinstance(tags, str):
            tags = list(tags)
        self._life.each("wake", lambda r: r.wake(tags))

    def flush_cache(self) -> None:
        self._life.each("flush_cache", Replica.flush_cache)

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
        return self._sync.load(named_tensors, bucket_bytes=bucket_bytes, check_finite=check_finite, version=version)

    @property
    def transport_group(self) -> str | None:
        """The name of the current weight-sync group (None before the first transport sync, or when the pool
        has no transport); it changes whenever the group is formed again."""
        return self._sync.group

    def set_weights_source(self, source: Callable[[], Iterable[tuple[str, Any]]] | None) -> None:
        """Where a restarted replica's weights come from: ``source()`` gives the (name, tensor) pairs of the
        version last synced (e.g. ``lambda: policy.state_dict().items()`` in a loop that syncs every step)."""
        if source is not None and not callable(source):
            raise InvalidArgumentError(f"source={source!r} must be a callable returning (name, tensor) pairs or None")
        self._sync.source = source

    # ---- end ----------------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Shut every engine down (``timeout_s``), kill the actors and free the placement groups the pool made.
        Idempotent."""
        fleet = self._fleet
        if fleet.closed:
            return
        try:
            try:
                self._sync.close_group()
            except Exception:
                _log.debug("closing the weight-sync group failed", exc_info=True)
            self._life.teardown(list(fleet.replicas.values()))
        finally:
            fleet.close()
            self._sync.kept.clear()

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
        opts = self._options
        return f"EnginePool({opts.config.backend!r}, {opts.placement}, replicas {{{self._fleet.describe()}}})"
