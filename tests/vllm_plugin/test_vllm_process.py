"""The vllm plugin's processes on the CPU (no vLLM needed): RNG states through the engine's start, and the TP
checks on real gloo groups (two spawned processes).
"""

from __future__ import annotations

import math
import os
import random
import traceback
from pathlib import Path
from typing import Any

import pytest
from support.ports import free_port
from support.start import worker_context
from support.vllm_fakes import HAS_VLLM, needs_no_vllm

from genengine.engine.hooks import generate_check_value
from genengine.errors import InconsistentInputsError
from genengine.protocol import EngineState, SamplingParams
from genengine_vllm import _process as vprocess
from genengine_vllm.lightrft import get_vllm_engine


# ---- RNG states -------------------------------------------------------------------------------------------
def test_rng_states_survive_engine_start() -> None:
    import numpy as np
    import torch

    def draw() -> tuple[Any, ...]:
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    expected = draw()
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    with vprocess.preserve_rng_states():  # what vLLM does while it starts: reseed everything
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        draw()
    assert draw() == expected


# ---- real process groups (2 ranks over gloo) ------------------------------------------------------------
def _scenarios(model: str) -> dict[str, Any]:
    """Run on each rank of a 2-rank world; returns what this rank saw."""
    import torch
    import torch.distributed as dist

    from genengine.distributed import engine_group

    rank = dist.get_rank()
    out: dict[str, Any] = {}

    def outcome(fn: Any) -> str:
        try:
            fn()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    # The world cannot be split into TP groups of 3: every rank raises, before vLLM.
    out["tp3"] = outcome(lambda: get_vllm_engine(model, 0.3, tp_size=3))
    if not HAS_VLLM:  # with vLLM installed this would start a real engine
        out["tp2"] = outcome(lambda: get_vllm_engine(model, 0.3, tp_size=2))

    group = engine_group(2, check_port=False, timeout_s=60)
    awake = EngineState()
    same = generate_check_value(["hi there"], SamplingParams(temperature=0.5, seed=3), None, None, awake)
    out["same"] = outcome(lambda: group.check_consistent(same, what="generate inputs"))
    prompt = "hi there" if rank == 0 else "hi there!"
    differ = generate_check_value([prompt], SamplingParams(temperature=0.5, seed=3), None, None, awake)
    out["prompt"] = outcome(lambda: group.check_consistent(differ, what="generate inputs"))
    seed = 3 if rank == 0 else 4
    differ = generate_check_value(["hi"], {"temperature": 0.5, "seed": seed}, None, None, awake)
    out["seed"] = outcome(lambda: group.check_consistent(differ, what="generate inputs"))
    state = awake if rank == 0 else EngineState(released_tags=frozenset({"weights", "kv_cache"}), sleep_level=1)
    differ = generate_check_value(None, None, [[1, 2, 3]], None, state)
    out["state"] = outcome(lambda: group.check_consistent(differ, what="generate inputs or engine state"))

    # vLLM's teardown destroys the default group; inside the guard that is a no-op, subgroups still go.
    sub = dist.new_group([0, 1], backend="gloo")
    with vprocess.keep_default_group(True):
        dist.destroy_process_group()
        dist.destroy_process_group(sub)
    out["initialised_after_guard"] = dist.is_initialized()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    out["all_reduce"] = total.item()
    out["restored"] = dist.destroy_process_group is not None and "guarded" not in dist.destroy_process_group.__name__
    return out


def _rank_main(rank: int, world: int, port: int, model: str, results: Any) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GENENGINE_COLLECTIVE_TIMEOUT_S": "60",
        }
    )
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        value = _scenarios(model)
        dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:
        results.put((rank, "err", traceback.format_exc()))


@pytest.fixture(scope="module")
def two_ranks(model_dir: Path) -> dict[int, dict[str, Any]]:
    ctx = worker_context()  # forked from a server that imported torch and transformers once (support/start.py)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, str(model_dir), results)) for r in range(2)]
    for p in procs:
        p.start()
    seen: dict[int, dict[str, Any]] = {}
    try:
        for _ in procs:
            rank, status, value = results.get(timeout=240)
            assert status == "ok", f"rank {rank} failed:\n{value}"
            seen[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return seen


def test_world_that_tp_cannot_split(two_ranks: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        assert two_ranks[rank]["tp3"].startswith("DistributedSetupError")
        assert "not divisible by tp_size 3" in two_ranks[rank]["tp3"]


@needs_no_vllm
def test_tp2_in_a_world_of_two_passes_the_checks(two_ranks: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):  # topology fine, no sleep engine yet: the next step is importing vLLM
        assert two_ranks[rank]["tp2"].startswith("BackendImportError"), two_ranks[rank]["tp2"]


def test_consistency_check_names_the_odd_rank(two_ranks: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        seen = two_ranks[rank]
        assert seen["same"] == "ok"
        for case in ("prompt", "seed", "state"):
            assert seen[case].startswith("InconsistentInputsError"), seen[case]
            assert "rank(s) [1] of TP group [0, 1]" in seen[case]  # on a tie the leader's value wins
        assert "engine state" in seen["state"]


def test_default_group_survives_the_guard(two_ranks: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        assert two_ranks[rank]["initialised_after_guard"] is True
        assert math.isclose(two_ranks[rank]["all_reduce"], 3.0)
        assert two_ranks[rank]["restored"] is True


def test_inconsistent_inputs_error_is_a_value_error() -> None:
    assert issubclass(InconsistentInputsError, ValueError)
