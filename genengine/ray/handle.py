"""``Replica``: one replica actor as the pool sees it, and the typed calls on it.

Every call the pool makes on a replica is a method here, with the replica's arguments typed: nothing names a
replica method by a string, and nothing outside this module touches the actor. Each method returns the
call's Ray object ref (the fleet's fan-out waits for it); the engine calls answer a
:class:`~genengine.ray.replica.Reply`. Only :class:`~genengine.ray.fleet.Fleet` writes a ``Replica``'s fields
(tests/ray_pool/test_pool_hygiene.py checks it). Importing this module imports neither Ray nor torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from genengine.config import EngineConfig
from genengine.protocol import EngineState
from genengine.ray.options import ray_module
from genengine.requests import Request

__all__ = ["Replica", "ReplicaInfo", "Status", "spawn"]

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


def spawn(index: int, options: dict[str, Any]) -> Any:
    """Create replica ``index``'s actor with Ray's actor ``options`` (its engine is built by ``start``)."""
    from genengine.ray.replica import EngineReplica

    return ray_module().remote(EngineReplica).options(**options).remote(index)


@dataclass(eq=False)
class Replica:
    """One replica actor and what the pool knows of it (identity: the object)."""

    index: int
    actor: Any
    config: EngineConfig
    bundle_index: int | None
    owned_pg: Any = None
    incarnation: str = ""
    killed: str | None = None
    """The incarnation ``restart_replica`` killed: Ray's kill lands a moment later, and what that incarnation
    answers until then does not restore the replica (the refill would die with it)."""
    info: dict[str, Any] = field(default_factory=dict)
    status: Status = "stale"
    needs_weights: bool = False
    state: EngineState = field(default_factory=EngineState)
    version: int = 0

    @property
    def actor_id(self) -> str:
        return str(self.info.get("actor_id") or self.actor._actor_id.hex())

    @property
    def where(self) -> str:
        node = self.info.get("node_ip", "?")
        node_id = (self.info.get("node_id") or "?")[:12]
        return f"replica {self.index} (actor {self.actor_id}, node {node} {node_id})"

    # ---- the replica's own calls (answered at once, whatever the engine does) -----------------------------------
    def ask_info(self) -> Any:
        """Who the actor is now (``EngineReplica.info``): its incarnation, node, and its engine's state."""
        return self.actor.info.remote()

    def start(self) -> Any:
        return self.actor.start.remote(self.incarnation, self.config)

    def in_flight(self, request_ids: Sequence[str]) -> Any:
        return self.actor.in_flight.remote(list(request_ids))

    def shutdown(self) -> Any:
        return self.actor.shutdown.remote()

    def kill(self, *, restart: bool) -> None:
        """Kill the actor (Ray restarts it when ``restart``)."""
        ray_module().kill(self.actor, no_restart=not restart)

    # ---- engine calls: each answers a Reply ------------------------------------------------------------------------
    def generate(self, batch: Sequence[Request]) -> Any:
        texts = [r.prompt for r in batch] if batch[0].prompt is not None else None
        ids = [list(r.prompt_token_ids or ()) for r in batch] if texts is None else None
        images = [r.image for r in batch] if any(r.image is not None for r in batch) else None
        return self.actor.generate.remote(self.incarnation, texts, [r.params for r in batch], ids, images)

    def sleep(self, level: int) -> Any:
        return self.actor.sleep.remote(self.incarnation, level)

    def wake(self, tags: str | list[str] | None) -> Any:
        return self.actor.wake.remote(self.incarnation, tags)

    def flush_cache(self) -> Any:
        return self.actor.flush_cache.remote(self.incarnation)

    def load_weights(
        self, names: list[str], refs: list[Any], version: int | None, bucket_bytes: int | None, check_finite: bool
    ) -> Any:
        return self.actor.load_weights.remote(self.incarnation, names, refs, version, bucket_bytes, check_finite)

    def abort(self, request_ids: list[str] | None) -> Any:
        return self.actor.abort.remote(self.incarnation, request_ids)

    def pause_generation(self, mode: str, clear_cache: bool) -> Any:
        return self.actor.pause_generation.remote(self.incarnation, mode, clear_cache)

    def resume_generation(self) -> Any:
        return self.actor.resume_generation.remote(self.incarnation)

    def stream(self, request: Request, request_id: str) -> Any:
        """The request as a Ray streaming generator of its chunks, then its result."""
        ids = list(request.prompt_token_ids) if request.prompt_token_ids is not None else None
        return self.actor.stream.options(num_returns="streaming").remote(
            self.incarnation, request.prompt, request.params, ids, request.image, request_id
        )

    # ---- weight transports -------------------------------------------------------------------------------------------
    def transport_join(self, spec: Any, rank: int) -> Any:
        return self.actor.transport_join.remote(self.incarnation, spec, rank)

    def transport_receive(self, check_finite: bool) -> Any:
        return self.actor.transport_receive.remote(self.incarnation, check_finite)

    def transport_close(self) -> Any:
        return self.actor.transport_close.remote()
