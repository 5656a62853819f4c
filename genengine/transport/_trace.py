"""Where a sync's time goes: per-bucket phase timings of each endpoint, when ``$GENENGINE_SYNC_TRACE`` names
a folder (one JSON file per endpoint and sync: ``sync-<seq>-<side>-<pid>.json``). Off (no cost) otherwise.

A pool's sync time is the sum of sender and receiver phases that wait on each other; only timings from both
ends, side by side, say which one to cut (``docs/benchmarks-history.md``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

ENV = "GENENGINE_SYNC_TRACE"


class Trace:
    """Phase stamps of one endpoint's sync; ``mark(phase)`` adds the time since the previous mark."""

    def __init__(self, side: str) -> None:
        folder = os.environ.get(ENV)
        self._dir = Path(folder) if folder else None
        self._side = side
        self._last = time.perf_counter()
        self._rows: list[dict[str, float]] = []
        self._row: dict[str, float] = {}

    @property
    def on(self) -> bool:
        return self._dir is not None

    def mark(self, phase: str) -> None:
        if self._dir is None:
            return
        now = time.perf_counter()
        self._row[phase] = self._row.get(phase, 0.0) + (now - self._last)
        self._last = now

    def next_bucket(self) -> None:
        if self._dir is not None and self._row:
            self._rows.append(self._row)
            self._row = {}

    def write(self, seq: int, report: Any, **extra: Any) -> None:
        """The sync's phases per bucket and their totals, beside its ``SyncReport`` (and ``extra``)."""
        if self._dir is None:
            return
        self.next_bucket()
        totals: dict[str, float] = {}
        for row in self._rows:
            for phase, secs in row.items():
                totals[phase] = totals.get(phase, 0.0) + secs
        self._dir.mkdir(parents=True, exist_ok=True)
        path = self._dir / f"sync-{seq}-{self._side}-{os.getpid()}.json"
        path.write_text(
            json.dumps(
                {
                    "side": self._side,
                    "seq": seq,
                    **dataclasses.asdict(report),
                    **extra,
                    "totals": totals,
                    "buckets": self._rows,
                }
            )
        )
