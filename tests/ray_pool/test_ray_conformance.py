"""The conformance suite on an ``EnginePool`` of one embedded replica on a real local Ray cluster: the pool
is an engine, checked exactly as every backend is (sync and async parts).

What the suite can only observe inside an ``EngineBase`` in this process (its ``_apply_weights`` buckets, its
resume step) it skips by itself for a pool, which is not one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ray")

from support.ray_cluster import pool_leftovers

from genengine.protocol import GenerationEngine
from genengine.ray import EnginePool
from genengine.testing.conformance import EngineConformance


@pytest.fixture(scope="module", autouse=True)
def _cluster_left_clean(cluster: Any) -> Iterator[None]:
    """The shared cluster (support/ray_pool.py) is up before the suite's class fixtures build their engines;
    every pool the suite made is gone at the end."""
    yield
    assert pool_leftovers(cluster) == ([], [])


class TestPoolConformance(EngineConformance):
    reads_tensors_before_writing = True  # each tensor goes into Ray's object store before any replica loads

    def make_engine(self, model_dir: str, **options: Any) -> GenerationEngine:
        return EnginePool(
            backend="transformers",
            model=model_dir,
            dtype="float32",
            device="cpu",
            num_replicas=1,
            num_gpus=0,
            num_cpus=0.25,
            **options,
        )
