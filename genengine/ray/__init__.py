"""Engine replicas as Ray actors: ``EnginePool`` is a ``GenerationEngine`` (sync and async) over N of them.

Importing this package imports neither Ray nor torch; Ray is imported when a pool starts. See
docs/deployment.md for the placements (colocated with trainer actors, or on GPUs of their own), the router
and what happens when a replica dies.
"""

from genengine.ray.errors import ReplicaDiedError, ReplicaError, ReplicaTimeoutError, StaleReplicaError
from genengine.ray.pool import PLACEMENTS, EnginePool, PoolStream, ReplicaInfo
from genengine.ray.router import Router, RouterStats, prefix_key

__all__ = [
    "PLACEMENTS",
    "EnginePool",
    "PoolStream",
    "ReplicaDiedError",
    "ReplicaError",
    "ReplicaInfo",
    "ReplicaTimeoutError",
    "Router",
    "RouterStats",
    "StaleReplicaError",
    "prefix_key",
]
