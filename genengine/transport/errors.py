"""The errors of weight transports, under :class:`genengine.errors.GenEngineError` (``TransportError`` and the
registry's two lookup errors live in :mod:`genengine.errors`, handed on here).

The field's top complaint about weight syncs is the one that hangs with no error (TRL #6796/#6797):
every wait of a transport has a deadline, and the error says which group, which rank(s) and which
timeout, so that the job log names who did not arrive.
"""

from __future__ import annotations

from genengine.errors import DuplicateTransportError, TransportError, TransportNotFoundError

__all__ = [
    "ChecksumError",
    "DuplicateTransportError",
    "TransportError",
    "TransportNotFoundError",
    "TransportTimeoutError",
]


class TransportTimeoutError(TransportError, TimeoutError):
    """A peer did not arrive in time, or went away (died) while the others waited for it.

    The message names the group, the rank(s) waited for and the timeout. The group is out of step
    afterwards: close it and form a new one (a new ``group_name``).
    """


class ChecksumError(TransportError):
    """A bucket arrived with a checksum other than the sender's: nothing of it was loaded.

    The message names the bucket and its tensors.
    """
