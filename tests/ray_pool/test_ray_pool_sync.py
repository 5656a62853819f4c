"""EnginePool weight sync over a gloo group (the NCCL path's code, on CPU) and the health of a pool that never
loaded weights, on a real local Ray cluster: the module's one pool of two replicas."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from support.ray_cluster import pool_actors, pool_placement_groups  # noqa: E402
from support.ray_pool import (  # noqa: E402
    GREEDY,
    PROMPTS,
    info,
    served_by_both,
    tokens,
)

from genengine.errors import GenEngineError, InvalidArgumentError, WeightLoadError, WeightsNotLoadedError  # noqa: E402
from genengine.ray import EnginePool, ReplicaDiedError, prefix_key  # noqa: E402
from genengine.testing.conformance import load_checkpoint  # noqa: E402


# ---- weight sync over a gloo group (the NCCL path's code, on CPU) ----------------------------------------------
def _reference(local: Any, weights: dict[str, Any], version: int) -> list[list[list[int]]]:
    local.load_weights(weights.items(), version=version)
    return tokens(local.generate(PROMPTS, GREEDY))


@pytest.fixture(scope="module")
def gloo(cluster: Any, model: str) -> Iterator[EnginePool]:
    """Two replicas syncing over ``transport="gloo"`` from the test process (rank 0), with buckets small enough
    that every sync is several (double-buffered) broadcasts: the one extra pool of the module. Its default
    ``request_retries=0`` and its first tests, before any sync, are the health tests of a pool that never
    loaded weights."""
    with EnginePool(
        backend="transformers",
        model=model,
        dtype="float32",
        num_replicas=2,
        num_gpus=0,
        num_cpus=0.25,
        transport="gloo",
        transport_options={"bucket_bytes": 1 << 20, "timeout_s": 60},
        timeout_s=120,
    ) as p:
        yield p
    mine = f"genengine-pool-{p._id}-"
    assert [n for n in pool_actors(cluster) + pool_placement_groups(cluster) if n.startswith(mine)] == []


def _new_process(name: str, old_pid: int) -> dict[str, Any]:
    """The actor's ``info`` once a process other than ``old_pid`` answers for it (Ray restarted it)."""
    actor = ray.get_actor(name)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(ray.exceptions.RayActorError):  # the old process dying, the new one starting
            info: dict[str, Any] = ray.get(actor.info.remote(), timeout=60)
            if info["pid"] != old_pid:
                return info
        time.sleep(0.05)
    raise AssertionError(f"{name}: no new process answered within 60 s")


def test_request_retries_0_a_replica_dying_in_generate_raises_and_comes_back_without_weights(
    gloo: EnginePool, local: Any, model: str, faults: Path
) -> None:
    """request_retries=0 means no retry: the replica whose process dies inside ``generate`` (the fault switch,
    so by construction during the call) makes it raise ReplicaDiedError naming it. check_health then brings it
    back, and since the pool never loaded weights there is nothing to wait for: it needs none and takes
    traffic again, serving the checkpoint as the other does."""
    want = _reference(local, load_checkpoint(model), 0)
    old = {r.index: r.pid for r in gloo.replicas}
    (faults / "die-in-generate").write_text("")
    with pytest.raises(
        ReplicaDiedError, match=r"replica (\d) \(actor [0-9a-f]+, node .*\) died during generate"
    ) as caught:
        gloo.generate(PROMPTS, GREEDY)
    assert not (faults / "die-in-generate").exists()  # claimed: that replica did die in the call
    died = int(re.search(r"replica (\d) \(actor", str(caught.value)).group(1))  # type: ignore[union-attr]
    assert gloo.replicas[died].status == "stale" and gloo.router.replicas == (1 - died,)
    infos = gloo.check_health()
    assert [(r.status, r.needs_weights) for r in infos] == [("healthy", False)] * 2
    assert infos[died].pid != old[died] and infos[1 - died].pid == old[1 - died]
    assert gloo.router.replicas == (0, 1) and gloo.weight_version == 0
    served_by_both(gloo, want, "after-death-in-generate")


def test_check_health_finds_a_restart_it_was_not_told_of(gloo: EnginePool, local: Any, model: str) -> None:
    """A replica's process is replaced behind the same actor and answers pings: check_health must see the new
    incarnation (not call the old replica healthy), start its engine and report the new process."""
    replica = gloo.replicas[0]
    ray.kill(ray.get_actor(replica.name), no_restart=False)
    fresh = _new_process(replica.name, replica.pid)
    assert not fresh["started"]  # a bare actor: Ray ran only __init__
    infos = gloo.check_health()
    assert infos[0].pid == fresh["pid"] and infos[0].status == "healthy" and not infos[0].needs_weights
    now = info(infos[0])
    assert now["started"] and now["incarnation"] == fresh["incarnation"] and now["state"].weights_loaded
    served_by_both(gloo, _reference(local, load_checkpoint(model), 0), "after-unseen-restart")


class TestGlooSync:
    """load_weights through the pool's gloo group: every replica, an empty sync, a restart, a corrupted bucket
    (in this order)."""

    def test_a_sync_reaches_every_replica(self, gloo: EnginePool, local: Any, other_weights: dict[str, Any]) -> None:
        disk = tokens(gloo.generate(PROMPTS, GREEDY))
        assert gloo.transport_group is None  # formed at the first sync
        gloo.sleep(1)
        gloo.wake(["weights"])
        report = gloo.load_weights(other_weights.items(), version=11)
        gloo.wake(["kv_cache"])
        assert report.num_tensors == len(other_weights) and report.num_buckets >= 3
        first = gloo.transport_group
        assert first is not None and first.startswith("genengine-pool-")
        assert [info(r)["weight_version"] for r in gloo.replicas] == [11, 11] and gloo.weight_version == 11
        got = gloo.generate(PROMPTS, GREEDY)
        want = _reference(local, other_weights, 11)
        assert tokens(got) == want != disk
        assert {o.weight_versions for r in got for o in r.outputs} == {((0, 11),)}
        assert sorted(gloo.router._keys[prefix_key(p)] for p in PROMPTS) == [0, 0, 1, 1]  # both replicas served
        # the group is kept between syncs; bad calls are refused before anything is sent
        gloo.load_weights(other_weights, version=12)
        assert gloo.transport_group == first and [info(r)["weight_version"] for r in gloo.replicas] == [12, 12]
        with pytest.raises(InvalidArgumentError, match=r"bucket_bytes=1024: with transport='gloo'"):
            gloo.load_weights(other_weights.items(), bucket_bytes=1024, version=13)
        assert gloo.weight_version == 12

    def test_an_empty_sync_with_a_version_relabels_every_replica(self, gloo: EnginePool) -> None:
        """``load_weights([], version=13)``: nothing to send, but the label moves on every replica (a trainer
        that skips an unchanged step still numbers it), and the outputs say so."""
        want = tokens(gloo.generate(PROMPTS, GREEDY))
        report = gloo.load_weights([], version=13)
        assert (report.num_tensors, report.num_bytes) == (0, 0)
        assert [info(r)["weight_version"] for r in gloo.replicas] == [13, 13] and gloo.weight_version == 13
        got = gloo.generate(PROMPTS, GREEDY)
        assert tokens(got) == want and {o.weight_versions for r in got for o in r.outputs} == {((0, 13),)}

    def test_a_killed_replica_rejoins_a_new_group_with_the_right_weights(
        self, gloo: EnginePool, local: Any, other_weights: dict[str, Any], model: str
    ) -> None:
        """Replica 1 is killed after a sync and restarted by Ray; the next sync notices it (without a
        check_health first), the restored replica gets the weights from the registered source (object store),
        and the group is formed again under a new name, so that the sync after reaches both replicas."""
        weights = load_checkpoint(model)  # the checkpoint's weights, synced last to change every output back
        gloo.set_weights_source(lambda: other_weights.items())  # what the restored replica must be refitted with
        before = gloo.transport_group
        old_pid = info(gloo.replicas[1])["pid"]
        ray.kill(ray.get_actor(gloo.replicas[1].name), no_restart=False)
        # ray.kill returns before the process is gone: a ping the old process still answers keeps the old group,
        # and the sync then waits the group's 60 s timeout for the dead rank (one run of this test took 72 s)
        _new_process(gloo.replicas[1].name, old_pid)
        gloo.load_weights(other_weights.items(), version=14)
        gloo.check_health()
        infos = [info(r) for r in gloo.replicas]
        assert infos[1]["pid"] != old_pid and [i["weight_version"] for i in infos] == [14, 14]
        assert [r.status for r in gloo.replicas] == ["healthy", "healthy"]
        assert tokens(gloo.generate(PROMPTS, GREEDY)) == _reference(local, other_weights, 14)
        gloo.set_weights_source(None)
        gloo.load_weights(weights.items(), version=15)  # back to the disk weights, through the new group
        assert gloo.transport_group not in (None, before)
        assert [info(r)["weight_version"] for r in gloo.replicas] == [15, 15]
        assert tokens(gloo.generate(PROMPTS, GREEDY)) == _reference(local, weights, 15)

    def test_a_corrupted_bucket_names_the_replicas_and_changes_nothing(
        self, gloo: EnginePool, local: Any, other_weights: dict[str, Any], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from genengine.transport import ChecksumError, faults

        version, group = gloo.weight_version, gloo.transport_group
        want = tokens(gloo.generate(PROMPTS, GREEDY))
        monkeypatch.setattr(faults.FAULTS, "corrupt_bucket", 0)  # the sender's (this) process: bucket 0 corrupted
        with pytest.raises(ChecksumError) as caught:
            gloo.load_weights(other_weights.items(), version=16)
        message = str(caught.value)
        for index, rank in ((0, 1), (1, 2)):
            assert re.search(rf"replica {index} \(actor [0-9a-f]+, node [^)]*\) \(rank {rank}\)", message), message
        assert "rank 1: checksum mismatch at bucket 0" in message and f"weight version stays {version}" in message
        assert [info(r)["weight_version"] for r in gloo.replicas] == [version] * 2 and gloo.weight_version == version
        assert tokens(gloo.generate(PROMPTS, GREEDY)) == want  # nothing of the sync was loaded anywhere
        # a later bucket: the earlier ones landed, so both replicas are a mix and are kept out of traffic
        monkeypatch.setattr(faults.FAULTS, "corrupt_bucket", 1)
        with pytest.raises(ChecksumError, match=r"loaded part of the sync and take no traffic"):
            gloo.load_weights(other_weights.items(), version=17)
        assert [r.needs_weights for r in gloo.replicas] == [True, True] and gloo.weight_version == version
        with pytest.raises(WeightsNotLoadedError, match=r"no replica takes traffic: replica 0 \(actor"):
            gloo.generate(PROMPTS, GREEDY)
        monkeypatch.setattr(faults.FAULTS, "corrupt_bucket", None)
        gloo.load_weights(other_weights.items(), version=18)  # the group survived both: same name
        assert gloo.transport_group == group and [r.needs_weights for r in gloo.replicas] == [False, False]
        assert [info(r)["weight_version"] for r in gloo.replicas] == [18, 18]
        assert tokens(gloo.generate(PROMPTS, GREEDY)) == _reference(local, other_weights, 18)


# ---- what a sync must never lose (issue 40: B2, B3, B6) --------------------------------------------------------
def test_transport_options_win_over_the_pools_defaults(model: str) -> None:
    """The pool's defaults for its groups (checksums on, its own ``timeout_s``) give way to the user's
    ``transport_options`` (EnginePool's real defaults; nothing is started)."""
    import inspect

    from genengine.ray.options import PoolOptions

    empty = inspect.Parameter.empty
    defaults = {
        n: p.default
        for n, p in inspect.signature(EnginePool.__init__).parameters.items()
        if p.default is not empty and n not in ("config", "max_imbalance")
    }

    def merged(**kw: Any) -> dict[str, Any]:
        args = {**defaults, "num_gpus": 0, "transport": "gloo", **kw}
        return dict(PoolOptions.check(None, {"backend": "transformers", "model": model}, **args).transport_options)

    assert merged(transport_options={"timeout_s": 900, "checksum": False}) == {"timeout_s": 900, "checksum": False}
    assert merged() == {"timeout_s": defaults["timeout_s"], "checksum": True}
    assert merged(timeout_s=120, transport_options={"bucket_bytes": 4096}) == {
        "timeout_s": 120,
        "checksum": True,
        "bucket_bytes": 4096,
    }


def test_the_weight_sync_group_is_formed_with_the_users_transport_options(gloo: EnginePool) -> None:
    """The group the replicas joined: the fixture's ``timeout_s=60`` and ``bucket_bytes``, not the pool's
    ``timeout_s=120``; ``checksum`` not given, so the pool's default (on)."""
    gloo.load_weights([], version=gloo.weight_version)  # forms the group if no sync did yet
    spec = gloo._sync._sender.group.spec
    assert (spec.timeout_s, spec.bucket_bytes, spec.checksum) == (60, 1 << 20, True), spec


def test_a_non_finite_tensor_is_refused_for_every_replica_and_changes_none(
    gloo: EnginePool, other_weights: dict[str, Any]
) -> None:
    """``load_weights(check_finite=True)`` through the group with a NaN in the sync's last tensor (its last
    bucket): refused, and no replica changes weights or version; both keep serving, whole. (Checked by each
    replica bucket by bucket, the buckets before the NaN would have been written everywhere, leaving every
    replica refusing to serve until the next whole sync.)"""
    version = gloo.weight_version
    want = tokens(gloo.generate(PROMPTS, GREEDY))
    poisoned = dict(other_weights)
    last = list(poisoned)[-1]
    poisoned[last] = poisoned[last].clone()
    poisoned[last].view(-1)[poisoned[last].numel() // 2] = float("nan")
    with pytest.raises(WeightLoadError, match=rf"weight {re.escape(repr(last))} holds NaN or infinite") as caught:
        gloo.load_weights(poisoned.items(), version=version + 1, check_finite=True)
    assert f"weight version stays {version}" in str(caught.value), caught.value
    infos = [info(r) for r in gloo.replicas]
    assert [i["weight_version"] for i in infos] == [version] * 2 and gloo.weight_version == version
    assert all(i["state"].weights_loaded for i in infos), infos
    assert [r.needs_weights for r in gloo.replicas] == [False, False] and gloo.router.replicas == (0, 1)
    served_by_both(gloo, want, "after-a-refused-nan")


def test_a_replica_lost_mid_sync_of_a_generator_raises_and_moves_no_version(
    gloo: EnginePool, local: Any, model: str, faults: Path
) -> None:
    """A trainer's stream read once (a generator, as ``model.named_parameters()`` is) and a replica whose process
    dies writing a bucket in the middle of the sync: the stream cannot be sent again to the survivor, so
    ``load_weights`` raises, and the pool's weight version stays; no replica serves part of the sync (one that
    took traffic serves the old weights, or the new ones whole), and it raises at once, not at the group's
    timeout. A later whole sync reaches both."""
    version = gloo.weight_version
    old = tokens(gloo.generate(PROMPTS, GREEDY))
    disk = load_checkpoint(model)
    names = list(disk)
    (faults / "die-weight").write_text(names[len(names) // 2])  # in a middle bucket of the sync

    def named_parameters() -> Iterator[tuple[str, Any]]:
        yield from disk.items()

    start = time.monotonic()
    with pytest.raises(GenEngineError) as caught:
        gloo.load_weights(named_parameters(), version=version + 1)
    # at once, not at the group's 60 s timeout (the survivor waited it out to report to a sender that had failed)
    assert time.monotonic() - start < 30, caught.value
    assert not (faults / "die-weight").exists()  # claimed: a replica did die in the sync
    assert f"the pool's weight version stays {version}" in str(caught.value), caught.value
    assert gloo.weight_version == version
    new = _reference(local, disk, version + 1)
    try:
        got = tokens(gloo.generate(PROMPTS, GREEDY, session_id=[f"lost-mid-sync-{i}" for i in range(len(PROMPTS))]))
    except WeightsNotLoadedError:
        got = None  # nothing takes traffic until a whole sync
    assert got is None or got in (old, new), got
    gloo.check_health()
    gloo.load_weights(list(disk.items()), version=version + 2)
    assert [info(r)["weight_version"] for r in gloo.replicas] == [version + 2] * 2
    assert gloo.weight_version == version + 2 and gloo.router.replicas == (0, 1)
    served_by_both(gloo, _reference(local, disk, version + 2), "after-a-replica-lost-mid-sync")
