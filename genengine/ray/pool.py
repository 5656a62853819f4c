"""``EnginePool``: N engine replicas as Ray actors behind the ``GenerationEngine`` protocol (and the async one).

The pool lives in the trainer's process (the driver, or a trainer actor for colocated setups); each replica is
an :class:`~genengine.ray.replica.EngineReplica` actor that builds its engine with ``create_engine``, so any
registered backend works. ``generate`` spreads prompts over the replicas with a
:class:`~genengine.ray.router.Router`; control calls go to every replica and wait at most ``timeout_s``; a
failure names the replica (index, actor id, node) and the call. A replica that Ray restarted gets the current
weights, version and sleep/pause state before it is routed to again (docs/deployment.md, "Health").

This class is a facade over one-way parts: :mod:`~genengine.ray.options` (every argument checked before any
actor exists), :mod:`~genengine.ray.fleet` (the replicas, their health and the one fan-out call),
:mod:`~genengine.ray.sync` (weight syncs) and :mod:`~genengine.ray.stream` (``PoolStream``). Importing this
module imports neither Ray nor torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from genengine.config import option_number
from genengine.engine.aio import PauseMode, normalize_async_request
from genengine.errors import ConfigError, InvalidArgumentError
from genengine.protocol import EngineState, GenerationResult, LoadReport
from genengine.ray.errors import ReplicaDiedError, ReplicaTimeoutError
from genengine.ray.fleet import Fleet, ReplicaInfo
from genengine.ray.options import PLACEMENTS, Placement, PoolOptions, check_bundles, ray_module
from genengine.ray.router import Router
from genengine.ray.stream import PoolStream, StreamRegistry
from genengine.ray.sync import WeightSync
from genengine.requests import normalize_requests

if TYPE_CHECKING:
    from types import TracebackType

    import torch

__all__ = ["PLACEMENTS", "EnginePool", "PoolStream", "ReplicaInfo"]

_log = logging.getLogger(__name__)


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
        arguments = {k: v for k, v in locals().items() if k not in ("self", "config", "engine_kwargs", "max_imbalance")}
        self._options = PoolOptions.check(config, engine_kwargs, **arguments)
        self.router = Router(max_imbalance=max_imbalance)
        self._id = uuid.uuid4().hex[:8]
        self._fleet = Fleet(self._options, self.router, self._id)
        self._sync = WeightSync(self._fleet)
        self._streams = StreamRegistry()
        self._fleet.start()

    # ---- replicas ---------------------------------------------------------------------------------------------
    def check_health(self, *, wait: bool = True) -> list[ReplicaInfo]:
        """Ping every replica (``timeout_s``); a restarted one is restored before this returns (``wait``), one
        that Ray will not restart is reported ``dead``."""
        self._fleet.check_open()
        with self._fleet.lock:
            self._fleet.ping("check_health")
            self._fleet.recover(wait=wait)
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
            replica = fleet.new_replica(bundle_index)
            try:
                fleet.restore(replica, fleet.first_info(replica))
            except BaseException:
                fleet.teardown([replica])
                del fleet.replicas[replica.index]
                raise
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
            del fleet.replicas[index]
            self._sync.forget_group()
        fleet.teardown([replica])

    def restart_replica(self, index: int) -> None:
        """Kill replica ``index``'s actor and let Ray restart it (a hung engine); it is restored at the next call."""
        fleet = self._fleet
        fleet.check_open()
        replica = fleet.replicas.get(index) if isinstance(index, int) else None
        if replica is None:
            raise InvalidArgumentError(f"replica index={index!r} is not in the pool; it has {sorted(fleet.replicas)}")
        fleet.mark_stale(replica)
        ray_module().kill(replica.actor, no_restart=False)

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
        self._fleet.timeout_s = option_number("timeout_s", value)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished, on every replica up (each answers at once, within ``timeout_s``):
        running, held by a ``keep`` pause, or queued during a pause."""
        fleet = self._fleet
        if fleet.closed:
            return 0
        mine = self._streams.by_replica()
        outcomes = fleet.call(
            "in_flight", lambda r: r.actor.in_flight.remote(mine.get(r.index, [])), fleet.active(), errors="return"
        )
        return sum(int(o.value) for o in outcomes if o.error is None)

    @property
    def paused(self) -> PauseMode | None:
        paused = self._fleet.paused
        return paused[0] if paused is not None else None

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
        keys = self._fleet.keys(requests, session_id)
        self._fleet.check_can_generate()
        return self._fleet.generate(requests, keys)

    # ---- sleep, wake, weights -------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        self._fleet.call("sleep", lambda r: r.actor.call.remote(r.incarnation, "sleep", level))

    def wake(self, tags: str | Sequence[str] | None = None) -> None:
        if tags is not None and not isinstance(tags, str):
            tags = list(tags)
        self._fleet.call("wake", lambda r: r.actor.call.remote(r.incarnation, "wake", tags))

    def flush_cache(self) -> None:
        self._fleet.call("flush_cache", lambda r: r.actor.call.remote(r.incarnation, "flush_cache"))

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
        self._fleet.check_open()
        request, request_id = normalize_async_request(
            prompt,
            sampling_params,
            prompt_token_ids,
            image_data,
            request_id,
            vocab_size=self._options.vocab_size,
            supports_images=True,
        )
        if session_id is not None and not isinstance(session_id, str):
            raise InvalidArgumentError(f"session_id={session_id!r} must be a string or None")
        self._streams.check_new(request_id)
        self._fleet.check_can_generate()
        (key,) = self._fleet.keys([request], session_id)
        handle = PoolStream(self._fleet, request, request_id, key, self.abort)
        self._streams.add(handle)
        handle.submit()
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
        retries = self._options.request_retries
        for attempt in range(retries + 1):
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
                if attempt == retries:
                    raise
                _log.warning("%s; retrying request %s elsewhere", exc, stream.request_id)
        raise AssertionError("unreachable")

    async def abort(self, request_ids: str | Sequence[str] | None = None) -> list[str]:
        """Abort requests (every one in flight when None) on the replicas serving them; returns the ids aborted."""
        fleet = self._fleet
        fleet.check_open()
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        elif request_ids is not None and not isinstance(request_ids, Sequence):
            raise InvalidArgumentError(f"request_ids={request_ids!r}: allowed are None, an id, or a list of ids")
        targets: Mapping[int, list[str] | None]
        if request_ids is None:
            targets = {r.index: None for r in fleet.active()}
        else:
            targets = self._streams.by_replica([str(rid) for rid in request_ids])
        replicas = [fleet.replicas[i] for i in targets if i in fleet.replicas]
        if not replicas:
            return []
        outcomes = await asyncio.to_thread(
            fleet.call, "abort", lambda r: r.actor.abort.remote(r.incarnation, targets[r.index]), replicas
        )
        return [rid for o in outcomes for rid in o.value]

    async def pause_generation(self, mode: PauseMode = "keep", *, clear_cache: bool = True) -> None:
        """``AsyncEngineBase.pause_generation`` on every replica (a replica restarted meanwhile is paused too).
        Cancelled (``wait_for`` giving up on a ``"wait"`` drain), it cancels the replicas' pauses: none is left
        paused."""
        refs: list[Any] = []
        before, self._fleet.paused = self._fleet.paused, (mode, clear_cache)  # at once, as an engine sets it

        def submit(r: Any) -> Any:
            refs.append(r.actor.pause_generation.remote(r.incarnation, mode, clear_cache))
            return refs[-1]

        try:
            await asyncio.to_thread(self._fleet.call, "pause_generation", submit)
        except BaseException as exc:
            self._fleet.paused = before
            if isinstance(exc, asyncio.CancelledError):
                ray = ray_module()
                for ref in refs:
                    ray.cancel(ref)
            raise

    async def resume_generation(self) -> None:
        await asyncio.to_thread(
            self._fleet.call, "resume_generation", lambda r: r.actor.resume_generation.remote(r.incarnation)
        )
        self._fleet.paused = None

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
            fleet.teardown(list(fleet.replicas.values()))
        finally:
            fleet.closed = True
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
