"""Faults in the middle of an RL step: half-way weight streams, and TP ranks that die or diverge.

1. Weights that fail half-way, on an engine that really writes buckets as they come: the conformance
   suite's half-way tests run on the embedded engine in streaming mode (``validate_all_weights_first =
   False``, as the GPU backends stream), so their refusal branch is exercised on CPU, not only on GPUs.
2. A TP group's helpers as the multi-process engines use them (``genengine_sglang.RLGenerationEngine``):
   consistency check before generate, the leader's work, its result broadcast to the group; each rank's
   weight handles gathered to the leader per bucket. One rank is SIGKILLed by this test while the call is
   under way, or diverges into another call; the others must fail within the configured timeout with an
   error naming the rank, never hang. Real gloo process groups in spawned processes, nothing mocked.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from genengine.backends.transformers import TransformersEngine
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
    from genengine.testing.conformance import load_checkpoint
    from genengine.testing.tiny_model import tiny_model_dir

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
TIMEOUT_S = 20.0  # the group's configured timeout: a dead rank must be named well before it
DIVERGED_TIMEOUT_S = 2.0


@dataclass
class RankResult:
    rank: int
    status: str  # "ok", "err", "died" (killed by the test) or "hung"
    error_type: str = ""
    message: str = ""
    mro: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    value: Any = None

    def raised(self, name: str) -> bool:
        return self.status == "err" and name in self.mro


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, scenario: str, kwargs: dict[str, Any], out: Any) -> None:
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
            out.put(("at", rank, label, os.getpid()))

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
    res.elapsed = time.monotonic() - _CALL_START.get("t", start)
    out.put(("done", rank, res, os.getpid()))
    out.close()
    out.join_thread()
    time.sleep(1.5)  # as a trainer still handling the error: the rank that died first stays the only dead one
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
    # Long enough (8 x 1000 tokens) that the test's SIGKILL, 0.2 s in, always lands inside the generation.
    prompts = [f"the quick brown fox {i}" for i in range(8)]
    params = {"temperature": 0.0, "max_new_tokens": 1000, "ignore_eos": True}
    group.barrier()
    _start_call(at, "generate")
    group.check_consistent((prompts, params), what="generate inputs")
    payload = None
    if engine is not None:
        at("leader generating")
        payload = ("ok", engine.generate(prompts, params))
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
            time.sleep(60)
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
    scenario: str, world: int, *, kill: tuple[int, str] | None = None, limit_s: float = 90.0, **kwargs: Any
) -> list[RankResult]:
    """Run ``scenario`` on ``world`` spawned ranks; SIGKILL rank ``kill[0]`` once it reports ``kill[1]``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, scenario, kwargs, out), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, RankResult] = {}
    deadline = time.monotonic() + limit_s
    try:
        while len(results) < world:
            try:
                msg = out.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    for r in range(world):
                        results.setdefault(r, RankResult(r, "hung"))
                continue
            kind, rank = msg[0], msg[1]
            if kind == "at" and kill is not None and (rank, msg[2]) == kill:
                time.sleep(0.2)  # inside the call
                os.kill(msg[3], signal.SIGKILL)
                results[rank] = RankResult(rank, "died")
            elif kind == "done":
                results[rank] = msg[2]
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        with contextlib.suppress(Exception):
            out.close()
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

    from genengine.testing.tiny_model import tiny_model_dir

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
    assert rank1.raised("CollectiveTimeoutError") and rank1.raised("TimeoutError"), (rank1.status, rank1.message)
    assert "generate in TP group [0, 1]" in rank1.message
    assert "rank(s) [0] of the group died" in rank1.message, rank1.message
    assert rank1.elapsed < TIMEOUT_S / 2, rank1.elapsed  # noticed when the leader died, not at the timeout


def test_member_killed_during_load_weights(worlds: dict[str, list[RankResult]]) -> None:
    results = worlds["member killed during load_weights"]
    assert results[2].status == "died"
    for r in results[:2]:  # the leader and the other member, both waiting in the gather of bucket 2
        assert r.raised("CollectiveTimeoutError"), (r.rank, r.status, r.message)
        assert "gather_object in TP group [0, 1, 2]" in r.message, r.message
        assert "rank(s) [2] of the group died" in r.message, r.message
        assert r.elapsed < TIMEOUT_S / 2, (r.rank, r.elapsed)


def test_diverged_rank_fails_both_within_the_timeout(worlds: dict[str, list[RankResult]]) -> None:
    rank0, rank1 = worlds["diverged"]
    assert rank0.raised("CollectiveTimeoutError"), (rank0.status, rank0.message)
    assert "check_consistent in TP group [0, 1]" in rank0.message and "rank(s) [1] did not arrive" in rank0.message
    assert rank1.raised("CollectiveTimeoutError"), (rank1.status, rank1.message)
    assert "gather_object in TP group [0, 1] (leader rank 0, this rank 1" in rank1.message
    for r in (rank0, rank1):
        assert DIVERGED_TIMEOUT_S - 0.1 < r.elapsed < DIVERGED_TIMEOUT_S + 3, (r.rank, r.elapsed)
