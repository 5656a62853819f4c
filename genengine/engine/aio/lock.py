"""``DriverLock``: the fair-enough lock between a backend's driver thread and the callers that need its engine.

A driver steps the engine in a loop; without the waiting count, an abort, a pause or a weight load could wait
behind a long generation for as long as it runs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

__all__ = ["DriverLock"]


class DriverLock:
    """The lock around every call into an engine that a driver thread steps (the scheduler of an async
    backend). Callers outside the driver count themselves in ``waiting``: the driver takes the lock straight
    back after each step (Python locks are not fair), so it waits while anyone else does, and an abort, a
    pause or a weight load never starves behind a long generation."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._count = threading.Lock()
        self.waiting = 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        """For a caller outside the driver."""
        with self._count:
            self.waiting += 1
        try:
            with self.lock:
                yield
        finally:
            with self._count:
                self.waiting -= 1

    def let_callers_in(self) -> None:
        """For the driver, before it takes the lock again: until no caller waits for it."""
        while self.waiting:
            time.sleep(0.0002)

    @contextlib.contextmanager
    def for_driver(self) -> Iterator[None]:
        self.let_callers_in()
        with self.lock:
            yield
