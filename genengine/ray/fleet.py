"""``Fleet``: the replicas of one ``EnginePool`` and everything the pool knows of them, behind verbs.

The fleet is the only writer of that state: which replicas exist and their status, each one's engine state and
weight version, which are routed to (the router's entries and loads), the pool's weight version, pause and
closed flags. The other parts read it and change it through the verbs below (``mark_loaded``,
``mark_needs_weights``, ``mark_stale``, ``pick``, ``release``, ...); tests/ray_pool/test_pool_hygiene.py fails if code
elsewhere writes a field. The roles that act on the fleet are their own classes:
:class:`~genengine.ray.lifecycle.Lifecycle` (placement, start, health, restore, teardown) and
:class:`~genengine.ray.dispatch.Dispatch` (routing and ``generate``); the fan-out itself
(:func:`~genengine.ray.fanout.gather`) changes nothing, and :meth:`Fleet.call` applies what it returns.

Importing this module imports neither Ray nor torch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

from genengine.engine.aio import PauseMode
from genengine.errors import EngineClosedError, EngineSleepingError, InvalidArgumentError, WeightsNotLoadedError
from genengine.protocol import EngineState
from genengine.ray.errors import ReplicaDiedError
from genengine.ray.fanout import Outcome, gather, raise_first
from genengine.ray.handle import Replica, ReplicaInfo
from genengine.ray.options import PoolOptions
from genengine.ray.router import Router

__all__ = ["Fleet", "Submit"]

_log = logging.getLogger("genengine.ray.pool")  # one logger for the pool and its parts

Submit = Callable[[Replica], Any]
"""One typed call on a replica (``lambda r: r.sleep(level)``): its object ref."""


class Fleet:
    """The replicas of one pool, their routing and their health: read through properties, changed by verbs."""

    def __init__(self, options: PoolOptions, router: Router, pool_id: str) -> None:
        self.options = options
        self.pool_id = pool_id
        self.lock = threading.RLock()
        self._router = router
        self._replicas: dict[int, Replica] = {}
        self._timeout_s = options.timeout_s
        self._closed = False
        self._version = 0
        self._paused: tuple[PauseMode, bool] | None = None
        self._loaded_once = False
        self._supported_tags: tuple[str, ...] = ()
        self._next_index = 0

    # ---- what the others read ------------------------------------------------------------------------------------
    @property
    def replicas(self) -> Mapping[int, Replica]:
        """Every replica by index (a read-only view: ``adopt`` and ``drop`` change it)."""
        return MappingProxyType(self._replicas)

    @property
    def routed(self) -> tuple[int, ...]:
        """The indexes of the replicas that take traffic."""
        return self._router.replicas

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def version(self) -> int:
        """The version of the last ``load_weights`` that reached every replica (0 at start)."""
        return self._version

    @property
    def loaded_once(self) -> bool:
        """Whether a ``load_weights`` ever reached the pool (then a restored replica needs the trainer's weights)."""
        return self._loaded_once

    @property
    def paused(self) -> tuple[PauseMode, bool] | None:
        """The pool's pause (mode, clear_cache), given to a replica restored while it lasts."""
        return self._paused

    @property
    def supported_tags(self) -> tuple[str, ...]:
        return self._supported_tags

    # ---- verbs: the pool's own state ---------------------------------------------------------------------------
    def set_timeout(self, seconds: float) -> None:
        self._timeout_s = seconds

    def set_paused(self, paused: tuple[PauseMode, bool] | None) -> tuple[PauseMode, bool] | None:
        """Set the pool's pause (None: resumed); returns the one before."""
        before, self._paused = self._paused, paused
        return before

    def set_supported_tags(self, tags: Iterable[str]) -> None:
        self._supported_tags = tuple(tags)

    def close(self) -> None:
        self._closed = True

    def mark_loaded(self, replicas: Sequence[Replica], version: int | None) -> None:
        """A ``load_weights`` reached ``replicas``: the pool's version is ``version`` (unless None), and the ones
        that waited for a whole load take traffic again."""
        with self.lock:
            if version is not None:
                self._version = version
            self._loaded_once = True
            for r in replicas:
                if r.needs_weights:
                    r.needs_weights = False
                    self._router.add(r.index)

    # ---- verbs: one replica ---------------------------------------------------------------------------------------
    def new_index(self) -> int:
        index, self._next_index = self._next_index, self._next_index + 1
        return index

    def adopt(self, replica: Replica) -> None:
        """Count a new replica in (not routed to until ``mark_healthy``)."""
        self._replicas[replica.index] = replica

    def drop(self, replica: Replica) -> None:
        """Count a replica out (unrouted first); it is the caller's to tear down."""
        with self.lock:
            self.unroute(replica)
            if self._replicas.get(replica.index) is replica:
                del self._replicas[replica.index]

    def identify(self, replica: Replica, info: Mapping[str, Any]) -> None:
        """What the replica's ``info`` said: its incarnation (the id every later call names), and its engine's
        state and version once started."""
        replica.info, replica.incarnation, replica.killed = dict(info), info["incarnation"], None
        if "state" in info:
            replica.state, replica.version = info["state"], info["weight_version"]

    def mark_healthy(self, replica: Replica, *, needs_weights: bool = False) -> None:
        """Started or restored: routed to, unless it ``needs_weights`` (then at the next whole load)."""
        with self.lock:
            replica.status, replica.needs_weights = "healthy", needs_weights
            if not needs_weights and replica.index not in self._router.replicas:
                self._router.add(replica.index)

    def mark_stale(self, replica: Replica) -> None:
        """It died or restarted: no traffic until it is restored."""
        with self.lock:
            if replica.status == "healthy":
                replica.status = "stale"
                self.unroute(replica)
                _log.warning("%s died or restarted: it takes no traffic until it is restored", replica.where)

    def mark_killed(self, replica: Replica) -> None:
        """``restart_replica`` kills it: stale, and its killed incarnation's answers do not restore it."""
        with self.lock:
            self.mark_stale(replica)
            replica.killed = replica.incarnation

    def mark_dead(self, replica: Replica) -> None:
        """Ray will not restart it: no traffic, and control calls raise until it is removed."""
        with self.lock:
            replica.status = "dead"
            self.unroute(replica)

    def mark_needs_weights(self, replica: Replica, state: EngineState | None = None) -> None:
        """It holds part of a load (a mix under the old label; ``state`` as it reported it): no traffic until a
        whole ``load_weights`` reaches it (``mark_loaded``)."""
        with self.lock:
            if state is not None:
                replica.state = state
            replica.needs_weights = True
            self.unroute(replica)

    def record(self, replica: Replica, state: EngineState) -> None:
        """The engine state a replica reported outside a reply (its ``info``)."""
        replica.state = state

    def apply(self, outcomes: list[Outcome]) -> list[Outcome]:
        """Record what a fan-out returned: each reply's engine state and version; a replica found restarted or
        dead is marked stale. Returns ``outcomes``."""
        for o in outcomes:
            if o.reply is not None:
                o.replica.state, o.replica.version = o.reply.state, o.reply.version
            elif o.lost:
                self.mark_stale(o.replica)
        return outcomes

    # ---- verbs: the router's entries -----------------------------------------------------------------------------
    def unroute(self, replica: Replica) -> None:
        with contextlib.suppress(InvalidArgumentError):
            self._router.remove(replica.index)

    def pick(self, key: str | None, cost: int) -> int:
        """The replica for one request (``Router.pick``): its load counts ``cost`` until ``release``."""
        return self._router.pick(key, cost=cost)

    def release(self, replica: Replica, incarnation: str, cost: int) -> None:
        """``cost`` units of work routed to ``replica`` (as ``incarnation``) ended there. A replica restored since
        (a new incarnation, its load counted afresh) or removed is left alone."""
        if self._replicas.get(replica.index) is replica and replica.incarnation == incarnation:
            self._router.done(replica.index, cost)

    # ---- the fan-out, applied -----------------------------------------------------------------------------------
    def wait(self, what: str, calls: Sequence[tuple[Replica, Any]], timeout: float) -> list[Outcome]:
        """The outcomes of calls already submitted (``gather``), applied (``call`` submits and waits)."""
        return self.apply(gather(what, calls, timeout))

    def call(
        self,
        what: str,
        submit: Submit,
        replicas: Sequence[Replica],
        *,
        timeout: float | None = None,
        errors: Literal["raise", "return"] = "raise",
        skip_stale: bool = True,
    ) -> list[Outcome]:
        """``submit`` on each of ``replicas``, waiting at most ``timeout`` (default ``timeout_s``) in all, the
        outcomes applied (``apply``). ``errors="raise"`` raises the first failure once every call ended (all are
        logged); with ``skip_stale`` the replicas that refused as restarted (they did nothing, and are restored
        later with the state this call leaves) are left out instead. ``"return"`` gives every outcome."""
        calls = [(r, submit(r)) for r in replicas]
        outcomes = self.wait(what, calls, self._timeout_s if timeout is None else timeout)
        if errors == "return":
            return outcomes
        kept = [o for o in outcomes if not (skip_stale and o.stale)]
        raise_first(what, kept)
        return kept

    # ---- what the pool says of its replicas --------------------------------------------------------------------------
    def actor_name(self, index: int) -> str:
        return f"genengine-pool-{self.pool_id}-replica-{index}"

    def active(self) -> list[Replica]:
        return [r for r in self._replicas.values() if r.status == "healthy"]

    def describe(self) -> str:
        return ", ".join(f"{r.index}: {r.status}" for r in sorted(self._replicas.values(), key=lambda r: r.index))

    def infos(self) -> list[ReplicaInfo]:
        with self.lock:
            routed = self._router.replicas
            return [
                ReplicaInfo(
                    r.index,
                    self.actor_name(r.index),
                    r.actor_id,
                    r.info.get("node_id", ""),
                    r.info.get("node_ip", ""),
                    int(r.info.get("pid", 0)),
                    r.status,
                    r.needs_weights,
                    self._router.load(r.index) if r.index in routed else 0,
                )
                for r in sorted(self._replicas.values(), key=lambda r: r.index)
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
            closed=self._closed,
        )

    def check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the EnginePool was shut down; create a new one")

    def check_dead(self) -> None:
        dead = [r for r in self._replicas.values() if r.status == "dead"]
        if dead:
            raise ReplicaDiedError(
                f"{dead[0].where} is dead and Ray will not restart it (max_restarts={self.options.max_restarts}): "
                f"remove_replica({dead[0].index}) it"
            )

    def check_can_generate(self) -> None:
        state = self.state()
        if state.released_tags:
            ordered = [t for t in self._supported_tags if t in state.released_tags]
            raise EngineSleepingError(
                f"the pool is asleep (released: {', '.join(ordered)}); call wake() before generate"
            )
        if not state.weights_loaded:
            raise WeightsNotLoadedError(
                "the pool's weights are incomplete (a level-2 sleep or a failed load): load_weights first"
            )
