"""``StreamBase``: what every stream of genengine shares (an engine's ``RequestStream`` and the Ray pool's
``PoolStream``): an async iterator of one request's chunks and then its result, ``collect``, ``result`` and
``aclose`` over four hooks a stream fills in; closing it early (or cancelling ``collect``) aborts the request.
"""

from __future__ import annotations

import abc
import asyncio
from typing import TYPE_CHECKING

from genengine.errors import EngineStateError
from genengine.protocol import GenerationResult

if TYPE_CHECKING:
    from genengine.protocol import StreamChunk

__all__ = ["StreamBase"]


class StreamBase(abc.ABC):
    """One submitted request: an async iterator of its chunks, then its result."""

    @property
    @abc.abstractmethod
    def request_id(self) -> str: ...

    @property
    @abc.abstractmethod
    def done(self) -> bool:
        """The request ended (finished, aborted or failed): nothing is left to read but its end."""

    @abc.abstractmethod
    async def __anext__(self) -> StreamChunk: ...

    @abc.abstractmethod
    def _error(self) -> BaseException | None:
        """What the request failed with, if it did."""

    @abc.abstractmethod
    def _result(self) -> GenerationResult | None:
        """The result, once the request ended without an error (else None)."""

    @abc.abstractmethod
    async def _abort(self, *, cancelled: bool) -> None:
        """Abort the request still running (``cancelled``: the caller of ``collect`` was cancelled)."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """After ``aclose`` aborted what was running: let go of the chunks."""

    def __aiter__(self) -> StreamBase:
        return self

    async def collect(self) -> GenerationResult:
        """Read the chunks not read yet and return the result; a caller cancelled meanwhile aborts the request."""
        task = asyncio.current_task()
        cancels = _cancels(task)
        try:
            async for _ in self:
                if _cancels(task) > cancels:
                    # A cancellation that an ``asyncio.wait_for`` inside ``__anext__`` swallowed (before Python
                    # 3.12 it returns the inner result when that finished at the same moment): honoured here.
                    raise asyncio.CancelledError
        except asyncio.CancelledError:
            if not self.done:
                await self._abort(cancelled=True)
            raise
        return self.result()

    def result(self) -> GenerationResult:
        """Every completion with its tokens, logprobs and weight versions; only once the stream has ended."""
        error = self._error()
        if error is not None:
            raise error
        result = self._result()
        if result is None:
            raise EngineStateError(f"request {self.request_id!r} is still running: read its stream to the end first")
        return result

    async def aclose(self) -> None:
        """Stop reading: a request still running is aborted (nobody wants its tokens any more)."""
        if not self.done:
            await self._abort(cancelled=False)
        await self._close()


def _cancels(task: asyncio.Task[object] | None) -> int:
    """The cancellations requested of ``task`` and not withdrawn (Python 3.11+; 0 before, or with no task)."""
    cancelling = getattr(task, "cancelling", None)
    return int(cancelling()) if cancelling is not None else 0
