"""The one fan-out: wait for calls already submitted to replicas and say how each ended, changing nothing.

:func:`gather` waits for one call per replica (at most a timeout in all) and gives one typed :class:`Outcome`
each: the engine's :class:`~genengine.ray.replica.Reply` (or the replica call's plain value), or the error
translated to name the replica. It writes no replica and no pool state: the caller applies the outcomes
through the fleet's verbs (``Fleet.apply``). Importing this module imports neither Ray nor torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from genengine.errors import GenEngineError
from genengine.ray.errors import ReplicaDiedError, ReplicaError, ReplicaTimeoutError, StaleReplicaError
from genengine.ray.handle import Replica
from genengine.ray.options import ray_module
from genengine.ray.replica import Reply

__all__ = ["Outcome", "gather", "raise_first", "translate"]

_log = logging.getLogger("genengine.ray.pool")  # one logger for the pool and its parts


@dataclass(frozen=True)
class Outcome:
    """How one replica's call ended: its reply (an engine call) or value (a replica call), or its error (already
    naming the replica)."""

    replica: Replica
    reply: Reply | None = None
    """The engine call's value with the engine's state and weight version right after it."""
    plain: Any = None
    """A replica call's value (``info``, ``in_flight``, ``start``, ...): nothing of the engine's state."""
    error: BaseException | None = None

    @property
    def value(self) -> Any:
        """The call's value: the reply's, or the plain one."""
        return self.reply.value if self.reply is not None else self.plain

    @property
    def stale(self) -> bool:
        """It refused as restarted: the call did nothing there."""
        return isinstance(self.error, StaleReplicaError)

    @property
    def died(self) -> bool:
        return isinstance(self.error, ReplicaDiedError)

    @property
    def lost(self) -> bool:
        """The replica restarted or died: the pool stops routing to it until it is restored."""
        return self.stale or self.died


def raise_first(what: str, outcomes: Sequence[Outcome]) -> None:
    """Raise the first failure of ``outcomes`` (every one is logged when several failed)."""
    errors = [o.error for o in outcomes if o.error is not None]
    if errors:
        if len(errors) > 1:
            _log.error("%s failed on %d replicas: %s", what, len(errors), "; ".join(map(str, errors)))
        raise errors[0]


def gather(what: str, calls: Sequence[tuple[Replica, Any]], timeout: float) -> list[Outcome]:
    """The outcomes of calls already submitted (one object ref per replica), waiting at most ``timeout`` in all.
    A call still running then is a ``ReplicaTimeoutError``."""
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
            out.append(Outcome(replica, error=translate(replica, exc, what)))
            continue
        out.append(Outcome(replica, reply=value) if isinstance(value, Reply) else Outcome(replica, plain=value))
    return out


def translate(replica: Replica, exc: BaseException, what: str) -> BaseException:
    """An error from a replica as the caller should see it: the same genengine error type, naming the replica
    (a restarted one's ``StaleReplicaError`` as it is; an actor gone, ``ReplicaDiedError``)."""
    ray = ray_module()
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause
        if isinstance(cause, StaleReplicaError):
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
        error = ReplicaDiedError(f"{replica.where} died during {what}: {type(exc).__name__}: {str(exc)[:300]}")
        error.__cause__ = exc
        return error
    return exc
