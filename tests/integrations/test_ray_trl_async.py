"""TRL's async rollout worker and weight transfer (genengine.integrations.trl_async) over a Ray ``EnginePool``: the
same calls as on one engine, with the pool's streams, pause and load spread over two replicas. A sync with
samples in flight carries them over to the new weights on every replica, each queued sample tagged with the
oldest version of its tokens."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from importlib.util import find_spec
from typing import Any

import pytest

ray = pytest.importorskip("ray")
if find_spec("trl") is None:
    pytest.skip("trl is not installed: pip install -e '.[trl]'", allow_module_level=True)

from support.ray_cluster import pool_leftovers  # noqa: E402
from support.ray_pool import cluster, faults, model, other_weights  # noqa: E402,F401

from genengine import SamplingParams  # noqa: E402
from genengine.cli.demos.sync import TRL_PROMPTS as PROMPTS  # noqa: E402
from genengine.ray import EnginePool  # noqa: E402


@pytest.fixture(scope="module")
def pool(cluster: Any, model: str) -> Iterator[EnginePool]:  # noqa: F811
    with EnginePool(
        backend="transformers", model=model, dtype="float32", num_replicas=2, num_gpus=0, num_cpus=0.25
    ) as p:
        yield p
    assert pool_leftovers(cluster) == ([], [])


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


def test_a_sync_carries_pool_rollouts_over_to_the_new_weights(
    pool: EnginePool,
    model: str,  # noqa: F811
    other_weights: dict[str, Any],  # noqa: F811
) -> None:
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
        dataset=[{"prompt": p} for p in PROMPTS],
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
    samples = list(worker.rollout_buffer.queue)
    assert {s.model_version for s in samples} == {0, 1}
    spans = {
        s.group_id: [o.weight_versions for o in streams[f"trl-async-{s.group_id}"].result().outputs] for s in samples
    }
    assert any(len(v) > 1 for group in spans.values() for v in group), "no queued sample spans the sync"
    for s in samples:
        assert s.model_version == min(version for v in spans[s.group_id] for _, version in v)
    assert pool.in_flight == 0, "stop() aborted the worker's requests on every replica"
