"""``RequestStream``: what ``stream()`` returns to the caller, an async iterator of one request's chunks and
then its result; closing it early (or cancelling ``collect``) aborts the request.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from genengine.errors import EngineStateError
from genengine.protocol import GenerationResult

if TYPE_CHECKING:
    from genengine.aio.engine import AsyncEngineBase
    from genengine.aio.request import AsyncRequest, StreamChunk

__all__ = ["RequestStream"]


class RequestStream:
    """One submitted request: an async iterator of its chunks, then its result."""

    def __init__(self, engine: AsyncEngineBase, request: AsyncRequest) -> None:
        self._engine = engine
        self._request = request
        self._chunks = request.chunks()

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamChunk:
        return await self._chunks.__anext__()

    async def collect(self) -> GenerationResult:
        """Read the chunks not read yet and return the result; a caller cancelled meanwhile aborts the request."""
        try:
            async for _ in self:
                pass
        except asyncio.CancelledError:
            if not self._request.done:
                self._engine._async_abort([self._request])
            raise
        return self.result()

    def result(self) -> GenerationResult:
        """Every completion with its tokens, logprobs and weight versions; only once the stream has ended."""
        if self._request.error is not None:
            raise self._request.error
        if not self._request.done:
            raise EngineStateError(f"request {self.request_id!r} is still running: read its stream to the end first")
        return self._request.result()

    async def aclose(self) -> None:
        """Stop reading: a request still running is aborted (nobody wants its tokens any more)."""
        if not self._request.done:
            await self._engine.abort(self.request_id)
        await self._chunks.aclose()
