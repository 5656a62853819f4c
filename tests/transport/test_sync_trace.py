"""The sync trace (``$GENENGINE_SYNC_TRACE``): off by default, and when on, one file per endpoint and sync
whose per-bucket phases add up to its totals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from genengine.transport._trace import ENV, Trace
from genengine.transport.spec import SyncReport


def test_off_without_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ENV, raising=False)
    trace = Trace("sender")
    trace.mark("pack")
    trace.write(1, SyncReport(1, 2, 3, 1, 0.1))
    assert not trace.on and list(tmp_path.iterdir()) == []


def test_phases_per_bucket_and_totals(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "trace"))
    trace = Trace("receiver")
    for _ in range(3):
        trace.next_bucket()
        trace.mark("copy")
        trace.mark("write")
        trace.mark("write")  # a phase marked twice in a bucket adds up
    trace.write(7, SyncReport(4, 10, 100, 3, 0.5), handles="driver")
    (path,) = (tmp_path / "trace").iterdir()
    assert path.name.startswith("sync-7-receiver-")
    data = json.loads(path.read_text())
    assert (data["version"], data["num_buckets"], len(data["buckets"]), data["handles"]) == (4, 3, 3, "driver")
    assert set(data["totals"]) == {"copy", "write"}
    assert data["totals"]["write"] == pytest.approx(sum(b["write"] for b in data["buckets"]))
