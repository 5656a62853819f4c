"""Weight transports on GPUs: NCCL between two GPUs, CUDA IPC between two processes on one GPU.

The CPU suite (tests/transport/test_transport.py) covers the protocol over gloo; these runs check what only a GPU
shows: NCCL carrying the buckets (its own communicator, the side-stream packing), a dead NCCL peer
raising within the timeout without NCCL's watchdog killing the survivor, and CUDA IPC handles opened by
another process on the same GPU. Every replica holds the embedded engine on its GPU.

    PYTHONPATH=$PWD:$PWD/tests python -m pytest tests/gpu/test_transport_gpu.py -q -m gpu --timeout 600
"""

from __future__ import annotations

import json
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
    from genengine.models.tiny_model import tiny_model_dir

    return str(tiny_model_dir())


def _run(
    transport: str,
    model: str,
    replica_device: str,
    trainer_device: str | None = None,
    syncs: list[dict[str, Any]] = TRANSPORT_SYNCS,
) -> dict[str, Any]:
    """``TransportConformance``'s run: the test process sends from cuda:0 (its tensors on ``trainer_device``,
    default cuda:0) to one replica on ``replica_device``. ``memory``: the test process's allocated GPU bytes
    before the sender exists and once the replica is done (what the syncs left held)."""
    import gc

    import torch

    tw.configure(model, "cuda:0", trainer_device)
    expected = {"A": tw.reference("A"), "B": tw.reference("B")}
    pool = tw.Pool([1], model, {1: replica_device})
    try:
        assert pool.run({1: ("warm", {})}, timeout_s=300)[1].status == "ok"
        spec = _spec(transport)
        jobs = {"spec": spec, "rank": 1, "syncs": len(syncs), "check_finite": True}
        pool.submit({1: ("receive", jobs)})
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        sender = get_transport(transport).sender(TransportSpec(**spec))
        try:
            sent = [tw.send_one(sender, sync) for sync in syncs]
        finally:
            sender.close()
        got = pool.collect([1], timeout_s=300)[1]
        assert got.status == "ok", got.message
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()  # memory shared with the replica goes back once the replica let go of it
        memory = {"before": before, "after": torch.cuda.memory_allocated()}
        plan = tw.plan(tw.trainer_stream("A"), TransportSpec(**spec))
    finally:
        pool.close()
    return {"sender": sent, "replicas": {1: got.value}, "plan": plan, "expected": expected, "memory": memory}


class TestNcclTransport(TransportConformance):
    """NCCL broadcast to a replica on another GPU."""

    replica_ranks = (1,)

    @pytest.fixture(scope="class")
    @classmethod
    def transport_run(cls, model: str) -> dict[str, Any]:
        _need_gpus(2)
        return _run("nccl", model, "cuda:1")


class TestCudaIpcTransport(TransportConformance):
    """CUDA IPC to a replica on the same GPU, the trainer's tensors in host memory: every one is packed into the
    shared buffers (the buckets, checksums and faults the suite checks). Tensors dense on the GPU are read in
    place instead: ``test_cuda_ipc_reads_dense_gpu_tensors_in_place``."""

    replica_ranks = (1,)

    @pytest.fixture(scope="class")
    @classmethod
    def transport_run(cls, model: str) -> dict[str, Any]:
        _need_gpus(1)
        return _run("cuda_ipc", model, "cuda:0", trainer_device="cpu")


IN_PLACE_SYNCS: list[dict[str, Any]] = [
    {"weights": "B", "version": 5},  # every tensor dense on the GPU: one bucket, nothing packed
    {"weights": "A", "version": 6, "host_every": 2},  # half from host memory: packed beside the shared ones
    {"weights": "B", "version": 7, "nan_bucket": 0},  # a NaN in a shared tensor: check_finite refuses the sync
    {"weights": "B", "version": 8},  # a whole sync after it
    {"weights": "A", "version": 9},  # the replica fails to open it after 3 tensors (IN_PLACE_FAIL_OPEN)
    {"weights": "B", "version": 10},  # a whole sync after it
]
IN_PLACE_FAIL_OPEN = "9:3"
"""``GENENGINE_CUDA_IPC_FAIL_OPEN`` for the replica: as if it could not reach the trainer's GPU at version 9."""


@pytest.fixture(scope="module", params=["torch", "driver"])
def in_place_run(request: pytest.FixtureRequest, model: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``IN_PLACE_SYNCS`` from the trainer's GPU tensors, shared by torch's handles or the driver's (``param``),
    with both ends' traces; one run for the tests below."""
    _need_gpus(1)
    from genengine.engine.ipc import HANDLES_ENV
    from genengine.transport._trace import ENV as TRACE_ENV
    from genengine.transport.cuda_ipc import FAIL_OPEN_ENV

    traces = tmp_path_factory.mktemp(f"trace-{request.param}")
    with pytest.MonkeyPatch.context() as mp:  # the replica's process, started in _run, inherits them
        mp.setenv(HANDLES_ENV, request.param)
        mp.setenv(TRACE_ENV, str(traces))
        mp.setenv(FAIL_OPEN_ENV, IN_PLACE_FAIL_OPEN)
        run = _run("cuda_ipc", model, "cuda:0", syncs=IN_PLACE_SYNCS)
    run["handles"] = request.param
    run["traces"] = [json.loads(p.read_text()) for p in traces.glob("sync-*.json")]
    return run


def test_cuda_ipc_reads_dense_gpu_tensors_in_place(in_place_run: dict[str, Any]) -> None:
    """The trainer's tensors dense on its GPU travel as their own IPC handles (no bucket room, no copy): a whole
    model is one bucket, one load and one flush; mixed with host tensors both land; the replica's
    ``check_finite`` sees a NaN in the trainer's memory (and, nothing written, keeps serving); every sync leaves
    what a direct load leaves. The same with one CUDA driver handle per allocation (``driver``), which both
    ends' traces must show was the way taken. Among the tensors: views at a nonzero storage offset (shared at
    that offset) and transposed ones (packed), each arriving bit for bit (issue 40 B11; each engine's replica
    reads both kinds in tests/gpu/test_ray_gpu.py)."""
    run, handles = in_place_run, in_place_run["handles"]
    # one per side for each whole sync (the refused and the unopened ones write none)
    ways = sorted((t["side"], t["handles"]) for t in run["traces"])
    assert ways == [("receiver", handles)] * 4 + [("sender", handles)] * 4, ways
    expected = run["expected"]
    rows = run["replicas"][1]["syncs"]
    stream = tw.trainer_stream("B")
    assert run["sender"][0]["report"] == [5, len(stream), sum(t.numel() * t.element_size() for _, t in stream), 1]
    assert rows[0]["report"] == run["sender"][0]["report"], rows[0]
    assert rows[0]["probe"] == {"flushes": 1, "writes": 1, "versions_at_writes": [0]}, rows[0]["probe"]
    for i, which, version in ((0, "B", 5), (1, "A", 6), (3, "B", 8)):
        after = rows[i]["after"]
        assert "report" in run["sender"][i] and after["version"] == version, (i, run["sender"][i], rows[i])
        assert after["digests"] == expected[which]["digests"], i
        assert [o[:2] for o in after["outputs"]] == [o[:2] for o in expected[which]["outputs"]], i
    assert run["sender"][1]["report"][3] >= 2, run["sender"][1]  # the host half filled buckets of its own
    # Views at a nonzero offset of their storage (dense: read in place, at that offset, by this run's handles)
    # and transposed tensors (not contiguous: packed) are in the stream, and each arrived bit for bit.
    offset = [n for n, t in stream if t.storage_offset() > 0 and t.is_contiguous()]
    transposed = [n for n, t in stream if not t.is_contiguous()]
    held = [n for n in offset + transposed if n in expected["B"]["digests"]]
    assert offset and transposed and len(held) >= len(offset + transposed) - 1, (offset, transposed)
    got = rows[0]["after"]["digests"]
    assert {n: got[n] for n in held} == {n: expected["B"]["digests"][n] for n in held}
    text = rows[2]["message"]
    assert "WeightLoadError" in rows[2]["mro"] and "NaN or infinite" in text, rows[2]
    # refused before anything was written (the whole model is one bucket): it still serves version 6
    after = rows[2]["after"]
    assert after["version"] == 6 and after["digests"] == expected["A"]["digests"] and "outputs" in after, after


def test_a_replica_that_cannot_open_a_sync_fails_it_at_once_and_holds_no_trainer_memory(
    in_place_run: dict[str, Any],
) -> None:
    """A replica that cannot open a sync's shared memory (on another GPU, a driver error; injected at version 9
    after 3 of its tensors) reports it in step with the sender, which raises it at once rather than at its
    timeout; every torch share it did not open is released (torch counts each until a consumer does: one left
    counted holds the trainer's memory for good), it keeps its old weights, and the next sync lands whole. Over
    the whole run (a refused sync too) nothing of the trainer's memory stays held."""
    from genengine.transport.cuda_ipc import FAIL_OPEN_ENV

    run = in_place_run
    sent, rows, expected = run["sender"], run["replicas"][1]["syncs"], run["expected"]
    assert "could not open the trainer's shared memory" in sent[4].get("message", ""), sent[4]
    assert FAIL_OPEN_ENV in rows[4].get("message", "") and rows[4]["seconds"] < 10, rows[4]
    assert rows[4]["after"]["version"] == 8 and rows[4]["after"]["digests"] == expected["B"]["digests"], rows[4]
    assert "report" in sent[5], sent[5]
    assert rows[5]["after"]["version"] == 10 and rows[5]["after"]["digests"] == expected["B"]["digests"], rows[5]
    held = run["memory"]["after"] - run["memory"]["before"]
    assert held < 64 << 10, f"{held} bytes of the trainer's memory stayed held after the syncs: {run['memory']}"


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


@pytest.mark.parametrize("mode", ["spare", "settled", "driver"])
def test_memory_opened_from_the_trainer_passes_on_to_a_third_process(mode: str) -> None:
    """The colocated SGLang replica's path (``genengine.engine.ipc``): the replica opens the trainer's tensors (by
    torch's handles, or the driver's: ``driver``) and its engine process reads them bit for bit, under the
    trainer's spare share or, with none left, as the replica's copy; every share is released once (passed on,
    or settled unused) and every driver handle closed, so the trainer's memory goes back when it lets go: a
    share left counted holds it for good."""
    _need_gpus(1)
    from support import ipc_relay

    got = ipc_relay.run(mode)
    assert "error" not in got and got["exitcode"] == 0, got
    assert got["replica"] == got["expected"], got
    if mode != "settled":
        passes = 1 if mode == "no-spare" else 2
        assert got["engine"] == [got["expected"]] * passes and got["passes"] == 2 * passes, got
    assert got.get("left_open", 0) == 0, got
    assert got["held"] - got["base"] >= 2 * 1024 * 1536 * 2, got
    assert got["after"] - got["base"] < 1 << 20, f"the trainer's memory stayed held after every process let go: {got}"
