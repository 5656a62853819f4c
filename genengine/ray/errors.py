"""Errors of the Ray engine pool: each names the replica (index, actor id, node) and the call that failed."""

from __future__ import annotations

from genengine.errors import EngineStateError, GenEngineError

__all__ = ["ReplicaDiedError", "ReplicaError", "ReplicaTimeoutError", "StaleReplicaError"]


class ReplicaError(GenEngineError, RuntimeError):
    """A call on one replica of an ``EnginePool`` failed; the message names the replica and the call."""


class ReplicaDiedError(ReplicaError):
    """The replica's actor died during the call (its request was lost: retry it, or ask the pool to)."""


class ReplicaTimeoutError(ReplicaError, TimeoutError):
    """The replica did not answer the call within the pool's timeout."""


class StaleReplicaError(EngineStateError):
    """The replica restarted since the pool last saw it and has not got the current weights yet; the call did
    nothing (raised inside the replica before any work, so the pool can safely send the request elsewhere)."""
