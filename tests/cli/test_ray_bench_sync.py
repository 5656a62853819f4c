"""``genengine bench --sync --pool`` on a real local Ray cluster (the Ray files' one cluster): the in-process
engine's syncs and the same syncs through a pool of two replicas over gloo, split into the same five phases
from both ends' traces."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")

from genengine.cli import main
from genengine.cli.bench.sync import PHASES


def test_bench_sync_pool_splits_each_sync_into_the_five_phases(cluster: Any, tmp_path: Path) -> None:
    buf = io.StringIO()
    args = ["bench", "--sync", "--pool", "--syncs", "3", "--in-flight", "2", "--max-new-tokens", "4"]
    args += ["--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png")]
    with contextlib.redirect_stdout(buf):
        assert main(args) == 0
    report = json.loads((tmp_path / "s.json").read_text())
    pool, details = report["targets"]["pool"], report["pool"]
    assert (details["transport"], details["replicas"]) == ("gloo", 2)
    assert pool["requests_finished"] == "6/6"  # in flight through the pool during each sync, finished after it
    for phase in PHASES:  # every phase measured, in every sync
        assert len(pool["phases"][phase]["all"]) == 3 and min(pool["phases"][phase]["all"]) > 0, phase
        assert pool["phases"][phase]["min"] <= pool["phases"][phase]["median"] <= pool["phases"][phase]["max"]
    for i, whole in enumerate(pool["whole"]["all"]):  # the phases add up to the sync timed end to end
        summed = sum(pool["phases"][p]["all"][i] for p in PHASES)
        assert summed == pytest.approx(whole, rel=0.05, abs=0.002), (i, summed, whole)
    # The two sides, each from its own trace: a replica's load and transfer make up the pool's call, and the
    # trace phases a side recorded fit inside that call (they are this sync's, not another's).
    trainer, replica = details["sides"]["trainer"], details["sides"]["replica"]
    for phase in PHASES:
        assert min(trainer["phases"][phase]["all"]) > 0, phase
    assert all(replica["phases"][p] is None for p in ("pause", "gather", "resume"))
    for side, name in ((trainer, "sender"), (replica, "receiver")):
        assert {"transfer", "load"} >= set(details["trace_phase_map"][name].values())
        for i, call in enumerate(pool["call"]["all"]):
            traced = sum(v["all"][i] for k, v in side["trace"].items() if k != "untraced")
            assert 0 < traced <= call * 1.02 + 0.001, (name, i, traced, call)
            split = side["phases"]["transfer"]["all"][i] + side["phases"]["load"]["all"][i]
            assert split == pytest.approx(call, abs=1e-6)
    loads = {k for k, v in details["trace_phase_map"]["receiver"].items() if v == "load"}
    assert {"session", "write", "commit"} <= loads
    out = buf.getvalue()
    assert "pool: trainer" in out and "pool: replica" in out
    png = tmp_path / "s.png"
    assert png.read_bytes()[:4] == b"\x89PNG" or "matplotlib is missing" in out
