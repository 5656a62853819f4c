"""Weight transports on CPU: real gloo groups between real processes, each replica holding a real engine.

The test process is the trainer (rank 0) and the reference (an engine loaded directly with the same
tensors); two spawned workers (tests/support/transport_workers.py) are the replicas. The "nccl" transport
runs the same code with NCCL carrying the buckets, so these tests cover its logic; the GPU runs are in
tests/gpu/test_transport_gpu.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import transport_workers as tw

from genengine.errors import InvalidArgumentError
from genengine.hookspecs import hookimpl
from genengine.plugins import registry
from genengine.testing.conformance.transport import TRANSPORT_SYNCS, TransportConformance
from genengine.transport import (
    DuplicateTransportError,
    TransportError,
    TransportNotFoundError,
    TransportSpec,
    TransportTimeoutError,
    available_transports,
    get_transport,
    open_receiver,
)

pytestmark = pytest.mark.timeout(300)

BUCKET = 256 << 10  # several buckets out of the tiny model's ~4 MB


def _spec(world_size: int = 3, **kw: Any) -> dict[str, Any]:
    base = {
        "transport": "gloo",
        "address": f"127.0.0.1:{tw.free_port()}",
        "world_size": world_size,
        "group_name": f"test-{time.monotonic_ns()}",
        "timeout_s": 10.0,
        "bucket_bytes": BUCKET,
        "checksum": True,
    }
    return {**base, **kw}


def _port_is_free(address: str) -> bool:
    """Whether a new rendezvous could listen there (as TCPStore does, with SO_REUSEADDR)."""
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
    return True


# ---- the pool: 2 replica processes, warm before any timing matters -------------------------------------------
@pytest.fixture(scope="module")
def pool() -> Iterator[tw.Pool]:
    import torch

    from genengine.models.tiny_model import tiny_model_dir

    torch.set_num_threads(1)  # the same arithmetic as the workers'
    model = str(tiny_model_dir())
    tw.configure(model)
    workers = tw.Pool([1, 2], model)  # worker i plays rank i
    try:
        workers.submit({1: ("warm", {}), 2: ("warm", {})})
        tw.warm()
        got = workers.collect([1, 2], timeout_s=240)
        assert all(r.status == "ok" for r in got.values()), got
        yield workers
    finally:
        workers.close()


@pytest.fixture(scope="module")
def expected(pool: tw.Pool) -> dict[str, dict[str, Any]]:
    """What an engine holds after loading each weight set directly (``load_weights``, no transport)."""
    return {"A": tw.reference("A"), "B": tw.reference("B")}


def _error(row: dict[str, Any], name: str) -> str:
    assert "error" in row and name in row["mro"], row
    return str(row["message"])


# ---- one group, the conformance syncs: clean, refused, corrupted, failing to load, clean again, empty -----------
class TestGlooTransport(TransportConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def transport_run(cls, pool: tw.Pool, expected: dict[str, Any]) -> dict[str, Any]:
        from genengine.transport import _layout

        spec = _spec()
        jobs = {"spec": spec, "syncs": len(TRANSPORT_SYNCS), "check_finite": True}
        pool.submit({r: ("receive", {**jobs, "rank": r}) for r in (1, 2)})
        sender = get_transport("gloo").sender(TransportSpec(**spec))
        outcomes: list[Any] = []
        try:
            for sync in TRANSPORT_SYNCS:
                outcomes.append(tw.send_one(sender, sync))
        finally:
            sender.close()
        got = pool.collect([1, 2])
        assert all(r.status == "ok" for r in got.values()), got
        plan = _layout.plan(tw.trainer_stream("A"), version=0, bucket_bytes=BUCKET, checksum=True)
        return {"sender": outcomes, "replicas": {r: got[r].value for r in (1, 2)}, "plan": plan, "expected": expected}


def test_a_sender_failing_to_pack_a_bucket_raises_its_own_error(pool: tw.Pool, expected: dict[str, Any]) -> None:
    """The trainer's process cannot pack bucket 2 (a gather failing): it marks the bucket aborted so that every
    replica stops in step, and then raises its own error to the trainer, not a TransportError built from the
    replicas' "saw the abort" statuses. The group stays usable: the next sync lands."""
    from genengine.transport import _layout

    stream = tw.trainer_stream("B")
    plan = _layout.plan(stream, version=0, bucket_bytes=BUCKET, checksum=True)
    at = [name for name, _ in stream].index(plan.buckets[2].entries[0].name)
    spec = _spec()
    pool.submit({r: ("receive", {"spec": spec, "rank": r, "syncs": 2}) for r in (1, 2)})
    sender = get_transport("gloo").sender(TransportSpec(**spec))
    try:
        failed = tw.send_one(sender, {"weights": "B", "version": 3, "fail_pack": at})
        again = tw.send_one(sender, {"weights": "B", "version": 4})
    finally:
        sender.close()
    got = pool.collect([1, 2])
    assert all(r.status == "ok" for r in got.values()), got
    assert failed["error"] == "PackFault" and "gathering this tensor failed" in failed["message"], failed
    assert again["report"][0] == 4
    for rank in (1, 2):
        first, second = got[rank].value["syncs"]
        message = _error(first, "TransportError")
        assert "the sender aborted the sync of version 3 at bucket 2" in message and "2 earlier bucket(s)" in message
        assert first["after"]["version"] == 0, rank  # the old label, and the two written buckets are not served
        assert "incomplete weights" in first["after"]["refused"] and first["probe"]["flushes"] == 0, first
        assert second["after"]["version"] == 4 and second["after"]["digests"] == expected["B"]["digests"], rank


def test_an_engine_without_load_sessions_refuses_a_non_finite_sync_and_keeps_its_weights(
    pool: tw.Pool, expected: dict[str, Any]
) -> None:
    """An engine with ``load_weights`` alone (a third-party one, no ``begin_load``) receiving with ``check_finite``
    a sync whose bucket 2 holds a NaN: refused on both replicas, and nothing of it reaches the engines (no
    write, no flush), which keep serving their old weights under their old version: one ``load_weights`` a
    bucket would have loaded buckets 0 and 1, a mix such an engine cannot refuse to serve. The next whole sync
    lands bit for bit through the same engines."""
    spec = _spec()
    jobs = {"spec": spec, "syncs": 2, "check_finite": True, "sessions": False}
    pool.submit({r: ("receive", {**jobs, "rank": r}) for r in (1, 2)})
    sender = get_transport("gloo").sender(TransportSpec(**spec))
    try:
        refused = tw.send_one(sender, {"weights": "B", "version": 3, "nan_bucket": 2})
        whole = tw.send_one(sender, {"weights": "B", "version": 4})
    finally:
        sender.close()
    got = pool.collect([1, 2])
    assert all(r.status == "ok" for r in got.values()), got
    message = _error(refused, "TransportError")
    assert "report" in whole, whole
    for rank in (1, 2):
        assert f"rank {rank}: its engine failed to load it at bucket 2" in message, message
        before, (first, second) = got[rank].value["before"], got[rank].value["syncs"]
        assert "NaN or infinite" in _error(first, "WeightLoadError") and first["buckets_loaded"] == 0, first
        assert first["probe"] == {"flushes": 0, "writes": 0, "versions_at_writes": []}, first["probe"]
        after = first["after"]
        assert after["version"] == 0 and after["digests"] == before["digests"], rank  # not one weight changed
        assert after["outputs"] == before["outputs"], rank  # and it serves them whole
        assert second["report"] == whole["report"], second
        assert second["after"]["version"] == 4 and second["after"]["digests"] == expected["B"]["digests"], rank


# ---- peers that never come or die ----------------------------------------------------------------------------
def test_a_receiver_that_never_joins_is_named_by_the_sender(pool: tw.Pool) -> None:
    spec = _spec(timeout_s=3.0)
    pool.submit({1: ("join_only", {"spec": spec, "rank": 1})})  # rank 2 never comes
    start = time.monotonic()
    with pytest.raises(TransportTimeoutError) as info:
        get_transport("gloo").sender(TransportSpec(**spec))
    elapsed = time.monotonic() - start
    assert 3.0 <= elapsed < 3.0 + 3.0
    message = str(info.value)
    assert "rank(s) [2] did not join within 3 s" in message and spec["group_name"] in message
    joined = pool.collect([1])[1].value
    assert "TransportTimeoutError" in joined["mro"] and "rank(s) [2] did not join" in joined["message"]
    assert _port_is_free(spec["address"])  # the rendezvous was released


def test_a_receiver_dying_mid_sync_makes_the_sender_raise_naming_it(pool: tw.Pool) -> None:
    """Rank 2 dies writing bucket 2: the sender raises naming it, at once (its connection reset), and the
    survivor too, not at the group's timeout: the broken group is released on the sender's side as it fails
    (gloo keeps a group's connections open while anything holds it, and the survivor waited them out)."""
    spec = _spec(timeout_s=20.0)
    pool.submit(
        {
            1: ("receive", {"spec": spec, "rank": 1, "syncs": 1}),
            2: ("receive", {"spec": spec, "rank": 2, "syncs": 1, "die_in_load": 2}),
        }
    )
    sender = get_transport("gloo").sender(TransportSpec(**spec))
    start = time.monotonic()
    try:
        with pytest.raises(TransportTimeoutError) as info:
            sender.send(tw.trainer_stream("B"), version=3)
    finally:
        sender.close()
    assert time.monotonic() - start < 10.0
    assert "rank(s) [2] died" in str(info.value), info.value
    got = pool.collect([1, 2])
    assert got[2].status == "died"
    row = got[1].value["syncs"][0]
    assert "TransportTimeoutError" in row["mro"] and row["seconds"] < 10.0, row
    assert row["after"]["version"] == 0
    with pytest.raises(TransportError, match="is broken"):
        sender.send([], version=4)


def test_a_sender_killed_mid_broadcast_makes_receivers_raise_within_the_timeout(pool: tw.Pool) -> None:
    timeout = 5.0
    spec = _spec(world_size=2, timeout_s=timeout)
    plan_tensors = tw.trainer_stream("A")
    from genengine.transport import _layout

    plan = _layout.plan(plan_tensors, version=0, bucket_bytes=BUCKET, checksum=True)
    bomb = [name for name, _ in plan_tensors].index(plan.buckets[3].entries[0].name)  # dies packing bucket 3
    pool.submit({1: ("send", {"spec": spec, "syncs": [{"weights": "B", "version": 2, "bomb": bomb}]})})
    tw.engine().load_weights(tw.trainer_stream("A"), version=0)
    receiver = get_transport("gloo").receiver(TransportSpec(**spec), 1)
    start = time.monotonic()
    try:
        with pytest.raises(TransportTimeoutError) as info:
            receiver.receive(tw.engine())
    finally:
        receiver.close()
    assert time.monotonic() - start < timeout + 2.0
    message = str(info.value)
    assert "rank(s) [0] died" in message and spec["group_name"] in message and "receiving bucket" in message
    assert pool.collect([1])[1].status == "died"
    assert tw.engine().weight_version == 0  # the version moves only with a whole sync


# ---- refused before anything is taken -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"world_size": 1}, "world_size=1 must be >= 2"),
        ({"world_size": 2.0}, "world_size=2.0 must be a positive integer"),
        ({"address": "localhost"}, "address='localhost'"),
        ({"address": "localhost:0"}, "address='localhost:0'"),
        ({"address": "localhost:70000"}, "address='localhost:70000'"),
        ({"address": "local host:29600"}, "address='local host:29600'"),
        ({"timeout_s": 0}, "timeout_s=0"),
        ({"timeout_s": float("inf")}, "timeout_s=inf"),
        ({"bucket_bytes": 0}, "bucket_bytes=0"),
        ({"checksum": 1}, "checksum=1"),
        ({"device": "cuda:1"}, "device='cuda:1'"),
        ({"group_name": ""}, "group_name=''"),
    ],
)
def test_bad_specs_are_refused_when_built(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match.replace("(", r"\(").replace(")", r"\)")):
        TransportSpec(**{**_spec(checksum=False), **fields})


def test_the_receiver_is_the_transports_and_no_engine_hook_is_left() -> None:
    """The optional engine method ``weight_transport_receiver`` was declared but no backend implemented it
    (issue 42): it is gone, from the code and the docs, not half there."""
    import inspect

    import genengine.transport as transport

    assert list(inspect.signature(open_receiver).parameters) == ["spec", "rank"]
    assert not hasattr(transport, "NATIVE_RECEIVER_METHOD")
    root = Path(__file__).resolve().parent.parent
    texts = [*root.glob("genengine/**/*.py"), *root.glob("genengine_*/**/*.py"), *root.glob("docs/**/*.md")]
    assert [str(p.relative_to(root)) for p in texts if "weight_transport_receiver" in p.read_text()] == []


def test_unknown_transport_and_wrong_rank_or_device_take_no_port() -> None:
    spec = TransportSpec(**_spec())
    with pytest.raises(TransportNotFoundError, match=r"unknown weight transport 'glo' \(did you mean 'gloo'\?\).*gloo"):
        get_transport("glo")
    with pytest.raises(TransportNotFoundError, match="registered transports: cuda_ipc, gloo, nccl"):
        open_receiver(TransportSpec(**{**_spec(), "transport": "tcp"}), 1)
    for rank in (0, 3, True):
        with pytest.raises(InvalidArgumentError, match=f"rank={rank!r} must be an integer in 1..2"):
            get_transport("gloo").receiver(spec, rank)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="moves cpu tensors; the spec has device='cuda'"):
        get_transport("gloo").sender(TransportSpec(**{**_spec(), "device": "cuda"}))
    with pytest.raises(InvalidArgumentError, match="the 'nccl' transport got a spec for transport='gloo'"):
        get_transport("nccl").sender(spec)
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(TransportError, match="needs a CUDA device"):
            get_transport("cuda_ipc").sender(TransportSpec(**{**_spec(), "transport": "cuda_ipc", "device": "cuda"}))
    assert _port_is_free(spec.address)


def test_version_is_checked_before_anything_is_sent() -> None:
    from genengine.transport.broadcast import check_version

    for bad in (-1, 1.0, True, None):
        with pytest.raises(InvalidArgumentError, match="must be an integer >= 0"):
            check_version(bad)


# ---- the registry ---------------------------------------------------------------------------------------------
def test_builtin_transports_are_registered_through_the_hook() -> None:
    assert {"gloo", "nccl", "cuda_ipc"} <= set(available_transports())
    infos = {t.name: t for t in registry.available_transports()}
    assert infos["gloo"].plugin == registry.BUILTIN_TRANSPORTS_PLUGIN
    assert type(get_transport("gloo")).__name__ == "GlooTransport"


def _fresh_registry(*plugins: types.ModuleType) -> Any:
    reg = registry._Registry()
    for i, plugin in enumerate(plugins):
        reg.pm.register(plugin, name=f"third-party-{i}")
    reg.load()
    return reg


def test_a_third_party_plugin_registers_a_transport_lazily() -> None:
    plugin = types.ModuleType("acme_transport")

    @hookimpl
    def register_weight_transports(register: Any) -> None:
        register("acme", "genengine.transport.broadcast:GlooTransport", description="a test transport")

    plugin.register_weight_transports = register_weight_transports  # type: ignore[attr-defined]
    reg = _fresh_registry(plugin)
    assert reg.transports["acme"].plugin == "third-party-0"
    assert reg.transports["acme"].factory == "genengine.transport.broadcast:GlooTransport"  # not imported yet
    assert {"gloo", "nccl", "cuda_ipc", "acme"} <= set(reg.transports)


def test_a_transport_name_registered_twice_names_both_plugins() -> None:
    plugin = types.ModuleType("dup_transport")

    @hookimpl
    def register_weight_transports(register: Any) -> None:
        register("gloo", object)

    plugin.register_weight_transports = register_weight_transports  # type: ignore[attr-defined]
    with pytest.raises(DuplicateTransportError, match=r"'gloo' is registered twice.*genengine\.transport\.plugin"):
        _fresh_registry(plugin)


def test_importing_the_transport_package_imports_no_torch() -> None:
    code = (
        "import sys, genengine.transport as t\n"
        "names = t.available_transports(); t.get_transport('gloo')\n"
        "print(names, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['cuda_ipc', 'gloo', 'nccl'] False"


def test_shared_entries_take_no_room_in_a_bucket_and_travel_in_the_metadata() -> None:
    """What ``cuda_ipc`` plans for tensors its receivers read in place (layout.plan's ``share``): entries marked
    shared, no bytes in the buffer and no cost towards ``bucket_bytes`` (a whole model of them is one bucket),
    packed ones laid out as before; the receiver's metadata says which is which, and packing leaves the shared
    ones out of the buffer."""
    import torch

    from genengine.transport import _layout

    big = 1 << 16
    stream = [(f"w{i}", torch.full((big,), float(i))) for i in range(6)]
    odd = {"w1", "w4"}  # packed; the rest shared

    def share(tensor: Any) -> bool:
        return not any(tensor is t for n, t in stream if n in odd)

    plan = _layout.plan(stream, version=3, bucket_bytes=4 * big, checksum=True, share=share)
    assert [[e.name for e in b.entries] for b in plan.buckets] == [["w0", "w1", "w2", "w3"], ["w4", "w5"]]
    assert [b.nbytes for b in plan.buckets] == [4 * big, 4 * big]  # one packed tensor each
    assert plan.num_bytes == 6 * 4 * big and plan.num_tensors == 6
    whole = _layout.plan(stream, version=3, bucket_bytes=4 * big, checksum=True, share=lambda t: True)
    assert len(whole.buckets) == 1 and whole.buckets[0].nbytes == 0 and whole.buffer_bytes == _layout.TRAILER

    meta = _layout.Plan.parse(plan.metadata(seq=1))
    assert meta["buckets"] == plan.buckets
    assert [e.shared for e in meta["buckets"][0].entries] == [True, False, True, True]

    buf = torch.zeros(plan.buffer_bytes, dtype=torch.uint8)
    _layout.pack(plan, 0, buf)
    assert int(_layout.checksum_of(buf, plan.buckets[0].nbytes)) == _layout.read_trailer(buf, plan.buckets[0])[1]
    lent = {n: t for n, t in stream if n not in odd}
    views = dict(plan.buckets[0].views(buf, lent))
    assert all(views[n] is lent[n] for n in ("w0", "w2", "w3"))
    assert torch.equal(views["w1"], stream[1][1])  # the packed one, from the buffer
    with pytest.raises(ValueError, match="'w0' is shared by the sender, and its handle did not arrive"):
        plan.buckets[0].views(buf)


def test_views_at_an_offset_and_transposed_tensors_are_planned_and_packed_exactly() -> None:
    """The CPU side of what tests/gpu/test_ray_gpu.py syncs over ``cuda_ipc`` into each engine
    (``tw.awkward_weights``): the stream holds views at a nonzero storage offset and transposed tensors with the
    values of ``random_weights``; ``cuda_ipc``'s choice (``shareable``) reads the dense offset views in place
    and packs the transposed ones; packed and read back through the layout, every tensor is bit for bit."""
    import torch

    from genengine.cli.bench.pool import random_weights
    from genengine.models.tiny_model import tiny_model_dir
    from genengine.transport import _layout
    from genengine.transport.cuda_ipc import shareable

    model = str(tiny_model_dir())
    plain = dict(random_weights(model, 3, "cpu"))
    stream = tw.awkward_weights(model, 3, "cpu")
    assert [n for n, _ in stream] == list(plain) and all(torch.equal(t, plain[n]) for n, t in stream)
    offset = {n for n, t in stream if t.storage_offset() > 0 and t.is_contiguous()}
    transposed = {n for n, t in stream if not t.is_contiguous()}
    assert len(offset) > 3 and len(transposed) > 3, (offset, transposed)
    plan = _layout.plan(stream, version=3, bucket_bytes=BUCKET, checksum=True, share=shareable(torch.device("cpu")))
    entries = {e.name: e for b in plan.buckets for e in b.entries}
    assert all(entries[n].shared for n in offset) and not any(entries[n].shared for n in transposed)
    lent = {n: t for n, t in stream if entries[n].shared}
    buf = torch.zeros(plan.buffer_bytes, dtype=torch.uint8)
    got: dict[str, Any] = {}
    for k, bucket in enumerate(plan.buckets):
        view = buf[: bucket.nbytes + _layout.TRAILER]
        _layout.pack(plan, k, view)
        assert int(_layout.checksum_of(view, bucket.nbytes)) == _layout.read_trailer(view, bucket)[1]
        got.update((n, t.clone()) for n, t in bucket.views(view, lent))
    assert sorted(got) == sorted(plain)
    wrong = [n for n, t in plain.items() if not torch.equal(got[n], t)]
    assert wrong == [], wrong


def test_ipc_dumps_pickles_as_torch_does_for_memory_this_process_owns() -> None:
    """``genengine.engine.ipc.dumps`` (SGLang's payloads) is torch's ForkingPickler for everything but memory opened
    from another process (passed on under the trainer's spare share, checked on the GPU): the same bytes here."""
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch

    from genengine.engine import ipc

    obj = [("w", 1), {"meta": (2, 3.5)}, [torch.dtype, "x"]]
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    assert ipc.dumps(obj) == buf.getvalue()
    assert pickle.loads(ipc.dumps(obj)) == obj


def test_cuda_ipc_handles_come_from_the_environment_and_a_bad_value_names_the_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``$GENENGINE_CUDA_IPC_HANDLES``, read by the sender at each sync before anything is sent."""
    from genengine.engine import ipc
    from genengine.errors import InvalidArgumentError

    monkeypatch.delenv(ipc.HANDLES_ENV, raising=False)
    assert ipc.handles() == "driver"
    monkeypatch.setenv(ipc.HANDLES_ENV, " torch ")
    assert ipc.handles() == "torch"
    monkeypatch.setenv(ipc.HANDLES_ENV, "nvlink")
    with pytest.raises(InvalidArgumentError, match=r"_HANDLES='nvlink': allowed are 'driver', 'torch'"):
        ipc.handles()


# ---- one check of each tensor on each side of a sync (issue 42) ------------------------------------------------
@pytest.mark.parametrize("sessions", [True, False], ids=["load-session", "load_weights-only"])
def test_a_sync_checks_each_tensor_once_on_each_side(sessions: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every check of a tensor's metadata goes through ``genengine.weights._check_data``, and of its values
    through ``check_tensor_finite``: counted per side of a real multi-bucket gloo sync (rank 0 in a thread of
    this process, rank 1 here), each tensor is checked once by the sender (planning; packing checks nothing
    again) and once by the receiver (its load session's write; nothing again before the engine writes it), and
    its values once, by the receiver (``check_finite``). ``load_weights-only``: an engine without load sessions
    (one ``load_weights`` at the commit, each bucket's values checked on arrival)."""
    import threading
    from collections import Counter

    from genengine import weights as weights_module
    from genengine.backends.transformers.engine import TransformersEngine
    from genengine.models.tiny_model import tiny_model_dir

    model = str(tiny_model_dir())
    tw.configure(model)
    stream = tw.trainer_stream("B")  # bf16 and fp32, views at an offset and transposed ones
    spec = TransportSpec(**_spec(world_size=2))
    sent: dict[str, Any] = {}

    def send() -> None:
        try:
            sender = get_transport("gloo").sender(spec)
            try:
                sent["report"] = sender.send(stream, version=4)
            finally:
                sender.close()
        except BaseException as exc:
            sent["error"] = exc

    sender_thread = threading.Thread(target=send, name="rank-0")
    checks: dict[str, list[tuple[str, str]]] = {"data": [], "finite": []}

    def counted(kind: str, real: Any) -> Any:
        def spy(name: str, *args: Any) -> Any:
            side = "sender" if threading.current_thread() is sender_thread else "receiver"
            checks[kind].append((side, name))
            return real(name, *args)

        return spy

    with TransformersEngine(model, dtype="float32") as engine:  # built before the count starts
        monkeypatch.setattr(weights_module, "_check_data", counted("data", weights_module._check_data))
        finite = weights_module.check_tensor_finite
        monkeypatch.setattr(weights_module, "check_tensor_finite", counted("finite", finite))
        sender_thread.start()
        receiver = get_transport("gloo").receiver(spec, 1)
        try:
            target = engine if sessions else types.SimpleNamespace(load_weights=engine.load_weights)  # no sessions
            report = receiver.receive(target, check_finite=True)  # type: ignore[arg-type]
        finally:
            receiver.close()
            sender_thread.join(30)
        assert "error" not in sent, sent
        assert sent["report"].num_buckets > 2 and report.num_tensors == len(stream) and engine.weight_version == 4
    names = Counter(name for name, _ in stream)
    assert max(names.values()) == 1
    for kind, side, want in (
        ("data", "sender", names),
        ("data", "receiver", names),
        ("finite", "sender", Counter()),
        ("finite", "receiver", names),
    ):
        got = Counter(name for s, name in checks[kind] if s == side)
        assert got == want, (kind, side, {n: c for n, c in got.items() if c != want[n]} or set(want) - set(got))


def test_fault_injection_is_read_once_per_sync_when_it_is_planned() -> None:
    """``genengine.transport.faults``: the plan takes the hook's value; packing reads nothing (a fault set while a
    sync is packed applies from the next one), and the flipped byte is after the checksum (the receiver's catches
    it)."""
    import torch

    from genengine.transport import _layout, faults

    stream = [(f"w{i}", torch.full((256,), float(i))) for i in range(4)]
    with faults.injected(corrupt_bucket=1):
        plan = _layout.plan(stream, version=1, bucket_bytes=1024, checksum=True)
    clean = _layout.plan(stream, version=1, bucket_bytes=1024, checksum=True)
    assert len(plan.buckets) == 4 and faults.FAULTS.corrupt_bucket is None
    buf = torch.zeros(plan.buffer_bytes, dtype=torch.uint8)
    with faults.injected(corrupt_bucket=0):
        for k, bucket in enumerate(plan.buckets):
            _layout.pack(plan, k, buf)
            flipped = int(_layout.checksum_of(buf, bucket.nbytes)) != _layout.read_trailer(buf, bucket)[1]
            assert flipped == (k == 1), k
            _layout.pack(clean, k, buf)
            assert int(_layout.checksum_of(buf, bucket.nbytes)) == _layout.read_trailer(buf, bucket)[1], k
    with (
        pytest.raises(TypeError, match=r"unknown fault\(s\) \['corrupt'\]; allowed: \['corrupt_bucket'\]"),
        faults.injected(corrupt=1),
    ):
        pass
