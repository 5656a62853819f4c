"""Weight transports on GPUs: NCCL between two GPUs, CUDA IPC between two processes on one GPU.

The CPU suite (tests/test_transport.py) covers the protocol over gloo; these runs check what only a GPU
shows: NCCL carrying the buckets (its own communicator, the side-stream packing), a dead NCCL peer
raising within the timeout without NCCL's watchdog killing the survivor, and CUDA IPC handles opened by
another process on the same GPU. Every replica holds the embedded engine on its GPU.

    PYTHONPATH=$PWD:$PWD/tests python -m pytest tests/gpu/test_transport_gpu.py -q -m gpu --timeout 600
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from support import transport_workers as tw

from genengine.testing.conformance.transport import TRANSPORT_SYNCS, TransportConformance
from genengine.transport import TransportSpec, get_transport

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

BUCKET = 256 << 10


def _need_gpus(n: int) -> None:
    import torch

    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPU(s); {torch.cuda.device_count()} visible")


def _spec(transport: str, world_size: int = 2, **kw: Any) -> dict[str, Any]:
    base = {
        "transport": transport,
        "address": f"127.0.0.1:{tw.free_port()}",
        "world_size": world_size,
        "group_name": f"gpu-{transport}-{time.monotonic_ns()}",
        "timeout_s": 30.0,
        "bucket_bytes": BUCKET,
        "checksum": True,
        "device": "cuda",
    }
    return {**base, **kw}


@pytest.fixture(scope="module")
def model() -> str:
    from genengine.testing.tiny_model import tiny_model_dir

    return str(tiny_model_dir())


def _run(transport: str, model: str, replica_device: str) -> dict[str, Any]:
    """``TransportConformance``'s run: the test process sends from cuda:0 to one replica on ``replica_device``."""
    from genengine.transport import _layout

    tw.configure(model, "cuda:0")
    expected = {"A": tw.reference("A"), "B": tw.reference("B")}
    pool = tw.Pool([1], model, {1: replica_device})
    try:
        assert pool.run({1: ("warm", {})}, timeout_s=300)[1].status == "ok"
        spec = _spec(transport)
        jobs = {"spec": spec, "rank": 1, "syncs": len(TRANSPORT_SYNCS), "check_finite": True}
        pool.submit({1: ("receive", jobs)})
        sender = get_transport(transport).sender(TransportSpec(**spec))
        try:
            sent = [tw.send_one(sender, sync) for sync in TRANSPORT_SYNCS]
        finally:
            sender.close()
        got = pool.collect([1], timeout_s=300)[1]
        assert got.status == "ok", got.message
    finally:
        pool.close()
    plan = _layout.plan(tw.trainer_stream("A"), version=0, bucket_bytes=BUCKET, checksum=True)
    return {"sender": sent, "replicas": {1: got.value}, "plan": plan, "expected": expected}


class TestNcclTransport(TransportConformance):
    """NCCL broadcast to a replica on another GPU."""

    replica_ranks = (1,)

    @pytest.fixture(scope="class")
    @classmethod
    def transport_run(cls, model: str) -> dict[str, Any]:
        _need_gpus(2)
        return _run("nccl", model, "cuda:1")


class TestCudaIpcTransport(TransportConformance):
    """CUDA IPC to a replica on the same GPU."""

    replica_ranks = (1,)

    @pytest.fixture(scope="class")
    @classmethod
    def transport_run(cls, model: str) -> dict[str, Any]:
        _need_gpus(1)
        return _run("cuda_ipc", model, "cuda:0")


def test_a_dead_nccl_sender_makes_the_replica_raise_and_survive(model: str) -> None:
    """NCCL's own watchdog must not kill the surviving replica: it raises TransportTimeoutError and answers
    (refusing to generate from the part of the sync it wrote)."""
    from genengine.transport import _layout

    _need_gpus(2)
    tw.configure(model, "cpu")
    stream = tw.trainer_stream("A")
    plan = _layout.plan(stream, version=0, bucket_bytes=BUCKET, checksum=True)
    bomb = [name for name, _ in stream].index(plan.buckets[3].entries[0].name)
    timeout = 10.0
    spec = _spec("nccl", timeout_s=timeout)
    pool = tw.Pool([0, 1], model, {0: "cuda:1", 1: "cuda:0"})
    try:
        assert all(r.status == "ok" for r in pool.run({0: ("warm", {}), 1: ("warm", {})}, timeout_s=300).values())
        pool.submit(
            {
                0: ("send", {"spec": spec, "syncs": [{"weights": "B", "version": 2, "bomb": bomb}]}),
                1: ("receive", {"spec": spec, "rank": 1, "syncs": 1}),
            }
        )
        got = pool.collect([0, 1], timeout_s=300)
        assert got[0].status == "died"
        assert got[1].status == "ok", got[1].message
        row = got[1].value["syncs"][0]
        assert "TransportTimeoutError" in row["mro"] and "rank(s) [0] died" in row["message"], row
        assert row["seconds"] < timeout + 5.0
        # alive and answering; the buckets before the death were written, so it refuses to generate (never a mix)
        assert row["after"]["version"] == 0 and "incomplete weights" in row["after"]["refused"], row["after"]
    finally:
        pool.close()
