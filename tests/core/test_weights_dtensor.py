"""An FSDP2 trainer's sharded state dict into the embedded engine: two real gloo ranks on the CPU.

Each spawned rank shards the trainer's copy of model B with ``fully_shard`` over a 1-D CPU device mesh (so
``state_dict()`` holds ``DTensor``s with ``Shard(0)`` placements, half of every tensor per rank) and loads it
into its own embedded engine serving model A. ``load_weights`` gathers each DTensor (a collective, in stream
order on both ranks): both engines must then serve exactly model B, in float32 and from bf16 shards, and a
NaN in one rank's shard must be refused by both ranks alike (neither may hang in a gather the other left).
"""

from __future__ import annotations

import os
import queue
import traceback
from datetime import timedelta
from typing import Any

import pytest
from support import dist_worker as dw
from support.start import worker_context

pytestmark = pytest.mark.timeout(300)

WORLD = 2
NAN_WEIGHT = "model.layers.1.mlp.down_proj.weight"


def _rank_main(rank: int, port: int, model_a: str, model_b: str, out: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        out.put((rank, "ok", _load_shards(rank, model_a, model_b)))
    except BaseException:
        out.put((rank, "err", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _load_shards(rank: int, model_a: str, model_b: str) -> dict[str, Any]:
    import torch
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    from genengine.backends.transformers.engine import TransformersEngine
    from genengine.errors import WeightLoadError
    from genengine.testing.conformance import GREEDY, PROMPTS, load_checkpoint

    mesh = init_device_mesh("cpu", (WORLD,))
    transformers.utils.logging.disable_progress_bar()
    trainer = transformers.AutoModelForCausalLM.from_pretrained(model_b, dtype=torch.float32)
    for layer in trainer.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(trainer, mesh=mesh)
    state = trainer.state_dict()
    plain = load_checkpoint(model_b)
    seen: dict[str, Any] = {
        "names": sorted(state) == sorted(plain),
        "sharded": all(isinstance(t, DTensor) and t.placements == (Shard(0),) for t in state.values()),
        "halves": all(t.to_local().shape[0] * WORLD == t.shape[0] for t in state.values()),
    }

    def tokens() -> list[Any]:
        return [[o.token_ids for o in r.outputs] for r in engine.generate(PROMPTS, GREEDY)]

    with TransformersEngine(model_a, dtype="float32") as engine:
        seen["A"] = tokens()
        report = engine.load_weights(state.items())
        seen["report"] = (report.num_tensors, report.num_bytes)
        seen["from_shards"] = tokens()
        params = dict(engine.model.named_parameters())
        seen["exact"] = all(torch.equal(params[n].detach(), t.float()) for n, t in plain.items() if n in params)
        engine.load_weights(plain.items())
        seen["B"] = tokens()

        # bf16 shards (a trainer keeping bf16 parameters), against the same values sent whole
        engine.load_weights({n: t.to(torch.bfloat16) for n, t in state.items()})
        seen["from_bf16_shards"] = tokens()
        engine.load_weights({n: t.to(torch.bfloat16) for n, t in plain.items()})
        seen["bf16"] = tokens()

        # one NaN, in rank 1's shard only
        engine.load_weights(plain.items())
        if rank == 1:
            with torch.no_grad():
                state[NAN_WEIGHT].to_local().view(-1)[0] = float("nan")
        try:
            engine.load_weights(state.items(), check_finite=True)
            seen["nan"] = "accepted"
        except WeightLoadError as exc:
            seen["nan"] = str(exc)
        seen["after_nan"] = (engine.state.weights_loaded, tokens())
    return seen


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    from genengine.models.tiny_model import tiny_model_dir

    model_a, model_b = str(tiny_model_dir()), str(tiny_model_dir(seed=1))
    ctx = worker_context()  # forked from a server that imported torch and transformers once (support/start.py)
    out = ctx.Queue()
    port = dw.free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, model_a, model_b, out), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < WORLD:
            try:
                rank, status, value = out.get(timeout=240)
            except queue.Empty:
                pytest.fail(f"ranks {sorted(set(range(WORLD)) - set(results))} did not finish in 240 s")
            assert status == "ok", f"rank {rank} failed:\n{value}"
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(WORLD)]


def test_the_state_dict_is_really_sharded(ranks: list[dict[str, Any]]) -> None:
    for seen in ranks:
        assert seen["names"] and seen["sharded"] and seen["halves"]


def test_each_rank_serves_exactly_the_full_model(ranks: list[dict[str, Any]]) -> None:
    from genengine.models.tiny_model import tiny_model_dir
    from genengine.testing.conformance import load_checkpoint

    full = load_checkpoint(tiny_model_dir(seed=1))
    for rank, seen in enumerate(ranks):
        assert seen["exact"], f"rank {rank}: the engine's parameters differ from the full tensors"
        # the trainer holds float32 (the checkpoint is bf16): the gathered tensors' bytes were sent
        assert seen["report"] == (len(full), sum(t.numel() * 4 for t in full.values()))
        assert seen["from_shards"] == seen["B"] != seen["A"], f"rank {rank}"


def test_bf16_shards_load_as_their_values(ranks: list[dict[str, Any]]) -> None:
    for rank, seen in enumerate(ranks):
        assert seen["from_bf16_shards"] == seen["bf16"], f"rank {rank}"


def test_nan_in_one_ranks_shard_is_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """The values are checked once gathered, so both ranks decide alike, before anything is written."""
    for rank, seen in enumerate(ranks):
        assert NAN_WEIGHT in seen["nan"] and "NaN" in seen["nan"], f"rank {rank}: {seen['nan']}"
        assert seen["after_nan"] == (True, seen["B"]), f"rank {rank}: the refused load changed the weights"
