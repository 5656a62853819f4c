"""Every error genengine raises on purpose, under one base class.

Each class also derives from the builtin a caller would naturally catch (``ValueError`` for bad input,
``RuntimeError`` for a wrong state, ``AssertionError`` for the reference's distributed checks), so code
written against plain Python exceptions keeps working.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "BackendImportError",
    "BackendNotFoundError",
    "CheckpointError",
    "CollectiveTimeoutError",
    "ConfigError",
    "DistributedSetupError",
    "DuplicateBackendError",
    "DuplicateTransportError",
    "EngineClosedError",
    "EngineSleepingError",
    "EngineStateError",
    "GenEngineError",
    "InconsistentInputsError",
    "InvalidArgumentError",
    "TransportError",
    "TransportNotFoundError",
    "WeightLoadError",
    "WeightsNotLoadedError",
    "closest",
]


class GenEngineError(Exception):
    """Base of every error genengine raises on purpose."""


# --- registry ---------------------------------------------------------------------------------------
class BackendNotFoundError(GenEngineError, LookupError):
    """No backend of that name is installed."""


class TransportError(GenEngineError, RuntimeError):
    """A weight sync failed: bad spec, a peer failed, or the group is broken after an earlier failure.

    Here (not in ``genengine.transport.errors``, which hands it on) because the registry raises the two below.
    """


class TransportNotFoundError(TransportError, LookupError):
    """No transport of that name is registered."""


class DuplicateTransportError(TransportError):
    """Two plugins registered the same transport name."""


class BackendImportError(GenEngineError, ImportError):
    """A backend's plugin or engine package failed to import; the original error is chained."""


class DuplicateBackendError(GenEngineError):
    """Two plugins registered the same backend name: the first is kept, and this error is the second's
    reason for being listed as not loadable (chained under the ``BackendImportError`` selecting it raises)."""


# --- input ------------------------------------------------------------------------------------------
class ConfigError(GenEngineError, ValueError):
    """An engine configuration has an unknown key or a value out of range."""


class InvalidArgumentError(GenEngineError, ValueError):
    """A call got a value it does not accept; nothing was changed."""


class CheckpointError(ConfigError, InvalidArgumentError):
    """A model directory cannot be read (config, index, safetensors header): a bad configuration for
    ``create_engine`` and a bad argument for the reference entry points, so it is both."""


class WeightLoadError(InvalidArgumentError):
    """``load_weights`` got a name, shape, dtype or value the engine cannot take."""


# --- state ------------------------------------------------------------------------------------------
class EngineStateError(GenEngineError, RuntimeError):
    """The call is not allowed in the engine's current state."""


class EngineSleepingError(EngineStateError):
    """The engine (or the part of it the call needs) is asleep; ``wake`` it first."""


class WeightsNotLoadedError(EngineStateError):
    """The engine's weights are not valid (level-2 sleep or a failed load) until a full ``load_weights``."""


class EngineClosedError(EngineStateError):
    """The engine was shut down."""


# --- distributed ------------------------------------------------------------------------------------
class DistributedSetupError(GenEngineError, AssertionError):
    """The distributed world does not fit the request.

    An ``AssertionError`` because the reference (``lightrft.strategy.sglang_utils``) documents its
    checks as ``AssertionError``; it is raised explicitly, so it survives ``python -O``.
    """


class CollectiveTimeoutError(GenEngineError, TimeoutError):
    """A collective inside an engine group did not finish in time (a rank died or diverged)."""


class InconsistentInputsError(GenEngineError, ValueError):
    """Ranks of one tensor-parallel group passed different inputs to a call that needs identical ones."""


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice most like ``word``, for "did you mean" hints; None if nothing is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return match[0] if match else None
