"""Faults in the middle of an RL step: half-way weight streams, and TP ranks that die or diverge.

1. Weights that fail half-way, on an engine that really writes buckets as they come: the conformance
   suite's half-way tests run on the embedded engine in streaming mode (``validate_all_weights_first =
   False``, as the GPU backends stream), so their refusal branch is exercised on CPU, not only on GPUs.
2. A TP group's helpers as the multi-process engines use them (``genengine_sglang.RLGenerationEngine``):
   consistency check before generate, the leader's work, its result broadcast to the group; each rank's
   weight handles gathered to the leader per bucket. One rank is SIGKILLed by this test while the call is
   under way, or diverges into another call; the others must fail within the configured timeout with an
   error naming the rank, never hang. Real gloo process groups in spawned processes, nothing mocked.

   Nothing here rests on how fast a loaded machine runs: the victim is killed while it is held at a point it
   reported from (inside the model's forward pass during generate, or stalled before a bucket), detection is
   timed from the kill, and no rank exits before the test has every rank's result, so a rank that failed
   first is never mistaken for a second death.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import pytest
from support.ports import free_port
from support.start import worker_context

from genengine.backends.transformers.engine import TransformersEngine
from genengine.protocol import GenerationEngine
from genengine.testing.conformance import EngineConformance

pytestmark = pytest.mark.timeout(180)

sys.path.insert(0, str(Path(__file__).resolve().parent))


# ---- 1. half-way weight streams on a streaming engine -------------------------------------------------------
class StreamingTransformersEngine(TransformersEngine):
    """The embedded engine writing each bucket as it is validated, as SGLang and vLLM do."""

    validate_all_weights_first = False


_HALF_WAY_TESTS = {
    "test_stream_failing_midway_never_serves_mixed_weights",
    "test_bad_entry_after_buckets_were_written_never_serves_mixed_weights",
    "test_failed_load_during_staged_wake_never_serves_mixed_weights",
    "test_full_load_after_a_failed_one_equals_a_fresh_engine",
}


class TestHalfWayFailuresOnAStreamingEngine(EngineConformance):
    """Only the suite's half-way tests (the whole suite runs in test_conformance_transformers, on the same
    default tiny models, which the session builds once)."""

    def make_engine(self, model_dir: str, **options: Any) -> GenerationEngine:
        return StreamingTransformersEngine(model_dir, dtype="float32", **options)


for _name in dir(EngineConformance):
    if _name.startswith("test_") and _name not in _HALF_WAY_TESTS:
        setattr(TestHalfWayFailuresOnAStreamingEngine, _name, None)  # pytest collects only callables


def test_streaming_engine_refuses_until_a_complete_load() -> None:
    """The state machine on its own: what the trainer sees after each step of a broken, then fixed, sync."""
    from genengine.errors import WeightsNotLoadedError
    from genengine.models.tiny_model import tiny_model_dir
    from genengine.testing.conformance import load_checkpoint

    model = tiny_model_dir()
    weights = list(load_checkpoint(model).items())
    with StreamingTransformersEngine(str(model), dtype="float32") as engine:

        def broken() -> Any:
            yield from weights[:5]
            raise OSError("trainer lost its NFS mount")

        with pytest.raises(OSError):
            engine.load_weights(broken(), bucket_bytes=1)
        state = engine.state
        assert not state.weights_loaded and not state.is_sleeping
        # Four of the five tensors were written: the fifth was still in the bucket being filled.
        with pytest.raises(WeightsNotLoadedError, match=r"failed after writing 4 weight\(s\).*OSError: trainer lost"):
            engine.generate(["hi"], {"max_new_tokens": 1})
        report = engine.load_weights(weights, bucket_bytes=1)
        assert report.num_buckets == len(weights) and engine.state.weights_loaded
        assert engine.generate(["hi"], {"max_new_tokens": 1})[0].outputs[0].token_ids


# ---- 2. TP ranks that die or diverge ------------------------------------------------------------------------
TIMEOUT_S = 60.0  # the group's configured timeout: a dead rank must be named well before it
DETECT_S = TIMEOUT_S / 3  # generous bound on kill -> error; a death noticed only at the timeout takes ~TIMEOUT_S
DIVERGED_TIMEOUT_S = 2.0
HOLD_S = 150.0  # how long a victim stays held where it reported from; the test kills it long before


@dataclass
class RankResult:
    rank: int
    status: str  # "ok", "err", "died" (killed by the test) or "hung"
    error_type: str = ""
    message: str = ""
    mro: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    value: Any = None
    #: ``time.monotonic()`` (one clock for all processes of the host) when the call ended on this rank; for a
    #: rank the test killed, when the kill was sent.
    ended_at: float = 0.0

    def raised(self, name: str) -> bool:
        return self.status == "err" and name in self.mro


def _rank_main(rank: int, world: int, port: int, scenario: str, kwargs: dict[str, Any], out: Any, release: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch.distributed as dist

    start = time.monotonic()
    try:
        dist.init_process_group("gloo")

        def at(label: str) -> None:
            out.send(("at", rank, label, os.getpid()))  # synchronous: in the pipe when this returns

        value = _SCENARIOS[scenario](rank, at, **kwargs)
        res = RankResult(rank, "ok", value=value)
    except BaseException as exc:
        res = RankResult(
            rank,
            "err",
            type(exc).__name__,
            str(exc),
            [c.__name__ for c in type(exc).__mro__],
            value=traceback.format_exc(),
        )
    res.ended_at = time.monotonic()
    res.elapsed = res.ended_at - _CALL_START.get("t", start)
    out.send(("done", rank, res, os.getpid()))
    out.close()
    # As a trainer still handling the error, stay until the test has every rank's result (it then closes the
    # release pipe): the rank the test killed stays the only dead one, whatever order the others report in.
    release.poll(HOLD_S)
    os._exit(0)  # a group with a dead member cannot be torn down cleanly; the process just leaves


_CALL_START: dict[str, float] = {}


def _start_call(at: Any, label: str) -> None:
    """Mark the start of the call under test (elapsed times count from here) and tell the test."""
    _CALL_START["t"] = time.monotonic()
    at(label)


def _generate_step(rank: int, at: Any, model: str, timeout_s: float) -> Any:
    """generate as RLGenerationEngine does it: check inputs, the leader generates, the result is broadcast."""
    from genengine.distributed import engine_group

    group = engine_group(2, check_port=False, timeout_s=timeout_s)
    engine = TransformersEngine(model, dtype="float32") if group.is_leader else None
    prompts = [f"the quick brown fox {i}" for i in range(8)]
    params = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}
    if engine is not None:
        forwards = [0]

        def inside_generate(module: Any, args: Any, kwargs: Any) -> None:
            # The third forward pass of generate (prefill, then decode steps): report from inside it, then stay
            # here, so the test's SIGKILL lands mid-generate whatever the machine's speed.
            forwards[0] += 1
            if forwards[0] == 3:
                at("leader generating")
                time.sleep(HOLD_S)

        engine.model.register_forward_pre_hook(inside_generate, with_kwargs=True)
    group.barrier()
    _start_call(at, "generate")
    group.check_consistent((prompts, params), what="generate inputs")
    payload = None
    if engine is not None:
        payload = ("ok", engine.generate(prompts, params))
        at("leader generated")
    _, results = group.broadcast_object(payload, op="generate")
    return len(results[0].outputs[0].token_ids)


def _load_weights_step(rank: int, at: Any, model: str, timeout_s: float, victim: int) -> Any:
    """load_weights as RLGenerationEngine does it: per bucket, every rank's tensors to the leader, which
    writes them and broadcasts the outcome. ``victim`` (a member) stalls before its third bucket and is killed."""
    from genengine.distributed import engine_group
    from genengine.testing.conformance import load_checkpoint

    group = engine_group(3, check_port=False, timeout_s=timeout_s)
    engine = TransformersEngine(model, dtype="float32") if group.is_leader else None
    buckets = [[item] for item in load_checkpoint(model).items()]
    group.barrier()
    _start_call(at, "load_weights")
    for i, bucket in enumerate(buckets):
        if rank == victim and i == 2:
            at("stalled")
            time.sleep(HOLD_S)  # held here until the test kills it
        gathered = group.gather_object(([n for n, _ in bucket], bucket))
        payload = None
        if engine is not None:
            assert gathered is not None
            engine.load_weights(gathered[0][1])
            payload = ("ok", i)
        group.broadcast_object(payload, op="load_weights")
    return len(buckets)


def _diverged_step(rank: int, at: Any, timeout_s: float) -> Any:
    """Rank 0 enters generate's input check; rank 1 took another branch and sends its weights instead."""
    from genengine.distributed import engine_group

    group = engine_group(2, check_port=False, timeout_s=timeout_s)
    group.barrier()
    _start_call(at, "diverged")
    if rank == 0:
        group.check_consistent((["prompt"], {"max_new_tokens": 4}), what="generate inputs")
    else:
        group.gather_object((["model.norm.weight"], "handle"))
    return "returned"


_SCENARIOS: dict[str, Callable[..., Any]] = {
    "generate": _generate_step,
    "load_weights": _load_weights_step,
    "diverged": _diverged_step,
}


def _run_world(
    scenario: str, world: int, *, kill: tuple[int, str] | None = None, limit_s: float = 120.0, **kwargs: Any
) -> list[RankResult]:
    """Run ``scenario`` on ``world`` spawned ranks; SIGKILL rank ``kill[0]`` once it reports ``kill[1]``.

    A killed rank's result holds, as ``value``, every label it reported (those still in its pipe at the
    kill too), and as ``ended_at`` the moment the kill was sent. Each rank reports through its own one-way
    pipe, and all wait for the end on a pipe the test closes: no lock is shared with a rank that may be killed
    (a ``multiprocessing.Queue``'s writers share one, which a rank killed while its feeder thread held it
    keeps forever; an ``Event``'s ``set`` waits for every waiter, a killed one too).
    """
    ctx = worker_context()  # forked from a server that imported torch once (support/start.py)
    release, release_all = ctx.Pipe(duplex=False)
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, scenario, kwargs, w, release), daemon=True)
        for r, (_, w) in enumerate(pipes)
    ]
    for p in procs:
        p.start()
    release.close()
    for _, w in pipes:
        w.close()  # the children hold the write ends: a reader sees EOF once its rank is gone
    readers = {reader: rank for rank, (reader, _) in enumerate(pipes)}
    results: dict[int, RankResult] = {}
    trails: dict[int, list[str]] = {r: [] for r in range(world)}

    def receive(conn: Any) -> Any:
        try:
            return conn.recv()
        except EOFError:  # the rank is gone; if it left no result, it is reported as lost
            rank = readers.pop(conn)
            results.setdefault(rank, RankResult(rank, "lost"))
            return None

    deadline = time.monotonic() + limit_s
    try:
        while len(results) < world:
            if time.monotonic() > deadline:
                for r in range(world):
                    results.setdefault(r, RankResult(r, "hung"))
                break
            for conn in wait(list(readers), timeout=0.2):
                msg = receive(conn)
                if msg is None:
                    continue
                kind, rank = msg[0], msg[1]
                if kind == "at":
                    trails[rank].append(msg[2])
                if kind == "at" and kill is not None and (rank, msg[2]) == kill:
                    # The victim is held where it sent this from (it waits HOLD_S there): it dies right there.
                    killed_at = time.monotonic()
                    os.kill(msg[3], signal.SIGKILL)
                    results[rank] = RankResult(rank, "died", value=trails[rank], ended_at=killed_at)
                elif kind == "done":
                    results[rank] = msg[2]
        if kill is not None:  # labels still in the victim's pipe join its trail; EOF once they are read
            victim = next((c for c, r in readers.items() if r == kill[0]), None)
            while victim in readers and victim.poll(5):
                msg = receive(victim)
                if msg is not None and msg[0] == "at":
                    trails[kill[0]].append(msg[2])
    finally:
        release_all.close()  # EOF on every rank's end of the release pipe: they may leave now
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for reader, _ in pipes:
            reader.close()
    return [results[r] for r in range(world)]


WORLDS: dict[str, dict[str, Any]] = {
    "leader killed while generating": {"scenario": "generate", "world": 2, "kill": (0, "leader generating")},
    "member killed during load_weights": {"scenario": "load_weights", "world": 3, "kill": (2, "stalled"), "victim": 2},
    "diverged": {"scenario": "diverged", "world": 2, "timeout_s": DIVERGED_TIMEOUT_S},
}


@pytest.fixture(scope="module")
def worlds() -> dict[str, list[RankResult]]:
    """Every scenario's world started at once (each rank imports torch: together they cost one start)."""
    import threading

    from genengine.models.tiny_model import tiny_model_dir

    model = str(tiny_model_dir())
    results: dict[str, list[RankResult]] = {}

    def run(name: str, spec: dict[str, Any]) -> None:
        spec = dict(spec)
        kwargs = {
            "timeout_s": spec.pop("timeout_s", TIMEOUT_S),
            **({"model": model} if spec["scenario"] != "diverged" else {}),
        }
        if "victim" in spec:
            kwargs["victim"] = spec.pop("victim")
        results[name] = _run_world(spec["scenario"], spec["world"], kill=spec.get("kill"), **kwargs)

    threads = [threading.Thread(target=run, args=item) for item in WORLDS.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_leader_killed_while_generating(worlds: dict[str, list[RankResult]]) -> None:
    rank0, rank1 = worlds["leader killed while generating"]
    assert rank0.status == "died"
    # The kill landed mid-generate: the leader had reported from inside generate's forward pass and never that
    # generate returned.
    assert rank0.value == ["generate", "leader generating"], rank0.value
    assert rank1.raised("CollectiveTimeoutError") and rank1.raised("TimeoutError"), (rank1.status, rank1.message)
    assert "generate in TP group [0, 1]" in rank1.message
    assert "rank(s) [0] of the group died" in rank1.message, rank1.message
    # Noticed when the leader died (after the kill, well before a timeout could fire), not at the timeout.
    assert 0 < rank1.ended_at - rank0.ended_at < DETECT_S, rank1.ended_at - rank0.ended_at
    assert rank1.elapsed < TIMEOUT_S, rank1.elapsed


def test_member_killed_during_load_weights(worlds: dict[str, list[RankResult]]) -> None:
    results = worlds["member killed during load_weights"]
    assert results[2].status == "died"
    assert results[2].value == ["load_weights", "stalled"], results[2].value  # killed while stalled, not after
    for r in results[:2]:  # the leader and the other member, both waiting in the gather of bucket 2
        assert r.raised("CollectiveTimeoutError"), (r.rank, r.status, r.message)
        assert "gather_object in TP group [0, 1, 2]" in r.message, r.message
        assert "rank(s) [2] of the group died" in r.message, r.message
        assert 0 < r.ended_at - results[2].ended_at < DETECT_S, (r.rank, r.ended_at - results[2].ended_at)
        assert r.elapsed < TIMEOUT_S, (r.rank, r.elapsed)


def test_diverged_rank_fails_both_within_the_timeout(worlds: dict[str, list[RankResult]]) -> None:
    rank0, rank1 = worlds["diverged"]
    # Neither rank exits before both have reported, so neither error comes from a peer that left: each is a
    # deadline firing while the other rank was alive and stuck in the other call (a deadline that never fired
    # would leave the world "hung"). The first deadline to fire closes gloo's connection, so the other rank may
    # fail on that rather than on its own deadline a few ms later: the floor is the earlier deadline.
    assert rank0.raised("CollectiveTimeoutError"), (rank0.status, rank0.message)
    assert "check_consistent in TP group [0, 1]" in rank0.message and "rank(s) [1] did not arrive" in rank0.message
    assert rank1.raised("CollectiveTimeoutError"), (rank1.status, rank1.message)
    assert "gather_object in TP group [0, 1] (leader rank 0, this rank 1" in rank1.message
    first_deadline = min(r.ended_at - r.elapsed for r in (rank0, rank1)) + DIVERGED_TIMEOUT_S
    for r in (rank0, rank1):
        assert r.ended_at >= first_deadline - 0.05, (r.rank, r.ended_at - first_deadline)  # never before a deadline
        assert r.elapsed < DIVERGED_TIMEOUT_S + DETECT_S, (r.rank, r.elapsed)  # generous slack for a loaded machine
