"""Colocated placements on a real local Ray cluster: a pool inside a trainer actor's placement group, and
``genengine bench --pool`` (a colocated replica against the same engine in process)."""

from __future__ import annotations

from typing import Any

import pytest

ray = pytest.importorskip("ray")

from support.ray_pool import (  # noqa: E402
    PROMPTS,
)

from genengine import SamplingParams  # noqa: E402
from genengine.models.tiny_model import tiny_model_dir  # noqa: E402


def test_pool_bench_compares_a_colocated_replica_with_the_same_engine_in_process(cluster: Any, model: str) -> None:
    """``genengine bench --pool`` on the CPU (gloo): both engines measured side by side, and after each sync the
    replica's greedy outputs equal the in-process engine's on the same new weights."""
    from genengine.cli.bench.pool import PoolBenchSettings, format_pool_report, run_pool_bench

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
            sleep_level=2,
        )
    )
    assert report["transport"] == "gloo"
    assert set(report["sleep"]) == {"in_process", "pool"}  # both slept at level 2 and woke (no device memory here)
    rows = report["sync"]["rows"]
    assert [r["version"] for r in rows] == [1, 2]
    assert all(r["outputs_equal"] and r["changed"] and r["labels_ok"] for r in rows), rows
    medians = report["tokens_per_s"]["median"]
    assert medians["pool"] > 0 and medians["in_process"] > 0
    assert report["ratio"] == medians["pool"] / medians["in_process"]
    # One repeat: its pair is the whole run, and neither side spread.
    assert report["paired_ratio"] == pytest.approx(report["ratio"])
    assert report["tokens_per_s"]["spread"] == {"in_process": 0.0, "pool": 0.0}
    assert "pool / in-process" in format_pool_report(report)
    # The same syncs by phase (genengine bench --sync's): both sides paused, loaded and resumed; with no
    # $GENENGINE_SYNC_TRACE folder nothing splits the pool's call, so its load is the whole call.
    for side in ("in_process", "pool"):
        phases = report["sync"]["phases"][side]["phases"]
        assert all(phases[p]["median"] >= 0 for p in ("pause", "gather", "load", "resume")), phases
        assert phases["transfer"] is None
    assert report["sync"]["phases"]["pool"]["phases"]["load"]["all"] == [rows[1]["seconds"]["pool"]]
    assert "sync phases:" in format_pool_report(report)


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
    # the module's in-process engine, used by no other test here: still the checkpoint's weights, as the replicas
    # had before the step (a second engine for them cost a start)
    assert out["before"] == [r.outputs[0].token_ids for r in local.generate(PROMPTS, params)]
    local.load_weights(other_weights.items())
    assert out["after"] == [r.outputs[0].token_ids for r in local.generate(PROMPTS, params)]
    assert set(out["after_versions"]) == {((0, 9),)}
