"""Weight transports on GPUs: NCCL between two GPUs, CUDA IPC between two processes on one GPU.

The CPU suite (tests/test_transport.py) covers the protocol over gloo; these runs check what only a GPU
shows: NCCL carrying the buckets (its own communicator, the side-stream packing), a dead NCCL peer
raising within the timeout without NCCL's watchdog killing the survivor, and CUDA IPC handles opened by
another process on the same GPU. Every replica holds the embedded engine on its GPU.

    PYTHONPATH=$PWD:$PWD/tests python -m pytest tests/gpu/test_transport_gpu.py -q -m gpu --timeout 600
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from support import transport_workers as tw

from genengine.transport import TransportSpec, get_transport

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

BUCKET = 256 << 10

SYNCS = [
    {"weights": "B", "version": 5},
    {"weights": "A", "version": 6, "corrupt": 1},
    {"weights": "A", "version": 7},
]


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


@pytest.fixture
def trainer(model: str) -> Iterator[dict[str, Any]]:
    """The test process as rank 0 on cuda:0, with its reference outputs for both weight sets."""
    tw.configure(model, "cuda:0")
    yield {"A": tw.reference("A"), "B": tw.reference("B")}


def _sync_three_times(transport: str, model: str, replica_device: str, expected: dict[str, Any]) -> None:
    from genengine.transport import _layout

    pool = tw.Pool([1], model, {1: replica_device})
    try:
        assert pool.run({1: ("warm", {})}, timeout_s=300)[1].status == "ok"
        spec = _spec(transport)
        pool.submit({1: ("receive", {"spec": spec, "rank": 1, "syncs": len(SYNCS)})})
        sender = get_transport(transport).sender(TransportSpec(**spec))
        try:
            sent = [tw.send_one(sender, sync) for sync in SYNCS]
        finally:
            sender.close()
        got = pool.collect([1], timeout_s=300)[1]
        assert got.status == "ok", got.message
    finally:
        pool.close()
    plan = _layout.plan(tw.trainer_stream("A"), version=0, bucket_bytes=BUCKET, checksum=True)
    rows = got.value["syncs"]
    for i in (0, 2):  # the syncs that must land: a failure names the sender's error and the replica's
        assert "report" in sent[i], f"sync {i}: the sender failed: {sent[i]}; the replica saw: {rows[i : i + 1]}"
        assert "report" in rows[i], f"sync {i}: the replica failed: {rows[i]}"
    assert sent[0]["report"][0] == 5 and rows[0]["report"] == sent[0]["report"]
    assert rows[0]["after"]["digests"] == expected["B"]["digests"]  # bit for bit, bf16 and fp32
    assert [o[0] for o in rows[0]["after"]["outputs"]] == [o[0] for o in expected["B"]["outputs"]]
    assert "rank 1: checksum mismatch at bucket 1" in sent[1]["message"]
    assert "ChecksumError" in rows[1]["mro"]
    corrupted = [e.name for e in plan.buckets[1].entries]
    assert all(rows[1]["after"]["digests"][n] == expected["B"]["digests"][n] for n in corrupted)
    assert rows[1]["after"]["version"] == 5
    assert rows[2]["after"]["version"] == 7 and rows[2]["after"]["digests"] == expected["A"]["digests"]


def test_nccl_broadcast_to_a_replica_on_another_gpu(model: str, trainer: dict[str, Any]) -> None:
    _need_gpus(2)
    _sync_three_times("nccl", model, "cuda:1", trainer)


def test_cuda_ipc_to_a_replica_on_the_same_gpu(model: str, trainer: dict[str, Any]) -> None:
    _need_gpus(1)
    _sync_three_times("cuda_ipc", model, "cuda:0", trainer)


def test_a_dead_nccl_sender_makes_the_replica_raise_and_survive(model: str) -> None:
    """NCCL's own watchdog must not kill the surviving replica: it raises TransportTimeoutError and can
    still generate."""
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
        assert row["after"]["version"] == 0 and row["after"]["outputs"]  # alive, still generating
    finally:
        pool.close()
