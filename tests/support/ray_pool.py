"""What the Ray pool test files share: module-scoped fixtures (one cluster, the tiny model, a second set of
weights, an in-process engine as the reference) and small helpers. Each file imports the fixtures it uses."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from genengine import SamplingParams, create_engine
from genengine.models.tiny_model import tiny_model_dir
from genengine.ray import EnginePool
from genengine.testing.conformance import load_checkpoint
from support.ray_cluster import local_cluster

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello", "my name is"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, logprobs=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=7, logprobs=True, n=2)


@pytest.fixture(scope="session")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the replicas' fault switch (support/ray_faults.py)."""
    return tmp_path_factory.mktemp("ray-faults")


_running: list[tuple[contextlib.ExitStack, Any]] = []
"""The cluster up in this process, if any: its exit stack and its ``ray`` handle."""
_next_item: list[pytest.Item | None] = [None]
"""The test that runs after the one being torn down (None: the last of the session)."""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Before the runner tears down fixtures: say whether the next test needs the cluster."""
    _next_item[0] = nextitem


@pytest.fixture(scope="module")
def cluster(faults: Path) -> Iterator[Any]:
    """One cluster for a run of consecutive Ray files (starting one costs seconds to tens of seconds on a loaded
    2-core machine); each file's fixtures check that their pools left nothing in it. It is stopped as soon as
    the next test needs none (conftest runs the Ray files first), instead of idling through the rest of the
    session: a live cluster's processes take about 5% of a core doing nothing."""
    if not _running:
        stack = contextlib.ExitStack()
        _running.append((stack, stack.enter_context(local_cluster(num_cpus=2, faults_dir=str(faults)))))
    yield _running[0][1]
    following = _next_item[0]
    if following is None or "cluster" not in following.fixturenames:
        stack, _ = _running.pop()
        stack.close()


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


def info(replica: Any) -> dict[str, Any]:
    """The replica actor's own ``info`` (asked directly, not through the pool)."""
    import ray

    return ray.get(ray.get_actor(replica.name).info.remote(), timeout=60)  # type: ignore[no-any-return]


def tokens(results: Any) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in results]


def served_by_both(pool: EnginePool, want: list[list[list[int]]], tag: str) -> None:
    """``PROMPTS`` under fresh session keys (least-loaded routing spreads them over every routed replica):
    ``want`` comes back, and replicas 0 and 1 both did some of the work."""
    work = dict(pool.router.stats.work)
    got = pool.generate(PROMPTS, GREEDY, session_id=[f"{tag}-{i}" for i in range(len(PROMPTS))])
    assert tokens(got) == want
    assert all(pool.router.stats.work.get(i, 0) > work.get(i, 0) for i in (0, 1)), (work, pool.router.stats.work)
