"""The ``verl.plugins`` entry point: ``import verl`` imports this module in every process and it registers
genengine's replica and server adapter under ``rollout.name=genengine``.

verl logs a plugin that fails to import only at DEBUG, and the run then dies much later with "Unknown rollout
mode". So nothing here may raise: a failure to register is logged as a WARNING naming its cause.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from genengine.integrations.verl.config import NAME, trl_conflict

__all__ = ["ADAPTER", "LOG_LEVEL_ENV", "apply_log_level", "register"]

ADAPTER = "genengine.integrations.verl.adapter.GenEngineServerAdapter"
"""The dotted path verl's ``get_rollout_class("genengine", "async")`` imports in each trainer worker."""

_log = logging.getLogger("genengine.integrations.verl")


LOG_LEVEL_ENV = "GENENGINE_LOGGING_LEVEL"
"""genengine's log level in every process of a verl run (as verl's own ``VERL_LOGGING_LEVEL``): ``import verl``
sets the root logger to WARNING, which hides genengine's INFO lines (engine started, weight-sync group formed,
each sync) in the workers and servers, where a run that stalls before its first step is looked into."""


def apply_log_level(environ: Mapping[str, str] | None = None) -> str | None:
    """Set the ``genengine`` logger's level from ``$GENENGINE_LOGGING_LEVEL`` (a handler to stderr where no logger
    above has one); the level set, or None. A bad value is a WARNING naming it, never an exception."""
    value = (os.environ if environ is None else environ).get(LOG_LEVEL_ENV, "").strip()
    if not value:
        return None
    level = logging.getLevelName(value.upper())
    if not isinstance(level, int):
        _log.warning(
            "genengine: %s=%r is not a log level (allowed: DEBUG, INFO, WARNING, ERROR, CRITICAL); left as it was",
            LOG_LEVEL_ENV,
            value,
        )
        return None
    logger = logging.getLogger("genengine")
    logger.setLevel(level)
    if not logger.hasHandlers():  # no handler above: Python's last resort would print WARNING and up only
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
    return logging.getLevelName(level)


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


apply_log_level()
register()
