"""``TransportConformance``: what a weight transport's sync leaves in the receiving engine, for any transport.

A transport's test module combines the mixin with a class-scoped ``transport_run`` fixture that runs
:data:`TRANSPORT_SYNCS` in order over one group (rank 0 the sender, ranks 1.. replicas each holding a real
engine with a :class:`LoadProbe`) and returns what every rank saw (the format is ``transport_run``'s
docstring). The tests then check each sync: bit-for-bit arrival, one cache flush and one version change per
sync, failures mid-sync leaving the engine refusing under its old version, checksums, and recovery.

Importable without torch; the probe imports nothing either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest

__all__ = ["TRANSPORT_SYNCS", "LoadProbe", "TransportConformance"]

TRANSPORT_SYNCS: list[dict[str, Any]] = [
    {"weights": "B", "version": 5},
    {"weights": "B", "version": 9, "bad": True},  # a stream the sender's checks refuse
    {"weights": "A", "version": 6, "corrupt": 1},  # bucket 1 corrupted on the way (checksum)
    {"weights": "B", "version": 10, "nan_bucket": 2},  # bucket 2 holds a NaN: the replicas' check_finite fails
    {"weights": "A", "version": 7},  # a whole sync after the failures
    {"weights": None, "version": 8},  # no bucket: a relabel
]
"""The syncs ``transport_run`` runs, in order: weights "A"/"B" (or None: an empty sync), the version, and the
fault to inject. Receivers receive with ``check_finite=True``."""


class LoadProbe:
    """Instrumentation of one real engine (an ``EngineBase``): counts its cache flushes (``_finish_weights``) and
    notes the ``weight_version`` in force at each bucket write (``_apply_weights``); both still do their work."""

    def __init__(self, engine: Any) -> None:
        self.flushes = 0
        self.versions_at_writes: list[int] = []
        finish: Callable[[Any], None] = engine._finish_weights
        apply: Callable[[Any, Any], None] = engine._apply_weights

        def counting_finish(session: Any) -> None:
            self.flushes += 1
            finish(session)

        def recording_apply(bucket: Any, session: Any) -> None:
            self.versions_at_writes.append(engine.weight_version)
            apply(bucket, session)

        engine._finish_weights = counting_finish
        engine._apply_weights = recording_apply

    def take(self) -> dict[str, Any]:
        """What happened since the last ``take``: ``flushes``, ``writes`` (buckets written) and
        ``versions_at_writes`` (the distinct versions seen while writing)."""
        out = {
            "flushes": self.flushes,
            "writes": len(self.versions_at_writes),
            "versions_at_writes": sorted(set(self.versions_at_writes)),
        }
        self.flushes, self.versions_at_writes = 0, []
        return out


def _error(row: dict[str, Any], name: str) -> str:
    assert "error" in row and name in row["mro"], row
    return str(row["message"])


class TransportConformance:
    """The tests; a subclass provides ``transport_run``."""

    replica_ranks: ClassVar[tuple[int, ...]] = (1, 2)

    @pytest.fixture(scope="class")
    @classmethod
    def transport_run(cls) -> dict[str, Any]:
        """``{"sender": [row per sync], "replicas": {rank: {"before": obs, "join": None, "syncs": [row per sync]}},
        "plan": the layout of weights "A" at the group's bucket size, "expected": {"A": obs, "B": obs}}``.

        A sender row is ``{"report": [version, tensors, bytes, buckets]}`` or an error row (``error``,
        ``message``, ``mro``); a replica row the same plus ``after`` (``observe``: ``version``, ``digests`` of
        every parameter, and ``outputs`` or ``refused``, the message of a refused generate) and ``probe``
        (:meth:`LoadProbe.take` for that sync). ``expected`` is an engine loaded directly with each set.
        """
        raise NotImplementedError("a transport's test class runs TRANSPORT_SYNCS and returns what each rank saw")

    def _rows(self, run: dict[str, Any], i: int) -> list[dict[str, Any]]:
        return [run["replicas"][rank]["syncs"][i] for rank in self.replica_ranks]

    def test_a_multi_bucket_sync_reaches_every_replica_bit_for_bit(self, transport_run: dict[str, Any]) -> None:
        run, expected = transport_run, transport_run["expected"]
        sent = run["sender"][0]
        assert "report" in sent, sent
        assert sent["report"][0] == 5 and sent["report"][3] == len(run["plan"].buckets) > 2
        for rank in self.replica_ranks:
            replica = run["replicas"][rank]
            assert replica["join"] is None, replica["join"]
            row = replica["syncs"][0]
            assert row.get("report") == sent["report"], (rank, row)
            after = row["after"]
            assert after["version"] == 5
            # bf16 and fp32, views and non-contiguous tensors: every parameter as a direct load leaves it...
            assert after["digests"] == expected["B"]["digests"], rank
            # ...so the engine generates exactly what the directly loaded engine does (tokens and logprobs).
            assert [o[:2] for o in after["outputs"]] == [o[:2] for o in expected["B"]["outputs"]], rank
            assert all(tuple(map(tuple, o[2])) == ((0, 5),) for o in after["outputs"]), after["outputs"][0][2]
            assert after["outputs"] != replica["before"]["outputs"]  # the sync changed something

    def test_one_cache_flush_and_one_version_change_per_sync(self, transport_run: dict[str, Any]) -> None:
        """Every bucket is written under the old version and only the commit flushes and relabels: a sync of
        many buckets is one load, not one ``load_weights`` (a check, a flush, a version) per bucket."""
        buckets = transport_run["sender"][0]["report"][3]
        assert buckets > 2
        for row in self._rows(transport_run, 0):
            assert row["probe"] == {"flushes": 1, "writes": buckets, "versions_at_writes": [0]}, row["probe"]
            assert row["after"]["version"] == 5
        for row in self._rows(transport_run, 4):  # a later whole sync: the same, from version 5
            assert row["probe"]["flushes"] == 1 and row["probe"]["versions_at_writes"] == [5], row["probe"]

    def test_a_refused_stream_fails_every_rank_at_once_and_changes_nothing(self, transport_run: dict[str, Any]) -> None:
        message = _error(transport_run["sender"][1], "WeightLoadError")
        assert "int32" in message
        for rank in self.replica_ranks:
            before, row = transport_run["replicas"][rank]["syncs"][0:2]
            assert "the sender refused this sync" in _error(row, "TransportError") and "int32" in row["message"]
            assert row["seconds"] < 5  # at once, not after the timeout
            assert row["after"]["version"] == 5 and row["after"]["digests"] == before["after"]["digests"]
            assert row["probe"] == {"flushes": 0, "writes": 0, "versions_at_writes": []}
            assert "outputs" in row["after"], row["after"]  # nothing was written: it still serves

    def test_a_corrupted_bucket_is_reported_and_the_engine_refuses_under_its_old_version(
        self, transport_run: dict[str, Any]
    ) -> None:
        plan, expected = transport_run["plan"], transport_run["expected"]
        corrupted = [e.name for e in plan.buckets[1].entries]
        clean = [e.name for e in plan.buckets[0].entries]
        message = _error(transport_run["sender"][2], "TransportError")
        for rank in self.replica_ranks:
            assert f"rank {rank}: checksum mismatch at bucket 1" in message, message
            before, row = transport_run["replicas"][rank]["syncs"][1:3]
            text = _error(row, "ChecksumError")
            assert "bucket 1" in text and all(repr(n) in text for n in corrupted), text
            digests, old = row["after"]["digests"], before["after"]["digests"]
            assert all(digests[n] == old[n] != expected["A"]["digests"][n] for n in corrupted), rank
            assert all(digests[n] == expected["A"]["digests"][n] for n in clean), rank  # bucket 0 did land
            assert row["after"]["version"] == 5  # the version moves only with a whole sync
            assert "incomplete weights" in row["after"]["refused"], row["after"]  # never a mix
            assert row["probe"] == {"flushes": 0, "writes": 1, "versions_at_writes": [5]}, row["probe"]

    def test_a_bucket_failing_to_load_mid_sync_leaves_the_engine_refusing(self, transport_run: dict[str, Any]) -> None:
        """Bucket 2 holds a NaN and the replicas load with ``check_finite``: buckets 0 and 1 are written, then the
        load fails; the session is aborted (no flush, no version) and the engine refuses until a whole sync."""
        nan_name = transport_run["plan"].buckets[2].entries[0].name
        message = _error(transport_run["sender"][3], "TransportError")
        for rank in self.replica_ranks:
            assert f"rank {rank}: its engine failed to load it at bucket 2" in message, message
            row = transport_run["replicas"][rank]["syncs"][3]
            text = _error(row, "WeightLoadError")
            assert nan_name in text and "NaN or infinite" in text, text
            assert row["after"]["version"] == 5
            refused = row["after"]["refused"]
            assert "incomplete weights" in refused and "load session failed after writing" in refused, refused
            assert row["probe"] == {"flushes": 0, "writes": 2, "versions_at_writes": [5]}, row["probe"]

    def test_a_whole_sync_after_failed_ones_lands(self, transport_run: dict[str, Any]) -> None:
        expected = transport_run["expected"]
        assert transport_run["sender"][4]["report"][0] == 7
        for row in self._rows(transport_run, 4):
            after = row["after"]
            assert after["version"] == 7 and after["digests"] == expected["A"]["digests"]
            assert [o[:2] for o in after["outputs"]] == [o[:2] for o in expected["A"]["outputs"]]

    def test_an_empty_sync_with_a_version_relabels_every_replica(self, transport_run: dict[str, Any]) -> None:
        """``send([], version=8)``: no bucket and no flush, yet every replica's label moves to 8."""
        expected = transport_run["expected"]
        assert transport_run["sender"][5]["report"] == [8, 0, 0, 0]
        for row in self._rows(transport_run, 5):
            assert row["report"] == [8, 0, 0, 0]
            after = row["after"]
            assert after["version"] == 8 and after["digests"] == expected["A"]["digests"]
            assert all(tuple(map(tuple, o[2])) == ((0, 8),) for o in after["outputs"]), after["outputs"][0][2]
            assert row["probe"] == {"flushes": 0, "writes": 0, "versions_at_writes": []}
