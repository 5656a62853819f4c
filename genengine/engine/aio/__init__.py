"""The async capability, written once: streamed requests, abort, pause for a weight update, resume.

``engine`` holds what a backend subclasses and the caller's handle on one of its requests (``RequestStream``),
``request`` the request a backend reports into, ``stream`` the base every stream shares, ``lock`` the lock a
driver thread shares with callers; the contract's types (``StreamChunk``, ``PauseMode``) are
``genengine.protocol``'s. Every name is re-exported here: ``from genengine.engine.aio import X`` is the import to use.
"""

from genengine.engine.aio.engine import AsyncEngineBase, RequestStream
from genengine.engine.aio.lock import DriverLock
from genengine.engine.aio.request import AsyncRequest, normalize_async_request, normalize_request_ids
from genengine.protocol import PAUSE_MODES, PauseMode, StreamChunk

__all__ = [
    "PAUSE_MODES",
    "AsyncEngineBase",
    "AsyncRequest",
    "DriverLock",
    "PauseMode",
    "RequestStream",
    "StreamChunk",
    "normalize_async_request",
    "normalize_request_ids",
]
