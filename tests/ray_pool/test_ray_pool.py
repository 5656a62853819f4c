"""EnginePool on a real local Ray cluster (2 CPUs), embedded replicas on the tiny random model: one pool of
two separate replicas for the module (starting replicas costs seconds each), read by most tests and killed
last. What any engine must do is checked on a pool by tests/ray_pool/test_ray_conformance.py; this file checks what
is the pool's own: options, routing over replicas, every replica reached, failures and restarts; and TRL's async
worker (genengine.integrations.trl_async) over the same pool, before its weights change. The gloo group is
tests/ray_pool/test_ray_pool_sync.py's, the colocated placements tests/ray_pool/test_ray_colocated.py's.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from support.ray_cluster import ROOT, pool_actors, pool_leftovers, pool_placement_groups  # noqa: E402
from support.ray_pool import (  # noqa: E402
    GREEDY,
    PROMPTS,
    SEEDED,
    info,
    served_by_both,
    tokens,
)
from support.trl_async_checks import assert_groups_tagged_with_their_oldest_weights  # noqa: E402

from genengine import GenerationEngine, GenerationResult, SamplingParams  # noqa: E402
from genengine.cli.demos.sync import TRL_PROMPTS  # noqa: E402
from genengine.errors import (  # noqa: E402
    BackendNotFoundError,
    ConfigError,
    EngineSleepingError,
    WeightLoadError,
)
from genengine.ray import EnginePool, ReplicaDiedError, ReplicaError, ReplicaTimeoutError, prefix_key  # noqa: E402
from genengine.testing.conformance import load_checkpoint  # noqa: E402


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
    assert pool_leftovers(cluster) == ([], [])


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
    deadline = time.monotonic() + 60  # ray.kill returns before the cluster lists the actor as dead
    while (pool_actors(cluster), pool_placement_groups(cluster)) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (pool_actors(cluster), pool_placement_groups(cluster)) == before


# ---- the protocol through the pool ----------------------------------------------------------------------------
def test_pool_is_an_engine_and_replicas_run_this_checkout(pool: EnginePool) -> None:
    assert isinstance(pool, GenerationEngine)
    assert pool.supports_async and pool.supported_tags == ("weights", "kv_cache")
    infos = [info(r) for r in pool.replicas]
    assert [i["genengine_file"] for i in infos] == [str(ROOT / "genengine" / "__init__.py")] * 2
    assert len({i["pid"] for i in infos}) == 2


def test_generate_matches_one_in_process_engine(pool: EnginePool, local: Any) -> None:
    for params in (GREEDY, SEEDED):
        got, want = pool.generate(PROMPTS, params), local.generate(PROMPTS, params)
        assert tokens(got) == tokens(want)
        for g, w in zip(got, want, strict=True):
            assert g.prompt_token_ids == w.prompt_token_ids
            for go, wo in zip(g.outputs, w.outputs, strict=True):
                assert go.logprobs == pytest.approx(wo.logprobs, abs=1e-5)
                assert (go.text, go.finish_reason) == (wo.text, wo.finish_reason)


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


def test_streams_with_n_leave_no_load_and_keep_their_prefix_home(pool: EnginePool) -> None:
    """Streams of ``n > 1`` through the pool, ended every way a caller ends one: read to the end, closed
    early, aborted by id and left unread, all aborted at once, and a ``collect`` cancelled by a timeout. After
    each, every replica's load is 0 again (a load left behind would push the prompt's prefix off the replica
    whose cache holds it, past ``max_imbalance``), and the prefix still goes to its replica."""
    prompt = PROMPTS[1]
    short = SamplingParams(temperature=1.0, max_new_tokens=6, n=3, seed=5)
    long = SamplingParams(temperature=1.0, max_new_tokens=960, ignore_eos=True, n=3, seed=5)  # cut short each time

    async def idle(what: str) -> None:
        # a stream's end reaches the router as the replica reports it: give it a moment, not a test's length
        deadline = time.monotonic() + 10
        while [r.load for r in pool.replicas] != [0, 0] and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert [r.load for r in pool.replicas] == [0, 0], what

    async def streams() -> int:
        first = pool.stream(prompt, short)
        home = first.replica_index
        assert home is not None and pool.replicas[home].load == 3  # n samples count as n units of work
        assert len((await first.collect()).outputs) == 3
        await idle("read to the end")
        closed = pool.stream(prompt, long)
        assert closed.replica_index == home
        await closed.__anext__()
        await closed.aclose()
        await idle("closed early")
        aborted = pool.stream(prompt, long)
        await aborted.__anext__()  # on the engine: the abort reaches it
        assert await pool.abort(aborted.request_id) == [aborted.request_id]
        await idle("aborted by id, never read again")
        several = [pool.stream(prompt, long, session_id=f"n-{i}") for i in range(3)]
        for s in several:
            await s.__anext__()
        assert sorted(await pool.abort()) == sorted(s.request_id for s in several)
        await idle("all aborted, never read again")
        cancelled = pool.stream(prompt, long)
        await cancelled.__anext__()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(cancelled.collect(), 0.05)
        await idle("collect cancelled")
        return home

    hits, moved = pool.router.stats.hits, pool.router.stats.moved
    home = asyncio.run(streams())
    assert pool.in_flight == 0
    pool.generate([prompt], GREEDY)
    assert pool.router._keys[prefix_key(prompt)] == home
    assert pool.router.stats.moved == moved and pool.router.stats.hits > hits
    assert [r.load for r in pool.replicas] == [0, 0]


# ---- TRL's async worker over the pool (genengine.integrations.trl_async) ------------------------------------------
class Counted:
    """A pool stream whose chunks the test counts as the worker reads them: a request that has yielded tokens and
    not ended is one a pause holds mid-generation."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.chunks = 0
        self.ended = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    async def __aiter__(self) -> Any:
        async for chunk in self.stream:
            self.chunks += 1
            yield chunk
        self.ended = True


def wait_for(worker: Any, what: Callable[[], Any], cap_s: float = 180.0) -> None:
    """Until ``what()`` holds, failing at once if the worker's loop failed or its engine made no token for 60 s
    (``check_health``): no fixed time for the wait itself, which a loaded 2-core run stretched past 60 s while
    the replicas were still generating. ``cap_s`` only bounds a wait that makes tokens and never gets there (each
    wait here is for a few 48-token requests: seconds on an idle machine)."""
    deadline = time.monotonic() + cap_s
    while not what():
        worker.check_health(stale_after_s=60)
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {cap_s}s (the engine making tokens) for {what}")
        time.sleep(0.05)


def test_trl_async_a_sync_carries_pool_rollouts_over_to_the_new_weights(
    pool: EnginePool, model: str, other_weights: dict[str, Any]
) -> None:
    """TRL's async rollout worker and weight transfer (genengine.integrations.trl_async) over the pool: the same
    calls as on one engine, with the pool's streams, pause and load spread over two replicas. A sync with samples
    in flight carries them over to the new weights on every replica, each queued sample tagged with the oldest
    version of its tokens. (On the module's pool, not one of its own: two replica starts less; the pool still
    serves the checkpoint at version 0 here, and the next test loads its own weights and version.)"""
    if find_spec("trl") is None:
        pytest.skip("trl is not installed: pip install -e '.[trl]'")
    import transformers

    from genengine.integrations.trl_async import GenEngineRolloutWorker, GenEngineWeightTransfer

    streams: dict[str, Counted] = {}
    real_stream = pool.stream

    def stream(*args: Any, **kwargs: Any) -> Any:  # the pool's stream, kept to read its weight versions after
        streams[kwargs["request_id"]] = Counted(real_stream(*args, **kwargs))
        return streams[kwargs["request_id"]]

    def mid_generation() -> bool:  # a request with tokens of the old weights and more to come
        return any(s.chunks and not s.ended for s in list(streams.values()))

    pool.stream = stream  # type: ignore[method-assign]
    worker = GenEngineRolloutWorker(
        pool,
        dataset=[{"prompt": p} for p in TRL_PROMPTS],
        reward_funcs=[lambda completion_ids, **_: [float(len(c)) for c in completion_ids]],
        tokenizer=transformers.AutoTokenizer.from_pretrained(model),
        sampling=SamplingParams(n=2, max_new_tokens=48, logprobs=True, ignore_eos=True),
        max_inflight=4,
        max_staleness=1,
    )
    transfer = GenEngineWeightTransfer(pool, worker=worker)
    try:
        transfer.init_weight_transfer()
        worker.start()
        # Rolling (a group queued), and a request mid-generation for the pause to hold: the two groups in flight
        # at first end together, and a pause that lands just after holds only requests with no token yet.
        for _ in range(5):
            wait_for(worker, lambda: worker.rollout_buffer.qsize() >= 2 and mid_generation())
            transfer.pause()
            time.sleep(0.2)  # a request that ended just before the pause has its end delivered
            if mid_generation():
                break
            transfer.resume()  # it held only requests with no token yet: again
        else:
            raise AssertionError("five pauses in a row held no request mid-generation")
        assert pool.paused == "keep" and pool.in_flight > 0
        transfer.send_weights(iter(other_weights.items()))
        transfer.resume()
        worker.update_model_version(1)
        assert pool.weight_version == 1 and transfer.versions == [1]
        mixed = "rollout/mixed_version_samples_total"
        wait_for(worker, lambda: any(m.get(mixed) for m in list(worker.metrics_queue.queue)))  # the held finished
        wait_for(worker, lambda: any(s.model_version == 1 for s in list(worker.rollout_buffer.queue)))
        worker.check_health(stale_after_s=30)
    finally:
        worker.stop()
        del pool.stream
    assert_groups_tagged_with_their_oldest_weights(list(worker.rollout_buffer.queue), streams)
    assert pool.in_flight == 0, "stop() aborted the worker's requests on every replica"


def test_control_calls_reach_every_replica(pool: EnginePool, local: Any, other_weights: dict[str, Any]) -> None:
    pool.sleep(1)
    assert all(info(r)["state"].released_tags == {"weights", "kv_cache"} for r in pool.replicas)
    with pytest.raises(EngineSleepingError, match="the pool is asleep"):
        pool.generate(PROMPTS, GREEDY)
    pool.wake(["weights"])
    report = pool.load_weights(other_weights.items(), version=3)
    assert report.num_tensors == len(other_weights)
    pool.wake(["kv_cache"])
    infos = [info(r) for r in pool.replicas]
    assert [i["weight_version"] for i in infos] == [3, 3] and pool.weight_version == 3
    assert all(not i["state"].released_tags for i in infos)
    local.load_weights(other_weights.items(), version=3)
    got = pool.generate(PROMPTS, GREEDY)
    assert tokens(got) == tokens(local.generate(PROMPTS, GREEDY))
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
        infos = [info(r) for r in pool.replicas]
        assert not infos[bad]["state"].weights_loaded and infos[good]["weight_version"] == 9
        local.load_weights(first.items(), version=9)
        got = pool.generate(PROMPTS, GREEDY)
        assert tokens(got) == tokens(local.generate(PROMPTS, GREEDY))
        assert {o.weight_versions for r in got for o in r.outputs} == {((0, 9),)}
    finally:  # the module's pool goes on with the weights the later tests expect
        pool.load_weights(other_weights.items(), version=before)
        local.load_weights(other_weights.items(), version=before)
    assert sorted(pool.router.replicas) == [0, 1]
    assert [info(r)["weight_version"] for r in pool.replicas] == [before, before]
    assert tokens(pool.generate(PROMPTS, GREEDY)) == tokens(local.generate(PROMPTS, GREEDY))


def test_a_refused_load_that_wrote_nothing_leaves_every_replica_serving(pool: EnginePool, local: Any) -> None:
    """An unknown name is refused by every replica's engine before it writes anything: the error is the
    engine's own type, names the weight, and says nothing of a partial write; no replica leaves traffic."""
    import torch

    before = pool.weight_version
    want = tokens(local.generate(PROMPTS, GREEDY))
    with pytest.raises(WeightLoadError, match=r"replica \d \(actor .*unknown weight 'no\.such\.weight'") as caught:
        pool.load_weights([("no.such.weight", torch.zeros(4))], version=before + 1)
    message = str(caught.value)
    assert "wrote part" not in message and f"weight version stays {before}" in message, message
    assert pool.weight_version == before and pool.router.replicas == (0, 1)
    assert [(r.status, r.needs_weights) for r in pool.replicas] == [("healthy", False)] * 2
    assert [info(r)["weight_version"] for r in pool.replicas] == [before] * 2
    served_by_both(pool, want, "after-refused-load")


# ---- health ----------------------------------------------------------------------------------------------------
def test_a_killed_replica_comes_back_with_the_current_weights(
    pool: EnginePool, local: Any, faults: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The in-flight sync caller gets the retry it asked for (request_retries=1) when a replica's process dies
    inside ``generate`` (the fault switch: by construction during the call); a stream that already had tokens
    gets ReplicaDiedError when its replica is killed; each time the replica is restarted, refilled
    (keep_weights) with the pool's current weights and routed to again."""
    version = pool.weight_version
    old = {r.pid: r.index for r in pool.replicas}
    earlier = set(faults.glob("claimed-die-in-generate-by-*"))  # the cluster's other files use the switch too
    (faults / "die-in-generate").write_text("")
    with caplog.at_level(logging.WARNING, logger="genengine.ray.pool"):
        got = pool.generate(PROMPTS, GREEDY)  # retried on the other replica
    (claimed,) = set(faults.glob("claimed-die-in-generate-by-*")) - earlier
    died = old[int(claimed.name.rsplit("-", 1)[1])]
    assert tokens(got) == tokens(local.generate(PROMPTS, GREEDY))
    # Marked stale (no traffic until restored). Ray may have restarted the actor before the retried generate
    # returned, and the pool restored it then (seen on a 2-core run): stale, or healthy with the log saying so.
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"replica {died} (actor") and "it takes no traffic until it is restored" in m for m in said)
    restored = any(m.startswith(f"replica {died} (actor") and " restored: " in m for m in said)
    assert pool.replicas[died].status == ("healthy" if restored else "stale"), said
    pool.check_health()
    now = info(pool.replicas[died])
    assert now["pid"] not in old and now["weight_version"] == version and pool.replicas[died].status == "healthy"
    served_by_both(pool, tokens(local.generate(PROMPTS, GREEDY)), "after-death-in-generate")
    long = SamplingParams(temperature=0, max_new_tokens=300, ignore_eos=True)  # killed after its first chunk

    async def stream_through_a_kill() -> None:
        stream = pool.stream(PROMPTS[0], long, session_id="s")
        index = stream.replica_index
        assert index is not None
        await stream.__anext__()
        ray.kill(ray.get_actor(pool.replicas[index].name), no_restart=False)
        with pytest.raises(ReplicaDiedError, match=rf"replica {index} \(actor [0-9a-f]+, node .* died during stream"):
            async for _ in stream:
                pass

    asyncio.run(stream_through_a_kill())
    assert [r.status for r in pool.check_health()] == ["healthy", "healthy"]
    assert [info(r)["weight_version"] for r in pool.replicas] == [version, version]
    assert tokens(pool.generate(PROMPTS, GREEDY)) == tokens(local.generate(PROMPTS, GREEDY))


def test_a_replica_restarted_while_paused_comes_back_paused(pool: EnginePool, other_weights: dict[str, Any]) -> None:
    """``restart_replica`` during a ``keep`` pause: the replica is restored paused, so the requests routed to
    it queue (they do not run on the weights it was refilled with); the next ``load_weights`` reaches it, and
    ``resume_generation`` starts its queued requests on that load's version."""
    restarted = 0
    old_pid = pool.replicas[restarted].pid
    version = pool.weight_version + 1
    params = SamplingParams(temperature=0, max_new_tokens=6)

    async def paused_restart() -> None:
        await pool.pause_generation("keep")
        try:
            pool.restart_replica(restarted)
            pool.check_health()
            assert pool.replicas[restarted].pid != old_pid and pool.paused == "keep"
            streams = [pool.stream(p, params, session_id=f"paused-{i}") for i, p in enumerate(PROMPTS[:2])]
            assert sorted(s.replica_index for s in streams) == [0, 1]  # least-loaded: one on each
            tasks = [asyncio.ensure_future(s.collect()) for s in streams]
            await asyncio.sleep(1.0)
            assert not any(t.done() for t in tasks) and pool.in_flight == 2  # queued on both replicas
            await asyncio.to_thread(pool.load_weights, other_weights.items(), version=version)
            assert [info(r)["weight_version"] for r in pool.replicas] == [version, version]
        finally:
            await pool.resume_generation()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert {o.weight_versions for r in results for o in r.outputs} == {((0, version),)}

    asyncio.run(paused_restart())
    assert pool.paused is None and pool.weight_version == version and pool.in_flight == 0
    assert [(r.status, r.load) for r in pool.replicas] == [("healthy", 0)] * 2


def test_a_control_call_that_times_out_names_the_replica(pool: EnginePool) -> None:
    """The flush waits behind a generate that holds each replica for seconds (sixteen 300-token rows a
    replica: ~3 s on an idle 2-core machine; 900 tokens made the test wait ~10 s more for no more checked) and
    gives up after 0.2 s. A flush that got to a replica before the generate did returns at once: it is sent
    again until one waits behind it."""
    long = SamplingParams(temperature=0, max_new_tokens=300, ignore_eos=True)
    busy = threading.Thread(target=pool.generate, args=(PROMPTS * 8, long))
    busy.start()
    try:
        while sum(r.load for r in pool.replicas) == 0:
            time.sleep(0.02)
        pool.timeout_s = 0.2
        with pytest.raises(ReplicaTimeoutError, match=r"replica \d \(actor [0-9a-f]+, node .*\): flush_cache did not"):
            while busy.is_alive():
                pool.flush_cache()
                time.sleep(0.05)
        held = busy.is_alive()  # the flush gave up while the generate still held a replica
    finally:
        pool.timeout_s = 300
        busy.join()
    assert held, "the generate had ended when the flush gave up: nothing held it"


def test_an_answer_from_the_killed_incarnation_does_not_restore_the_replica(pool: EnginePool) -> None:
    """``restart_replica``'s kill lands a moment after the call returns. What the old incarnation answers in that
    window must not restore the replica: the refill sent to it would die with it (CI saw "ActorUnavailableError:
    The actor was restarted" from the refill). The window is held open here by not sending the kill yet."""
    import ray

    replica = pool._fleet.replicas[1]
    old = replica.incarnation
    pool._fleet.mark_killed(replica)  # what restart_replica does before its kill
    life = pool._life
    life.recover(wait=False)  # asks the replica who it is
    ray.wait([life._pending[replica]], timeout=60)
    life.recover(wait=False)  # the answer is there: the old incarnation's
    assert replica.status == "stale" and replica.incarnation == old
    replica.kill(restart=True)  # the kill lands: the new incarnation restores it
    pool.check_health()
    assert replica.status == "healthy" and replica.incarnation != old and replica.killed is None
    assert [r.status for r in pool.replicas] == ["healthy", "healthy"]


def test_a_pause_given_up_before_it_reached_the_replicas_pauses_none(pool: EnginePool) -> None:
    """``wait_for(pause_generation(...), t)`` giving up while the pool's worker thread has not sent the pause yet
    (CI's loaded machine: the conformance suite's 0.2 s pause timed out so) must not send it later: replicas paused
    behind the pool's back keep every later request waiting. The window is held open here by holding the fleet's
    lock, which the worker thread takes before it sends anything."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with pool._fleet.lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)

    async def main() -> GenerationResult:
        try:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(pool.pause_generation("keep"), 0.2)
        finally:
            release.set()
        assert pool.paused is None
        await asyncio.to_thread(holder.join, 10)
        await asyncio.sleep(1.0)  # the worker thread goes on now that the lock is free
        return await asyncio.wait_for(pool.generate_async(PROMPTS[0], GREEDY), 30)

    try:
        result = asyncio.run(main())
    finally:
        asyncio.run(pool.resume_generation())  # on a failure, the next tests find the replicas serving
    assert result.outputs[0].token_ids


def test_a_replica_dead_for_good_is_left_out_and_the_retry_reaches_the_others(
    pool: EnginePool, local: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Ray will not restart it (``no_restart=True``). The generate that finds it dead sends its prompts to the
    healthy replica (request_retries=1) and returns, as does the next one; check_health reports it dead;
    control calls raise until remove_replica takes it out. The module pool's last test: it leaves no replica up."""
    want = tokens(local.generate(PROMPTS, GREEDY))
    pool.generate(PROMPTS, GREEDY)
    dead = pool.router._keys[prefix_key(PROMPTS[0])]  # the first prompt goes there again (sticky)
    alive = 1 - dead
    ray.kill(ray.get_actor(pool.replicas[dead].name), no_restart=True)
    with caplog.at_level(logging.WARNING, logger="genengine.ray.pool"):
        assert tokens(pool.generate(PROMPTS, GREEDY)) == want
    retried = [r.getMessage() for r in caplog.records if "to another replica" in r.getMessage()]
    assert len(retried) == 1 and retried[0].startswith(f"replica {dead} (actor"), retried  # it was sent there
    assert tokens(pool.generate(PROMPTS, GREEDY)) == want
    assert [(r.index, r.status) for r in pool.check_health()] == sorted([(dead, "dead"), (alive, "healthy")])
    with pytest.raises(ReplicaDiedError, match=rf"replica {dead} \(actor .*is dead and .*remove_replica\({dead}\)"):
        pool.flush_cache()
    pool.remove_replica(dead)
    pool.flush_cache()
    assert [r.index for r in pool.replicas] == [alive] and pool.router.replicas == (alive,)
    assert tokens(pool.generate(PROMPTS, GREEDY)) == want
    # the last one dead too: nowhere to retry, and the error says which replica and what to do
    ray.kill(ray.get_actor(pool.replicas[0].name), no_restart=True)
    with pytest.raises(ReplicaDiedError, match=rf"replica {alive} \(actor .*is dead and .*remove_replica\({alive}\)"):
        pool.generate(PROMPTS, GREEDY)
