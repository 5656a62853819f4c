"""EnginePool on a real local Ray cluster (2 CPUs), embedded replicas on the tiny random model.

One cluster and one pool of two separate replicas for the module (starting replicas costs seconds each); the
colocated pool runs inside a trainer actor, as a real colocated trainer would own it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from support.ray_cluster import ROOT, local_cluster, pool_actors, pool_placement_groups  # noqa: E402

from genengine import GenerationEngine, SamplingParams, create_engine  # noqa: E402
from genengine.errors import (  # noqa: E402
    BackendNotFoundError,
    ConfigError,
    EngineSleepingError,
    InvalidArgumentError,
    WeightLoadError,
    WeightsNotLoadedError,
)
from genengine.ray import EnginePool, ReplicaDiedError, ReplicaError, ReplicaTimeoutError, prefix_key  # noqa: E402
from genengine.testing.conformance import load_checkpoint  # noqa: E402
from genengine.testing.tiny_model import tiny_model_dir  # noqa: E402

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello", "my name is"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, logprobs=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=7, logprobs=True, n=2)


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the replicas' fault switch (support/ray_faults.py)."""
    return tmp_path_factory.mktemp("ray-faults")


@pytest.fixture(scope="module")
def cluster(faults: Path) -> Iterator[Any]:
    with local_cluster(num_cpus=2, faults_dir=str(faults)) as handle:
        yield handle


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model_dir())


@pytest.fixture(scope="module")
def other_weights() -> dict[str, Any]:
    """A second random model with the same shapes and tokenizer: what a trainer would sync."""
    return load_checkpoint(tiny_model_dir(seed=1))


@pytest.fixture(scope="module")
def local(model: str) -> Iterator[Any]:
    with create_engine(backend="transformers", model=model, dtype="float32") as engine:
        yield engine


@pytest.fixture(scope="module")
def pool(cluster: Any, model: str) -> Iterator[EnginePool]:
    with EnginePool(
        backend="transformers",
        model=model,
        dtype="float32",
        num_replicas=2,
        num_gpus=0,
        num_cpus=0.25,
        keep_weights=True,
        request_retries=1,
    ) as p:
        yield p
    assert pool_actors(cluster) == [] and pool_placement_groups(cluster) == []


def _info(replica: Any) -> dict[str, Any]:
    return ray.get(ray.get_actor(replica.name).info.remote(), timeout=60)  # type: ignore[no-any-return]


def _tokens(results: Any) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in results]


def _served_by_both(pool: EnginePool, want: list[list[list[int]]], tag: str) -> None:
    """``PROMPTS`` under fresh session keys (least-loaded routing spreads them over every routed replica):
    ``want`` comes back, and replicas 0 and 1 both did some of the work."""
    work = dict(pool.router.stats.work)
    got = pool.generate(PROMPTS, GREEDY, session_id=[f"{tag}-{i}" for i in range(len(PROMPTS))])
    assert _tokens(got) == want
    assert all(pool.router.stats.work.get(i, 0) > work.get(i, 0) for i in (0, 1)), (work, pool.router.stats.work)


# ---- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_replicas": 0}, ConfigError, "num_replicas=0"),
        ({"placement": "colocatd"}, ConfigError, "did you mean 'colocated'"),
        ({"placement": "colocated"}, ConfigError, "needs placement_group="),
        ({"bundle_indices": [0]}, ConfigError, "placement='colocated'"),
        ({"backend": "nope"}, BackendNotFoundError, "unknown backend 'nope'"),
        ({"tp_size": 2}, ConfigError, "tp_size=2"),
        ({"num_gpus": -1}, ConfigError, "num_gpus=-1"),
        ({"num_gpus": 1.5}, ConfigError, "num_gpus=1.5"),
        ({"timeout_s": 0}, ConfigError, "timeout_s=0"),
        ({"request_retries": -1}, ConfigError, "request_retries=-1"),
        ({"model": None}, ConfigError, "needs a model"),
        ({"dtype": "fp8"}, ConfigError, "dtype='fp8'"),
        ({"weights_source": 3}, ConfigError, "weights_source=3"),
        ({"transport": "glo"}, Exception, "glo"),
        ({"transport": "gloo", "keep_weights": True}, ConfigError, "keep_weights=True"),
        ({"transport_options": {"checksum": True}}, ConfigError, "needs transport="),
        ({"transport": "gloo", "transport_options": {"bucket_byte": 1}}, ConfigError, "did you mean 'bucket_bytes'"),
        ({"transport": "gloo", "transport_options": {"bucket_bytes": 0}}, ConfigError, "bucket_bytes=0"),
    ],
)
def test_bad_input_is_refused_before_any_actor(
    cluster: Any, model: str, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    before = (pool_actors(cluster), pool_placement_groups(cluster))
    args = {"backend": "transformers", "model": model, "num_gpus": 0, "num_cpus": 0.25, **kwargs}
    with pytest.raises(error, match=message.replace("(", r"\(").replace("[", r"\[")):
        EnginePool(**args)
    assert (pool_actors(cluster), pool_placement_groups(cluster)) == before


def test_a_bad_backend_option_names_the_replica_and_leaves_nothing(cluster: Any, model: str) -> None:
    """Backend options are the backend's to check, inside the replica: its own error, named, then cleaned up."""
    before = (pool_actors(cluster), pool_placement_groups(cluster))
    with pytest.raises(ConfigError, match=r"replica 0 \(actor [0-9a-f]+, node .*: start: .*did you mean 'device'"):
        EnginePool(backend="transformers", model=model, devcie="cpu", num_gpus=0, num_cpus=0.1)
    assert (pool_actors(cluster), pool_placement_groups(cluster)) == before


# ---- the protocol through the pool ----------------------------------------------------------------------------
def test_pool_is_an_engine_and_replicas_run_this_checkout(pool: EnginePool) -> None:
    assert isinstance(pool, GenerationEngine)
    assert pool.supports_async and pool.supported_tags == ("weights", "kv_cache")
    infos = [_info(r) for r in pool.replicas]
    assert [i["genengine_file"] for i in infos] == [str(ROOT / "genengine" / "__init__.py")] * 2
    assert len({i["pid"] for i in infos}) == 2


def test_generate_matches_one_in_process_engine(pool: EnginePool, local: Any) -> None:
    for params in (GREEDY, SEEDED):
        got, want = pool.generate(PROMPTS, params), local.generate(PROMPTS, params)
        assert _tokens(got) == _tokens(want)
        for g, w in zip(got, want, strict=True):
            assert g.prompt_token_ids == w.prompt_token_ids
            for go, wo in zip(g.outputs, w.outputs, strict=True):
                assert go.logprobs == pytest.approx(wo.logprobs, abs=1e-5)
                assert (go.text, go.finish_reason) == (wo.text, wo.finish_reason)
    ids = [r.prompt_token_ids for r in local.generate(PROMPTS, GREEDY)]
    assert _tokens(pool.generate(prompt_token_ids=ids, sampling_params=GREEDY)) == _tokens(
        local.generate(prompt_token_ids=ids, sampling_params=GREEDY)
    )


def test_routing_is_sticky_and_balanced(pool: EnginePool) -> None:
    hits = pool.router.stats.hits
    # four distinct prompts spread over both replicas; each prompt again goes where it went first
    keys = [prefix_key(p) for p in PROMPTS]
    seen = []
    for _ in range(3):
        pool.generate(PROMPTS, GREEDY)
        seen.append([pool.router._keys[k] for k in keys])
    assert seen[0] == seen[1] == seen[2]
    assert sorted(seen[0]) == [0, 0, 1, 1]
    assert pool.router.stats.hits - hits >= 8
    # one session goes to one replica, whatever the prompts
    pool.generate(PROMPTS, GREEDY, session_id="conversation-1")
    assert list(pool.router._keys).count("conversation-1") == 1
    assert [r.load for r in pool.replicas] == [0, 0]


def test_control_calls_reach_every_replica(pool: EnginePool, local: Any, other_weights: dict[str, Any]) -> None:
    pool.sleep(1)
    assert all(_info(r)["state"].released_tags == {"weights", "kv_cache"} for r in pool.replicas)
    with pytest.raises(EngineSleepingError, match="the pool is asleep"):
        pool.generate(PROMPTS, GREEDY)
    pool.wake(["weights"])
    report = pool.load_weights(other_weights.items(), version=3)
    assert report.num_tensors == len(other_weights)
    pool.wake(["kv_cache"])
    infos = [_info(r) for r in pool.replicas]
    assert [i["weight_version"] for i in infos] == [3, 3] and pool.weight_version == 3
    assert all(not i["state"].released_tags for i in infos)
    local.load_weights(other_weights.items(), version=3)
    got = pool.generate(PROMPTS, GREEDY)
    assert _tokens(got) == _tokens(local.generate(PROMPTS, GREEDY))
    assert {o.weight_versions for r in got for o in r.outputs} == {((0, 3),)}
    pool.flush_cache()


def test_a_load_that_fails_mid_write_takes_that_replica_out_of_traffic(
    pool: EnginePool, local: Any, model: str, other_weights: dict[str, Any], faults: Path
) -> None:
    """Through the object store: one replica's engine fails after writing some buckets (the fault switch),
    the other loads. The error names the one that failed; the pool's version stays; that replica holds a mix,
    so it takes no traffic while the other serves the new weights; a whole load brings it back."""
    first, before = load_checkpoint(model), pool.weight_version
    (faults / "fail-weight").write_text(list(first)[-1])
    with pytest.raises(
        ReplicaError,
        match=r"load_weights failed on 1 of 2 replica\(s\); ReplicaError: replica (\d) \(actor .*injected fault.*"
        rf"weight version stays {before}; replica\(s\) \1 wrote part of the weights and take no traffic",
    ) as caught:
        pool.load_weights(first.items(), bucket_bytes=1 << 14, version=9)
    bad = int(re.search(r"replica (\d) \(actor", str(caught.value)).group(1))  # type: ignore[union-attr]
    good = 1 - bad
    try:
        assert not (faults / "fail-weight").exists()
        assert pool.weight_version == before and pool.router.replicas == (good,)
        infos = [_info(r) for r in pool.replicas]
        assert not infos[bad]["state"].weights_loaded and infos[good]["weight_version"] == 9
        local.load_weights(first.items(), version=9)
        got = pool.generate(PROMPTS, GREEDY)
        assert _tokens(got) == _tokens(local.generate(PROMPTS, GREEDY))
        assert {o.weight_versions for r in got for o in r.outputs} == {((0, 9),)}
    finally:  # the module's pool goes on with the weights the later tests expect
        pool.load_weights(other_weights.items(), version=before)
        local.load_weights(other_weights.items(), version=before)
    assert sorted(pool.router.replicas) == [0, 1]
    assert [_info(r)["weight_version"] for r in pool.replicas] == [before, before]
    assert _tokens(pool.generate(PROMPTS, GREEDY)) == _tokens(local.generate(PROMPTS, GREEDY))


def test_a_refused_load_that_wrote_nothing_leaves_every_replica_serving(pool: EnginePool, local: Any) -> None:
    """An unknown name is refused by every replica's engine before it writes anything: the error is the
    engine's own type, names the weight, and says nothing of a partial write; no replica leaves traffic."""
    import torch

    before = pool.weight_version
    want = _tokens(local.generate(PROMPTS, GREEDY))
    with pytest.raises(WeightLoadError, match=r"replica \d \(actor .*unknown weight 'no\.such\.weight'") as caught:
        pool.load_weights([("no.such.weight", torch.zeros(4))], version=before + 1)
    message = str(caught.value)
    assert "wrote part" not in message and f"weight version stays {before}" in message, message
    assert pool.weight_version == before and pool.router.replicas == (0, 1)
    assert [(r.status, r.needs_weights) for r in pool.replicas] == [("healthy", False)] * 2
    assert [_info(r)["weight_version"] for r in pool.replicas] == [before] * 2
    _served_by_both(pool, want, "after-refused-load")


def test_async_stream_pause_keep_and_abort(pool: EnginePool, local: Any, other_weights: dict[str, Any]) -> None:
    long = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True, logprobs=True)

    async def run() -> Any:
        stream = pool.stream(PROMPTS[0], GREEDY)
        chunks = [c async for c in stream]
        result = stream.result()
        assert [t for c in chunks for t in c.token_ids] == result.outputs[0].token_ids
        assert chunks[-1].finish_reason == result.outputs[0].finish_reason
        want = await local.generate_async(PROMPTS[0], GREEDY)
        assert result.outputs[0].token_ids == want.outputs[0].token_ids
        # keep: a sample in flight goes on with the new weights, labelled with both versions
        before = pool.weight_version
        stream = pool.stream(PROMPTS[1], SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True))
        first = await stream.__anext__()  # tokens from the old weights exist
        await pool.pause_generation("keep")
        assert pool.paused == "keep"
        queued = pool.stream(PROMPTS[3], GREEDY)  # waits for the resume: it runs on version 4 only
        pool.load_weights(other_weights.items(), version=4)
        await pool.resume_generation()
        kept = (await stream.collect()).outputs[0]
        assert len(kept.token_ids) == 400 and kept.token_ids[: len(first.token_ids)] == first.token_ids
        (start, old), (switch, new) = kept.weight_versions
        assert (start, old, new) == (0, before, 4) and 0 < switch < 400
        assert {c.weight_version for c in [c async for c in queued]} == {4}
        assert queued.result().outputs[0].weight_versions == ((0, 4),)
        # abort keeps the tokens produced so far
        stream = pool.stream(PROMPTS[2], long, request_id="to-abort")
        first = await stream.__anext__()
        assert await pool.abort("to-abort") == ["to-abort"]
        await stream.aclose()
        aborted = stream.result().outputs[0]
        assert aborted.finish_reason == "abort" and aborted.token_ids[: len(first.token_ids)] == first.token_ids
        # a resume while asleep raises and the pool stays paused
        await pool.pause_generation("abort")
        pool.sleep(1)
        try:
            with pytest.raises(EngineSleepingError, match="asleep"):
                await pool.resume_generation()
            assert pool.paused == "abort"
        finally:
            pool.wake()
        await pool.resume_generation()
        assert pool.paused is None
        return queued.result()

    queued = asyncio.run(run())
    local.load_weights(other_weights.items(), version=4)
    assert _tokens([queued]) == _tokens(local.generate(PROMPTS[3:], GREEDY))


# ---- health ----------------------------------------------------------------------------------------------------
def _kill_when_busy(pool: EnginePool, index: int) -> None:
    deadline = time.monotonic() + 60
    while pool.replicas[index].load == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    ray.kill(ray.get_actor(pool.replicas[index].name), no_restart=False)


def test_a_killed_replica_comes_back_with_the_current_weights(pool: EnginePool, local: Any) -> None:
    """The in-flight sync caller gets the retry it asked for (request_retries=1); a stream that already had
    tokens gets ReplicaDiedError; the replica is restarted, refilled (keep_weights) and routed to again."""
    long = SamplingParams(temperature=0, max_new_tokens=300, ignore_eos=True)  # seconds on 2 cores: the kill lands
    old_pid = _info(pool.replicas[0])["pid"]
    killer = threading.Thread(target=_kill_when_busy, args=(pool, 0))
    killer.start()
    got = pool.generate(PROMPTS, long)  # retried on the other replica
    killer.join()
    assert _tokens(got) == _tokens(local.generate(PROMPTS, long))
    pool.check_health()
    info = _info(pool.replicas[0])
    assert info["pid"] != old_pid and info["weight_version"] == 4 and pool.replicas[0].status == "healthy"
    assert _tokens(pool.generate(PROMPTS, GREEDY)) == _tokens(local.generate(PROMPTS, GREEDY))

    async def stream_through_a_kill() -> None:
        stream = pool.stream(PROMPTS[0], long, session_id="s")
        index = stream.replica_index
        await stream.__anext__()
        ray.kill(ray.get_actor(pool.replicas[index].name), no_restart=False)
        with pytest.raises(ReplicaDiedError, match=rf"replica {index} \(actor [0-9a-f]+, node .* died during stream"):
            async for _ in stream:
                pass

    asyncio.run(stream_through_a_kill())
    assert pool.check_health()[0].status == "healthy" and pool.replicas[1].status == "healthy"
    assert [_info(r)["weight_version"] for r in pool.replicas] == [4, 4]
    assert _tokens(pool.generate(PROMPTS, GREEDY)) == _tokens(local.generate(PROMPTS, GREEDY))


def test_a_control_call_that_times_out_names_the_replica(pool: EnginePool) -> None:
    long = SamplingParams(temperature=0, max_new_tokens=600, ignore_eos=True)
    busy = threading.Thread(target=pool.generate, args=(PROMPTS, long))
    busy.start()
    try:
        while sum(r.load for r in pool.replicas) == 0:
            time.sleep(0.02)
        time.sleep(0.5)  # routed is not running yet: let the replicas start generating (it takes seconds)
        pool.timeout_s = 0.5
        with pytest.raises(ReplicaTimeoutError, match=r"replica \d \(actor [0-9a-f]+, node .*\): flush_cache did not"):
            pool.flush_cache()
    finally:
        pool.timeout_s = 300
        busy.join()


def test_a_replica_dead_for_good_is_left_out_and_the_retry_reaches_the_others(
    pool: EnginePool, local: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Ray will not restart it (``no_restart=True``). The generate that finds it dead sends its prompts to the
    healthy replica (request_retries=1) and returns, as does the next one; check_health reports it dead;
    control calls raise until remove_replica takes it out. The module pool's last test: it leaves no replica up."""
    want = _tokens(local.generate(PROMPTS, GREEDY))
    pool.generate(PROMPTS, GREEDY)
    dead = pool.router._keys[prefix_key(PROMPTS[0])]  # the first prompt goes there again (sticky)
    alive = 1 - dead
    ray.kill(ray.get_actor(pool.replicas[dead].name), no_restart=True)
    with caplog.at_level(logging.WARNING, logger="genengine.ray.pool"):
        assert _tokens(pool.generate(PROMPTS, GREEDY)) == want
    retried = [r.getMessage() for r in caplog.records if "to another replica" in r.getMessage()]
    assert len(retried) == 1 and retried[0].startswith(f"replica {dead} (actor"), retried  # it was sent there
    assert _tokens(pool.generate(PROMPTS, GREEDY)) == want
    assert [(r.index, r.status) for r in pool.check_health()] == sorted([(dead, "dead"), (alive, "healthy")])
    with pytest.raises(ReplicaDiedError, match=rf"replica {dead} \(actor .*is dead and .*remove_replica\({dead}\)"):
        pool.flush_cache()
    pool.remove_replica(dead)
    pool.flush_cache()
    assert [r.index for r in pool.replicas] == [alive] and pool.router.replicas == (alive,)
    assert _tokens(pool.generate(PROMPTS, GREEDY)) == want
    # the last one dead too: nowhere to retry, and the error says which replica and what to do
    ray.kill(ray.get_actor(pool.replicas[0].name), no_restart=True)
    with pytest.raises(ReplicaDiedError, match=rf"replica {alive} \(actor .*is dead and .*remove_replica\({alive}\)"):
        pool.generate(PROMPTS, GREEDY)


# ---- colocated ------------------------------------------------------------------------------------------------
def test_pool_bench_compares_a_colocated_replica_with_the_same_engine_in_process(cluster: Any, model: str) -> None:
    """``genengine bench --pool`` on the CPU (gloo): both engines measured side by side, and after each sync the
    replica's greedy outputs equal the in-process engine's on the same new weights."""
    from genengine.bench.pool import PoolBenchSettings, format_pool_report, run_pool_bench

    report = run_pool_bench(
        PoolBenchSettings(
            model=model,
            dtype="float32",
            batch_size=4,
            prompt_len=8,
            max_new_tokens=8,
            repeats=1,
            min_seconds=0.05,
            syncs=2,
            num_cpus=0.25,
            sleep=False,
        )
    )
    assert report["transport"] == "gloo"
    rows = report["sync"]["rows"]
    assert [r["version"] for r in rows] == [1, 2]
    assert all(r["outputs_equal"] and r["changed"] and r["labels_ok"] for r in rows), rows
    medians = report["tokens_per_s"]["median"]
    assert medians["pool"] > 0 and medians["in_process"] > 0
    assert report["ratio"] == medians["pool"] / medians["in_process"]
    assert "pool / in-process" in format_pool_report(report)


def test_colocated_pool_in_a_trainer_actor(cluster: Any, model: str, local: Any, other_weights: dict[str, Any]) -> None:
    """The trainer actor and the replicas share the bundles of one placement group (fractional CPUs here,
    fractional GPUs on a GPU node); the trainer owns the pool and runs an RL step through it, its weights
    broadcast from the trainer actor's process over a gloo group (the NCCL path's code, on CPU)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from support.ray_trainer import ColocatedTrainer

    pg = placement_group([{"CPU": 0.3}, {"CPU": 0.3}], strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    trainer = (
        ray.remote(ColocatedTrainer)
        .options(num_cpus=0.1, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0))
        .remote(model, pg, 0.2, "gloo")
    )
    try:
        weights_dir = str(tiny_model_dir(seed=1))
        out = ray.get(trainer.step.remote(PROMPTS, weights_dir, 9), timeout=300)
    finally:
        ray.get(trainer.shutdown.remote(), timeout=120)
        ray.kill(trainer)
        remove_placement_group(pg)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    assert out["replica_bundles"] == [0, 1] and out["trainer_pg"] == pg.id
    assert out["asleep"] == ["kv_cache", "weights"] and out["replica_versions"] == [9, 9]
    assert str(out["transport_group"]).startswith("genengine-pool-") and out["sync"][0] == len(other_weights)
    assert out["trainer_pid"] not in out["replica_pids"]
    with create_engine(backend="transformers", model=model, dtype="float32") as fresh:
        assert out["before"] == [r.outputs[0].token_ids for r in fresh.generate(PROMPTS, params)]
    local.load_weights(other_weights.items())
    assert out["after"] == [r.outputs[0].token_ids for r in local.generate(PROMPTS, params)]
    assert set(out["after_versions"]) == {((0, 9),)}


# ---- weight sync over a gloo group (the NCCL path's code, on CPU) ----------------------------------------------
def _reference(local: Any, weights: dict[str, Any], version: int) -> list[list[list[int]]]:
    local.load_weights(weights.items(), version=version)
    return _tokens(local.generate(PROMPTS, GREEDY))


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
    _served_by_both(gloo, want, "after-death-in-generate")


def test_check_health_finds_a_restart_it_was_not_told_of(gloo: EnginePool, local: Any, model: str) -> None:
    """A replica's process is replaced behind the same actor and answers pings: check_health must see the new
    incarnation (not call the old replica healthy), start its engine and report the new process."""
    replica = gloo.replicas[0]
    ray.kill(ray.get_actor(replica.name), no_restart=False)
    fresh = _new_process(replica.name, replica.pid)
    assert not fresh["started"]  # a bare actor: Ray ran only __init__
    infos = gloo.check_health()
    assert infos[0].pid == fresh["pid"] and infos[0].status == "healthy" and not infos[0].needs_weights
    now = _info(infos[0])
    assert now["started"] and now["incarnation"] == fresh["incarnation"] and now["state"].weights_loaded
    _served_by_both(gloo, _reference(local, load_checkpoint(model), 0), "after-unseen-restart")


class TestGlooSync:
    """load_weights through the pool's gloo group: every replica, an empty sync, a restart, a corrupted bucket
    (in this order)."""

    def test_a_sync_reaches_every_replica(self, gloo: EnginePool, local: Any, other_weights: dict[str, Any]) -> None:
        disk = _tokens(gloo.generate(PROMPTS, GREEDY))
        assert gloo.transport_group is None  # formed at the first sync
        gloo.sleep(1)
        gloo.wake(["weights"])
        report = gloo.load_weights(other_weights.items(), version=11)
        gloo.wake(["kv_cache"])
        assert report.num_tensors == len(other_weights) and report.num_buckets >= 3
        first = gloo.transport_group
        assert first is not None and first.startswith("genengine-pool-")
        assert [_info(r)["weight_version"] for r in gloo.replicas] == [11, 11] and gloo.weight_version == 11
        got = gloo.generate(PROMPTS, GREEDY)
        want = _reference(local, other_weights, 11)
        assert _tokens(got) == want != disk
        assert {o.weight_versions for r in got for o in r.outputs} == {((0, 11),)}
        assert sorted(gloo.router._keys[prefix_key(p)] for p in PROMPTS) == [0, 0, 1, 1]  # both replicas served
        # the group is kept between syncs; bad calls are refused before anything is sent
        gloo.load_weights(other_weights, version=12)
        assert gloo.transport_group == first and [_info(r)["weight_version"] for r in gloo.replicas] == [12, 12]
        with pytest.raises(InvalidArgumentError, match=r"bucket_bytes=1024: with transport='gloo'"):
            gloo.load_weights(other_weights.items(), bucket_bytes=1024, version=13)
        assert gloo.weight_version == 12

    def test_an_empty_sync_with_a_version_relabels_every_replica(self, gloo: EnginePool) -> None:
        """``load_weights([], version=13)``: nothing to send, but the label moves on every replica (a trainer
        that skips an unchanged step still numbers it), and the outputs say so."""
        want = _tokens(gloo.generate(PROMPTS, GREEDY))
        report = gloo.load_weights([], version=13)
        assert (report.num_tensors, report.num_bytes) == (0, 0)
        assert [_info(r)["weight_version"] for r in gloo.replicas] == [13, 13] and gloo.weight_version == 13
        got = gloo.generate(PROMPTS, GREEDY)
        assert _tokens(got) == want and {o.weight_versions for r in got for o in r.outputs} == {((0, 13),)}

    def test_a_killed_replica_rejoins_a_new_group_with_the_right_weights(
        self, gloo: EnginePool, local: Any, other_weights: dict[str, Any], model: str
    ) -> None:
        """Replica 1 is killed after a sync and restarted by Ray; the next sync notices it (without a
        check_health first), the restored replica gets the weights from the registered source (object store),
        and the group is formed again under a new name, so that the sync after reaches both replicas."""
        weights = load_checkpoint(model)  # the checkpoint's weights, synced last to change every output back
        gloo.set_weights_source(lambda: other_weights.items())  # what the restored replica must be refitted with
        before = gloo.transport_group
        old_pid = _info(gloo.replicas[1])["pid"]
        ray.kill(ray.get_actor(gloo.replicas[1].name), no_restart=False)
        gloo.load_weights(other_weights.items(), version=14)
        gloo.check_health()
        infos = [_info(r) for r in gloo.replicas]
        assert infos[1]["pid"] != old_pid and [i["weight_version"] for i in infos] == [14, 14]
        assert [r.status for r in gloo.replicas] == ["healthy", "healthy"]
        assert _tokens(gloo.generate(PROMPTS, GREEDY)) == _reference(local, other_weights, 14)
        gloo.set_weights_source(None)
        gloo.load_weights(weights.items(), version=15)  # back to the disk weights, through the new group
        assert gloo.transport_group not in (None, before)
        assert [_info(r)["weight_version"] for r in gloo.replicas] == [15, 15]
        assert _tokens(gloo.generate(PROMPTS, GREEDY)) == _reference(local, weights, 15)

    def test_a_corrupted_bucket_names_the_replicas_and_changes_nothing(
        self, gloo: EnginePool, local: Any, other_weights: dict[str, Any], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from genengine.transport import ChecksumError
        from genengine.transport._layout import CORRUPT_ENV

        version, group = gloo.weight_version, gloo.transport_group
        want = _tokens(gloo.generate(PROMPTS, GREEDY))
        monkeypatch.setenv(CORRUPT_ENV, "0")  # in the sender's (this) process: bucket 0 arrives corrupted
        with pytest.raises(ChecksumError) as info:
            gloo.load_weights(other_weights.items(), version=16)
        message = str(info.value)
        for index, rank in ((0, 1), (1, 2)):
            assert re.search(rf"replica {index} \(actor [0-9a-f]+, node [^)]*\) \(rank {rank}\)", message), message
        assert "rank 1: checksum mismatch at bucket 0" in message and f"weight version stays {version}" in message
        assert [_info(r)["weight_version"] for r in gloo.replicas] == [version] * 2 and gloo.weight_version == version
        assert _tokens(gloo.generate(PROMPTS, GREEDY)) == want  # nothing of the sync was loaded anywhere
        # a later bucket: the earlier ones landed, so both replicas are a mix and are kept out of traffic
        monkeypatch.setenv(CORRUPT_ENV, "1")
        with pytest.raises(ChecksumError, match=r"loaded part of the sync and take no traffic"):
            gloo.load_weights(other_weights.items(), version=17)
        assert [r.needs_weights for r in gloo.replicas] == [True, True] and gloo.weight_version == version
        with pytest.raises(WeightsNotLoadedError, match=r"no replica takes traffic: replica 0 \(actor"):
            gloo.generate(PROMPTS, GREEDY)
        monkeypatch.delenv(CORRUPT_ENV)
        gloo.load_weights(other_weights.items(), version=18)  # the group survived both: same name
        assert gloo.transport_group == group and [r.needs_weights for r in gloo.replicas] == [False, False]
        assert [_info(r)["weight_version"] for r in gloo.replicas] == [18, 18]
        assert _tokens(gloo.generate(PROMPTS, GREEDY)) == _reference(local, other_weights, 18)
