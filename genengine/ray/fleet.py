"""``Fleet``: the replicas of one ``EnginePool`` — placement, start, health and restore, the one fan-out call,
routing, teardown.

Every call to replicas goes through :meth:`Fleet.call`: it waits for one call per replica (at most a timeout
in all) and gives one typed :class:`Outcome` each, the error translated to name the replica. A replica that
Ray restarted is marked stale, takes no traffic, and is restored (weights through the ``refill`` hook the
weight sync sets, then version, sleep and pause state) before it is routed to again.

Importing this module imports neither Ray nor torch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from genengine.config import EngineConfig
from genengine.engine.aio import PauseMode
from genengine.errors import (
    EngineClosedError,
    EngineSleepingError,
    EngineStateError,
    GenEngineError,
    InvalidArgumentError,
    WeightsNotLoadedError,
)
from genengine.protocol import TAG_WEIGHTS, EngineState, GenerationResult
from genengine.ray.errors import ReplicaDiedError, ReplicaError, ReplicaTimeoutError, StaleReplicaError
from genengine.ray.options import PoolOptions, ray_module
from genengine.ray.replica import Reply
from genengine.ray.router import Router, prefix_key
from genengine.requests import Request

__all__ = ["Fleet", "Outcome", "Replica", "ReplicaInfo", "Status"]

_log = logging.getLogger("genengine.ray.pool")  # one logger for the pool and its parts

Status = Literal["healthy", "stale", "dead"]


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


@dataclass(eq=False)
class Replica:
    """One replica actor and what the pool knows of it (identity: the object)."""

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


@dataclass(frozen=True)
class Outcome:
    """How one replica's call ended: its value, or its error (already naming the replica)."""

    replica: Replica
    value: Any = None
    error: BaseException | None = None

    @property
    def stale(self) -> bool:
        """It refused as restarted: the call did nothing there."""
        return isinstance(self.error, StaleReplicaError)

    @property
    def died(self) -> bool:
        return isinstance(self.error, ReplicaDiedError)


def raise_first(what: str, outcomes: Sequence[Outcome]) -> None:
    """Raise the first failure of ``outcomes`` (every one is logged when several failed)."""
    errors = [o.error for o in outcomes if o.error is not None]
    if errors:
        if len(errors) > 1:
            _log.error("%s failed on %d replicas: %s", what, len(errors), "; ".join(map(str, errors)))
        raise errors[0]


Submit = Callable[[Replica], Any]
"""A call on one replica's actor (``lambda r: r.actor.<method>.remote(r.incarnation, ...)``): its object ref."""


class Fleet:
    """The replicas of one pool, their routing and their health (the pool's weight sync plugs in ``refill``)."""

    def __init__(self, options: PoolOptions, router: Router, pool_id: str) -> None:
        self.options = options
        self.router = router
        self.pool_id = pool_id
        self.timeout_s = options.timeout_s
        self.lock = threading.RLock()
        self.replicas: dict[int, Replica] = {}
        self.closed = False
        self.version = 0
        self.paused: tuple[PauseMode, bool] | None = None
        self.loaded_once = False
        self.supported_tags: tuple[str, ...] = ()
        self.refill: Callable[[Replica], bool] = lambda replica: False
        """Load the current weights into a restored replica; False when the pool has no source for them."""
        self._next_index = 0

    # ---- start, restore, health -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the replicas the options ask for, all at once; on any failure none is left."""
        ray = ray_module()
        if not ray.is_initialized():
            ray.init()
        try:
            self._start([self.new_replica(b) for b in self.options.bundles])
        except BaseException:
            self.teardown(list(self.replicas.values()))
            self.replicas.clear()
            raise
        self.supported_tags = tuple(next(iter(self.replicas.values())).info["supported_tags"])

    def new_replica(self, bundle_index: int | None) -> Replica:
        """Create (not start) one replica actor, in its own placement group or the trainer's bundle."""
        ray = ray_module()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from genengine.ray.replica import EngineReplica

        opts = self.options
        index, self._next_index = self._next_index, self._next_index + 1
        owned = None
        if bundle_index is None:
            bundle = {"CPU": opts.num_cpus} if opts.num_cpus else {}
            if opts.num_gpus:
                bundle["GPU"] = opts.num_gpus
            owned = placement_group([bundle], strategy="STRICT_PACK", name=f"genengine-pool-{self.pool_id}-{index}")
            ready, _ = ray.wait([owned.ready()], timeout=opts.start_timeout_s)
            if not ready:
                ray.util.remove_placement_group(owned)
                raise ReplicaTimeoutError(
                    f"replica {index}: the cluster could not place a bundle {bundle} within {opts.start_timeout_s:g} "
                    f"s (available: {ray.available_resources()})"
                )
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=owned if owned is not None else opts.placement_group,
            placement_group_bundle_index=0 if bundle_index is None else bundle_index,
        )
        actor_options: dict[str, Any] = {
            "num_cpus": opts.num_cpus,
            "num_gpus": opts.num_gpus,
            "max_restarts": opts.max_restarts,
            "max_task_retries": 0,
            "scheduling_strategy": strategy,
            "name": self.actor_name(index),
        }
        if opts.runtime_env is not None:
            actor_options["runtime_env"] = dict(opts.runtime_env)
        actor = ray.remote(EngineReplica).options(**actor_options).remote(index)
        config = opts.config.replace(seed=opts.config.seed + index)
        replica = Replica(index, actor, config, bundle_index, owned)
        self.replicas[index] = replica
        return replica

    def actor_name(self, index: int) -> str:
        return f"genengine-pool-{self.pool_id}-replica-{index}"

    def _start(self, replicas: list[Replica]) -> None:
        """Start the engines of new replicas, all at once, within ``start_timeout_s``."""

        def start(submit: Submit) -> list[Outcome]:
            return self.call("start", submit, replicas, timeout=self.options.start_timeout_s, skip_stale=False)

        for o in start(lambda r: r.actor.info.remote()):
            o.replica.info, o.replica.incarnation = o.value, o.value["incarnation"]
        start(lambda r: r.actor.start.remote(r.incarnation, r.config))
        for o in start(lambda r: r.actor.info.remote()):
            r = o.replica
            r.info, r.state, r.version = o.value, o.value["state"], o.value["weight_version"]
            r.status, r.needs_weights = "healthy", False
            self.router.add(r.index)

    def first_info(self, replica: Replica) -> dict[str, Any]:
        """A new replica's ``info``, within ``timeout_s``."""
        (outcome,) = self.call("start", lambda r: r.actor.info.remote(), [replica], skip_stale=False)
        info: dict[str, Any] = outcome.value
        return info

    def restore(self, replica: Replica, info: dict[str, Any]) -> None:
        """Bring a restarted (or new) replica to the pool's weights, version, sleep and pause state."""
        with self.lock:
            replica.info, replica.incarnation, replica.pending = info, info["incarnation"], None
            if not info["started"]:
                self.call("start", lambda r: r.actor.start.remote(r.incarnation, r.config), [replica], skip_stale=False)
            state = self.state() if self.active() else EngineState()
            level = state.sleep_level
            loaded = False
            if level != 2 and state.weights_loaded:  # level 1 keeps what was loaded: load before sleeping
                loaded = self.refill(replica)
            if level is not None:
                self.call("sleep", lambda r: r.actor.call.remote(r.incarnation, "sleep", level), [replica])
                awake = [t for t in self.supported_tags if t not in state.released_tags]
                if awake:
                    self.call("wake", lambda r: r.actor.call.remote(r.incarnation, "wake", awake), [replica])
                if level == 2 and state.weights_loaded and TAG_WEIGHTS in awake:
                    loaded = self.refill(replica)
            if self.paused is not None:
                mode, clear = self.paused
                self.call(
                    "pause_generation",
                    lambda r: r.actor.pause_generation.remote(r.incarnation, mode, clear),
                    [replica],
                )
            # Without a source its engine holds the disk checkpoint: no traffic until the next load_weights
            # (unless it refuses to generate anyway, as after a level-2 sleep).
            replica.needs_weights = self.loaded_once and not loaded and replica.state.weights_loaded
            replica.status = "healthy"
            if not replica.needs_weights:
                self.router.add(replica.index)
            _log.warning(
                "%s restored: weight version %d%s",
                replica.where,
                replica.version,
                ", waiting for the next load_weights" if replica.needs_weights else "",
            )

    def mark_stale(self, replica: Replica) -> None:
        with self.lock:
            if replica.status == "healthy":
                replica.status = "stale"
                self.unroute(replica)
                _log.warning("%s died or restarted: it takes no traffic until it is restored", replica.where)

    def unroute(self, replica: Replica) -> None:
        with contextlib.suppress(InvalidArgumentError):
            self.router.remove(replica.index)

    def recover(self, wait: bool = False) -> None:
        """Restore every stale replica whose actor is back; with ``wait``, wait for them (``start_timeout_s``)."""
        ray = ray_module()
        deadline = time.monotonic() + (self.options.start_timeout_s if wait else 0)
        with self.lock:
            while True:
                stale = [r for r in self.replicas.values() if r.status == "stale"]
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
                        # the replicas that are up; control calls raise for it (check_dead) until it is removed.
                        r.status, r.pending = "dead", None
                        _log.error(
                            "%s is dead and Ray will not restart it (max_restarts=%d): it takes no traffic; "
                            "remove_replica(%d) it",
                            r.where,
                            self.options.max_restarts,
                            r.index,
                        )
                        continue
                    except ray.exceptions.RayActorError:
                        r.pending = None  # restarting: ask again
                        continue
                    self.restore(r, info)
                if not wait:
                    return
                waiting = [r for r in self.replicas.values() if r.status == "stale"]
                if waiting and time.monotonic() >= deadline:
                    raise ReplicaTimeoutError(
                        f"{waiting[0].where} did not come back within {self.options.start_timeout_s:g} s"
                    )
                if waiting:
                    time.sleep(0.05)

    def ping(self, what: str) -> None:
        """Ask every healthy replica who it is (``timeout_s``; answered at once): one that does not answer, or
        answers as another incarnation, is marked stale; then the ones back are restored."""
        alive = self.active()
        for o in self.call(what, lambda r: r.actor.info.remote(), alive, errors="return"):
            if o.error is not None or o.value["incarnation"] != o.replica.incarnation:
                self.mark_stale(o.replica)

    def check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("the EnginePool was shut down; create a new one")

    def check_dead(self) -> None:
        dead = [r for r in self.replicas.values() if r.status == "dead"]
        if dead:
            raise ReplicaDiedError(
                f"{dead[0].where} is dead and Ray will not restart it (max_restarts={self.options.max_restarts}): "
                f"remove_replica({dead[0].index}) it"
            )

    def ready(self, what: str) -> list[Replica]:
        """The replicas a control call goes to: the ones back restored first; raises when one is dead for good
        (until it is removed) or none is up."""
        self.recover()
        self.check_dead()
        replicas = self.active()
        if not replicas:
            raise EngineStateError(f"{what}: no replica is up ({self.describe()})")
        return replicas

    def active(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.status == "healthy"]

    def describe(self) -> str:
        return ", ".join(f"{r.index}: {r.status}" for r in sorted(self.replicas.values(), key=lambda r: r.index))

    def infos(self) -> list[ReplicaInfo]:
        with self.lock:
            return [
                ReplicaInfo(
                    r.index,
                    self.actor_name(r.index),
                    r.info.get("actor_id") or r.actor._actor_id.hex(),
                    r.info.get("node_id", ""),
                    r.info.get("node_ip", ""),
                    int(r.info.get("pid", 0)),
                    r.status,
                    r.needs_weights,
                    self.router.load(r.index) if r.index in self.router.replicas else 0,
                )
                for r in sorted(self.replicas.values(), key=lambda r: r.index)
            ]

    def state(self) -> EngineState:
        """The states of the replicas that take traffic, combined (of every replica up when none does)."""
        active = self.active()
        states = [r.state for r in active if not r.needs_weights] or [r.state for r in active] or [EngineState()]
        levels = [s.sleep_level for s in states if s.sleep_level is not None]
        return EngineState(
            released_tags=frozenset().union(*(s.released_tags for s in states)),
            sleep_level=max(levels) if levels else None,
            weights_loaded=all(s.weights_loaded for s in states),
            closed=self.closed,
        )

    # ---- the one fan-out call ---------------------------------------------------------------------------------
    def call(
        self,
        what: str,
        submit: Submit,
        replicas: list[Replica] | None = None,
        *,
        timeout: float | None = None,
        errors: Literal["raise", "return"] = "raise",
        skip_stale: bool = True,
    ) -> list[Outcome]:
        """``submit`` on every replica (``replicas``, else the ones :meth:`ready` gives), waiting at most
        ``timeout`` (default ``timeout_s``) in all. A ``Reply`` updates the replica's state and version and
        gives its value. ``errors="raise"`` raises the first failure once every call ended (all are logged);
        with ``skip_stale`` the replicas that refused as restarted (they did nothing, and are restored later
        with the state this call leaves) are left out instead. ``"return"`` gives every outcome."""
        if replicas is None:
            self.check_open()
            replicas = self.ready(what)
        outcomes = self.wait(what, [(r, submit(r)) for r in replicas], self.timeout_s if timeout is None else timeout)
        if errors == "return":
            return outcomes
        kept = [o for o in outcomes if not (skip_stale and o.stale)]
        raise_first(what, kept)
        return kept

    def wait(self, what: str, calls: list[tuple[Replica, Any]], timeout: float) -> list[Outcome]:
        """The outcomes of calls already submitted (``call`` submits and waits; this only waits)."""
        if not calls:
            return []
        ray = ray_module()
        refs = [ref for _, ref in calls]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        done = set(ready)
        out: list[Outcome] = []
        for replica, ref in calls:
            if ref not in done:
                error = ReplicaTimeoutError(f"{replica.where}: {what} did not finish within {timeout:g} s")
                out.append(Outcome(replica, error=error))
                continue
            try:
                value = ray.get(ref)
            except Exception as exc:
                out.append(Outcome(replica, error=self.translate(replica, exc, what)))
                continue
            if isinstance(value, tuple) and len(value) == 3 and isinstance(value[1], EngineState):
                value = Reply(*value)  # transport_receive's reply
            if isinstance(value, Reply):
                replica.state, replica.version, value = value.state, value.version, value.value
            out.append(Outcome(replica, value))
        return out

    def translate(self, replica: Replica, exc: BaseException, what: str) -> BaseException:
        """An error from a replica as the caller should see it: the same genengine error type, naming the replica."""
        ray = ray_module()
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = exc.cause
            if isinstance(cause, StaleReplicaError):
                self.mark_stale(replica)
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
            self.mark_stale(replica)
            error = ReplicaDiedError(f"{replica.where} died during {what}: {type(exc).__name__}: {str(exc)[:300]}")
            error.__cause__ = exc
            return error
        return exc

    # ---- routing ------------------------------------------------------------------------------------------------
    def route(self, work: list[tuple[str | None, int]], ids: list[int]) -> dict[int, list[int]]:
        """``ids[j]`` (of key and cost ``work[j]``) grouped by the replica the router picks for each; restores
        the replicas that are back first, and waits for one when none is routed to."""
        self.recover()
        if not self.router.replicas:
            self.recover(wait=True)
        waiting = [r for r in self.active() if r.needs_weights]
        if not self.router.replicas and waiting:
            raise WeightsNotLoadedError(
                f"no replica takes traffic: {', '.join(r.where for r in waiting)} wait(s) for the next "
                "load_weights (restored without a source of the current weights, or a failed sync left a mix)"
            )
        if not self.router.replicas:
            self.check_dead()
        groups: dict[int, list[int]] = {}
        for (key, cost), i in zip(work, ids, strict=True):
            groups.setdefault(self.router.pick(key, cost=cost), []).append(i)
        return groups

    def keys(self, requests: list[Request], session_id: str | Sequence[str | None] | None) -> list[str | None]:
        """Each request's routing key: its session id, else its prompt prefix (``prefix_tokens``)."""
        length = self.options.prefix_tokens
        if session_id is None:
            return [prefix_key(r.prompt, r.prompt_token_ids, length=length) for r in requests]
        if isinstance(session_id, str):
            return [session_id] * len(requests)
        ids = list(session_id)
        if len(ids) != len(requests) or not all(s is None or isinstance(s, str) for s in ids):
            raise InvalidArgumentError(
                f"session_id={session_id!r}: give one string for every prompt, or a list of {len(requests)} "
                "strings (or None)"
            )
        return [
            s if s is not None else prefix_key(r.prompt, r.prompt_token_ids, length=length)
            for s, r in zip(ids, requests, strict=True)
        ]

    def check_can_generate(self) -> None:
        state = self.state()
        if state.released_tags:
            ordered = [t for t in self.supported_tags if t in state.released_tags]
            raise EngineSleepingError(
                f"the pool is asleep (released: {', '.join(ordered)}); call wake() before generate"
            )
        if not state.weights_loaded:
            raise WeightsNotLoadedError(
                "the pool's weights are incomplete (a level-2 sleep or a failed load): load_weights first"
            )

    def generate(self, requests: list[Request], keys: list[str | None]) -> list[GenerationResult]:
        """Each request on the replica the router picks for its key, batched per replica; a replica that refused
        as restarted (it did nothing) has its requests sent elsewhere, one that died too while the options'
        ``request_retries`` allow."""
        results: list[GenerationResult | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        retries = 0
        while todo:
            groups = self.route([(keys[i], requests[i].params.n) for i in todo], todo)
            calls = []
            for index, members in groups.items():
                replica = self.replicas[index]
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
            for o in self.wait("generate", calls, self.options.request_timeout_s):
                members = groups[o.replica.index]
                self.router.done(o.replica.index, sum(requests[i].params.n for i in members))
                if o.stale:
                    todo += members  # it did nothing: send its prompts elsewhere
                elif o.died and retries < self.options.request_retries:
                    _log.warning("%s; sending its %d prompt(s) to another replica", o.error, len(members))
                    todo, died = todo + members, True
                elif o.error is not None:
                    errors.append(o.error)
                else:
                    for i, result in zip(members, o.value, strict=True):
                        results[i] = result
            if errors:
                raise errors[0]
            retries += died
        return [r for r in results if r is not None]

    # ---- end ------------------------------------------------------------------------------------------------------
    def teardown(self, replicas: list[Replica]) -> None:
        ray = ray_module()
        live = [r for r in replicas if r.status != "dead"]
        self.call("shutdown", lambda r: r.actor.shutdown.remote(), live, errors="return")
        for r in replicas:
            with contextlib.suppress(Exception):
                ray.kill(r.actor, no_restart=True)
            if r.owned_pg is not None:
                with contextlib.suppress(Exception):
                    ray.util.remove_placement_group(r.owned_pg)
            self.unroute(r)
