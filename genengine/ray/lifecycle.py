"""``Lifecycle``: placement, start, health, restore and teardown of a fleet's replicas.

A replica that Ray restarted is marked stale, takes no traffic, and is restored (weights through the
``refill`` the pool gives, which is its weight sync's; then version, sleep and pause state) before it is
routed to again. Every change to the fleet goes through its verbs. Importing this module imports neither Ray
nor torch.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from genengine.errors import EngineStateError
from genengine.protocol import TAG_WEIGHTS, EngineState
from genengine.ray.errors import ReplicaTimeoutError
from genengine.ray.fanout import Outcome
from genengine.ray.fleet import Fleet, Submit
from genengine.ray.handle import Replica, spawn
from genengine.ray.options import ray_module

__all__ = ["Lifecycle", "Refill"]

_log = logging.getLogger("genengine.ray.pool")  # one logger for the pool and its parts

Refill = Callable[[Replica], bool]
"""Load the current weights into a restored replica; False when the pool has no source for them."""


class Lifecycle:
    """Starts, watches, restores and stops the replicas of ``fleet``."""

    def __init__(self, fleet: Fleet, refill: Refill) -> None:
        self.fleet = fleet
        self.refill = refill
        self._pending: dict[Replica, Any] = {}  # an info() call in flight to a stale replica

    # ---- placement and start ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the replicas the options ask for, all at once; on any failure none is left."""
        ray = ray_module()
        if not ray.is_initialized():
            ray.init()
        fleet = self.fleet
        try:
            self._start([self.new_replica(b) for b in fleet.options.bundles])
        except BaseException:
            self.teardown(list(fleet.replicas.values()))
            for r in list(fleet.replicas.values()):
                fleet.drop(r)
            raise
        fleet.set_supported_tags(next(iter(fleet.replicas.values())).info["supported_tags"])

    def new_replica(self, bundle_index: int | None) -> Replica:
        """Create (not start) one replica actor, in its own placement group or the trainer's bundle."""
        ray = ray_module()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        fleet, opts = self.fleet, self.fleet.options
        index = fleet.new_index()
        owned = None
        if bundle_index is None:
            bundle = {"CPU": opts.num_cpus} if opts.num_cpus else {}
            if opts.num_gpus:
                bundle["GPU"] = opts.num_gpus
            owned = placement_group([bundle], strategy="STRICT_PACK", name=f"genengine-pool-{fleet.pool_id}-{index}")
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
            "name": fleet.actor_name(index),
        }
        if opts.runtime_env is not None:
            actor_options["runtime_env"] = dict(opts.runtime_env)
        config = opts.config.replace(seed=opts.config.seed + index)
        replica = Replica(index, spawn(index, actor_options), config, bundle_index, owned)
        fleet.adopt(replica)
        return replica

    def _start(self, replicas: list[Replica]) -> None:
        """Start the engines of new replicas, all at once, within ``start_timeout_s``."""
        fleet = self.fleet

        def start(submit: Submit) -> list[Outcome]:
            return fleet.call("start", submit, replicas, timeout=fleet.options.start_timeout_s, skip_stale=False)

        for o in start(Replica.ask_info):
            fleet.identify(o.replica, o.value)
        start(Replica.start)
        for o in start(Replica.ask_info):
            fleet.identify(o.replica, o.value)
            fleet.mark_healthy(o.replica)

    def add(self, bundle_index: int | None) -> Replica:
        """One more replica, started and brought to the pool's weights and state (torn down if that fails)."""
        fleet = self.fleet
        with fleet.lock:
            replica = self.new_replica(bundle_index)
            try:
                (outcome,) = fleet.call("start", Replica.ask_info, [replica], skip_stale=False)
                self.restore(replica, outcome.value)
            except BaseException:
                self.teardown([replica])
                fleet.drop(replica)
                raise
            return replica

    # ---- health and restore --------------------------------------------------------------------------------------
    def restore(self, replica: Replica, info: dict[str, Any]) -> None:
        """Bring a restarted (or new) replica to the pool's weights, version, sleep and pause state."""
        fleet = self.fleet
        with fleet.lock:
            self._pending.pop(replica, None)
            fleet.identify(replica, info)
            if not info["started"]:
                fleet.call("start", Replica.start, [replica], skip_stale=False)
            state = fleet.state() if fleet.active() else EngineState()
            level = state.sleep_level
            loaded = False
            if level != 2 and state.weights_loaded:  # level 1 keeps what was loaded: load before sleeping
                loaded = self.refill(replica)
            if level is not None:
                fleet.call("sleep", lambda r: r.sleep(level), [replica])
                awake = [t for t in fleet.supported_tags if t not in state.released_tags]
                if awake:
                    fleet.call("wake", lambda r: r.wake(awake), [replica])
                if level == 2 and state.weights_loaded and TAG_WEIGHTS in awake:
                    loaded = self.refill(replica)
            if fleet.paused is not None:
                mode, clear = fleet.paused
                fleet.call("pause_generation", lambda r: r.pause_generation(mode, clear), [replica])
            # Without a source its engine holds the disk checkpoint: no traffic until the next load_weights
            # (unless it refuses to generate anyway, as after a level-2 sleep).
            needs_weights = fleet.loaded_once and not loaded and replica.state.weights_loaded
            fleet.mark_healthy(replica, needs_weights=needs_weights)
            _log.warning(
                "%s restored: weight version %d%s",
                replica.where,
                replica.version,
                ", waiting for the next load_weights" if needs_weights else "",
            )

    def recover(self, wait: bool = False) -> None:
        """Restore every stale replica whose actor is back; with ``wait``, wait for them (``start_timeout_s``)."""
        ray = ray_module()
        fleet = self.fleet
        deadline = time.monotonic() + (fleet.options.start_timeout_s if wait else 0)
        with fleet.lock:
            while True:
                stale = [r for r in fleet.replicas.values() if r.status == "stale"]
                if not stale:
                    return
                for r in stale:
                    if r not in self._pending:
                        self._pending[r] = r.ask_info()
                refs = [self._pending[r] for r in stale]
                left = max(0.0, deadline - time.monotonic())
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=left)
                for r in stale:
                    if self._pending[r] not in ready:
                        continue
                    try:
                        info = ray.get(self._pending.pop(r))
                    except ray.exceptions.ActorDiedError:
                        # Not raised here: the caller (a generate retrying elsewhere, check_health) goes on with
                        # the replicas that are up; control calls raise for it (check_dead) until it is removed.
                        fleet.mark_dead(r)
                        _log.error(
                            "%s is dead and Ray will not restart it (max_restarts=%d): it takes no traffic; "
                            "remove_replica(%d) it",
                            r.where,
                            fleet.options.max_restarts,
                            r.index,
                        )
                        continue
                    except ray.exceptions.RayActorError:
                        continue  # restarting: ask again
                    if r.killed is not None and info.get("incarnation") == r.killed:
                        if wait:
                            time.sleep(0.05)  # the kill lands within moments: do not spin on the answers
                        continue  # the killed incarnation, before Ray's kill landed: ask again
                    self.restore(r, info)
                if not wait:
                    return
                waiting = [r for r in fleet.replicas.values() if r.status == "stale"]
                if waiting and time.monotonic() >= deadline:
                    raise ReplicaTimeoutError(
                        f"{waiting[0].where} did not come back within {fleet.options.start_timeout_s:g} s"
                    )
                if waiting:
                    time.sleep(0.05)

    def ping(self, what: str) -> None:
        """Ask every healthy replica who it is (``timeout_s``; answered at once): one that does not answer, or
        answers as another incarnation, is marked stale; then the ones back are restored."""
        fleet = self.fleet
        for o in fleet.call(what, Replica.ask_info, fleet.active(), errors="return"):
            if o.error is not None or o.value["incarnation"] != o.replica.incarnation:
                fleet.mark_stale(o.replica)

    def ready(self, what: str) -> list[Replica]:
        """The replicas a control call goes to: the ones back restored first; raises when one is dead for good
        (until it is removed) or none is up."""
        fleet = self.fleet
        self.recover()
        fleet.check_dead()
        replicas = fleet.active()
        if not replicas:
            raise EngineStateError(f"{what}: no replica is up ({fleet.describe()})")
        return replicas

    def each(self, what: str, submit: Submit) -> list[Outcome]:
        """A control call on every replica that is up (``ready``), failures raised (``Fleet.call``)."""
        self.fleet.check_open()
        return self.fleet.call(what, submit, self.ready(what))

    # ---- end --------------------------------------------------------------------------------------------------------
    def teardown(self, replicas: list[Replica]) -> None:
        """Shut the engines down (``timeout_s``), kill the actors and free the placement groups the pool made."""
        ray = ray_module()
        fleet = self.fleet
        live = [r for r in replicas if r.status != "dead"]
        fleet.call("shutdown", Replica.shutdown, live, errors="return")
        for r in replicas:
            self._pending.pop(r, None)
            with contextlib.suppress(Exception):
                r.kill(restart=False)
            if r.owned_pg is not None:
                with contextlib.suppress(Exception):
                    ray.util.remove_placement_group(r.owned_pg)
            fleet.unroute(r)
