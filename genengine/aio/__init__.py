"""The async capability, written once: streamed requests, abort, pause for a weight update, resume.

``engine`` holds what a backend subclasses, ``request`` the request a backend reports into and the chunks its
caller reads, ``stream`` the caller's handle on one request, ``lock`` the lock a driver thread shares with
callers. Every name is re-exported here: ``from genengine.aio import X`` is the import to use.
"""

from genengine.aio.engine import PAUSE_MODES, AsyncEngineBase, PauseMode
from genengine.aio.lock import DriverLock
from genengine.aio.request import AsyncRequest, StreamChunk, normalize_async_request
from genengine.aio.stream import RequestStream

__all__ = [
    "PAUSE_MODES",
    "AsyncEngineBase",
    "AsyncRequest",
    "DriverLock",
    "PauseMode",
    "RequestStream",
    "StreamChunk",
    "normalize_async_request",
]
