"""``StreamBase.collect`` cancelled: the request is aborted and the caller sees ``CancelledError``, also when a
``wait_for`` inside the stream's ``__anext__`` swallowed the cancellation (Python < 3.12 returns the inner result
when it finished at the same moment: the Ray pool's stream, and Ray's own, read chunks through ``wait_for``)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from genengine.engine.aio.stream import StreamBase
from genengine.protocol import GenerationResult, StreamChunk


class _Endless(StreamBase):
    """A request that yields a chunk every few ms until aborted; ``swallow``: its ``__anext__`` eats a
    cancellation once, as ``wait_for`` does when the chunk it waited for came at the same moment."""

    def __init__(self, swallow: bool) -> None:
        self.swallow = swallow
        self.aborted: list[bool] = []

    @property
    def request_id(self) -> str:
        return "endless"

    @property
    def done(self) -> bool:
        return bool(self.aborted)

    async def __anext__(self) -> StreamChunk:
        if self.aborted:
            raise StopAsyncIteration
        try:
            await asyncio.sleep(0.002)
        except asyncio.CancelledError:
            if not self.swallow:
                raise
            self.swallow = False
        return StreamChunk("endless", 0, [1], None, 0)

    def _error(self) -> BaseException | None:
        return None

    def _result(self) -> GenerationResult | None:
        return None

    async def _abort(self, *, cancelled: bool) -> None:
        self.aborted.append(cancelled)

    async def _close(self) -> None:
        return None


@pytest.mark.parametrize("swallow", [False, True], ids=["plain", "swallowed-by-wait_for"])
def test_a_cancelled_collect_aborts_the_request_and_raises(swallow: bool) -> None:
    if swallow and sys.version_info < (3, 11):
        pytest.skip("Task.cancelling() (how a swallowed cancellation is seen) is Python 3.11+")
    stream = _Endless(swallow)

    async def main() -> None:
        task = asyncio.ensure_future(stream.collect())
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert stream.aborted == [True]
