"""The ``verl.plugins`` entry point: ``import verl`` imports this module in every process and it registers
genengine's replica and server adapter under ``rollout.name=genengine``.

verl logs a plugin that fails to import only at DEBUG, and the run then dies much later with "Unknown rollout
mode". So nothing here may raise: a failure to register is logged as a WARNING naming its cause.
"""

from __future__ import annotations

import logging

from genengine.integrations.verl.config import NAME, trl_conflict

__all__ = ["ADAPTER", "register"]

ADAPTER = "genengine.integrations.verl.adapter.GenEngineServerAdapter"
"""The dotted path verl's ``get_rollout_class("genengine", "async")`` imports in each trainer worker."""

_log = logging.getLogger("genengine.integrations.verl")


def _load_replica() -> type:
    from genengine.integrations.verl.replica import GenEngineReplica

    return GenEngineReplica


def register() -> bool:
    """Register the replica (lazily imported) and the server adapter's path with verl; True when both are.
    Any failure is a WARNING naming it, never an exception: ``import verl`` must go on."""
    try:
        from verl.workers.rollout.base import _ROLLOUT_REGISTRY
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        _ROLLOUT_REGISTRY[(NAME, "async")] = ADAPTER
        RolloutReplicaRegistry.register(NAME, _load_replica)
    except Exception as exc:
        _log.warning(
            "genengine: could not register rollout.name=%s with verl (%s: %s); a run with that rollout will fail "
            "with verl's 'Unknown rollout mode'. genengine's verl integration is written for verl 0.9.1 "
            "(pip install 'genengine[verl]')",
            NAME,
            type(exc).__name__,
            exc,
        )
        return False
    conflict = trl_conflict()
    if conflict is not None:
        _log.warning("genengine: %s", conflict)
    return True


register()
