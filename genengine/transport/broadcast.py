"""Broadcast transports: rank 0 broadcasts each bucket to every replica over gloo (CPU) or NCCL (GPU).

One code path for both: the metadata goes over the gloo control group, the buckets over the data group
(the same gloo group, or NCCL), so the CPU tests of "gloo" cover the logic that "nccl" runs on GPUs.

Double-buffered on both sides: the sender packs bucket k+1 into one buffer while bucket k is in flight
from the other (on CUDA on a side stream, so the copies overlap NCCL's); a receiver has bucket k+1 in
flight into one buffer while it loads bucket k from the other into its engine.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

from genengine.errors import InvalidArgumentError
from genengine.protocol import LoadReport, SupportsLoadSessions, WeightLoadSession
from genengine.transport import _layout as layout
from genengine.transport._group import Group
from genengine.transport._trace import Trace
from genengine.transport.errors import ChecksumError, TransportError
from genengine.transport.spec import SyncReport, TransportSpec

if TYPE_CHECKING:
    import torch
    from torch.distributed import Work

    from genengine.protocol import GenerationEngine

__all__ = ["GlooTransport", "NcclTransport", "check_rank", "check_version"]

# A receiver's status after a sync: (code, bucket, sync number).
STATUS_WIDTH = 3
OK, CHECKSUM, LOAD_FAILED, ABORTED, UNREACHABLE = 0, 1, 2, 3, 4
_CODES = {
    CHECKSUM: "checksum mismatch",
    LOAD_FAILED: "its engine failed to load it",
    ABORTED: "saw the abort",
    UNREACHABLE: "could not open the trainer's shared memory",
}


def check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidArgumentError(f"version={version!r} must be an integer >= 0")
    return version


def check_rank(spec: TransportSpec, rank: object) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank < spec.world_size:
        raise InvalidArgumentError(
            f"receiver rank={rank!r} must be an integer in 1..{spec.world_size - 1} (rank 0 is the sender; "
            f"world_size={spec.world_size})"
        )
    return rank


def check_spec(spec: TransportSpec, name: str, device: str) -> None:
    """Before any port or process group: the spec is for this transport, on its device, and CUDA is there."""
    if not isinstance(spec, TransportSpec):
        raise InvalidArgumentError(f"spec={spec!r} is not a genengine.transport.TransportSpec")
    if spec.transport != name:
        raise InvalidArgumentError(f"the {name!r} transport got a spec for transport={spec.transport!r}")
    if spec.device != device:
        raise InvalidArgumentError(f"transport {name!r} moves {device} tensors; the spec has device={spec.device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise TransportError(f"transport {name!r} needs a CUDA device; torch sees none")


class _PerBucketLoads:
    """The load session of an engine that has only ``load_weights``: one call a bucket, the last (empty) one
    carrying the version. Each call checks and flushes on its own; engines with ``begin_load`` avoid that.

    With ``check_finite`` nothing reaches the engine before the whole sync arrived finite: each bucket is checked
    as it arrives and held (a host copy: the transport reuses its buffers), and the commit loads them in one
    ``load_weights``. One bucket a call would have loaded the buckets before a NaN, and an engine without
    sessions cannot refuse to serve that mix: it would serve it under the old version."""

    def __init__(self, engine: GenerationEngine, check_finite: bool, version: int) -> None:
        self._engine, self._check_finite, self._version = engine, check_finite, version
        self._reports: list[LoadReport] = []
        self._held: list[tuple[str, torch.Tensor]] | None = [] if check_finite else None

    @property
    def holds_writes(self) -> bool:
        """Whether the buckets written so far are held here, none of them in the engine yet."""
        return self._held is not None

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self._held is None:
            self._reports.append(self._engine.load_weights(named_tensors, check_finite=self._check_finite))
            return
        from genengine.weights import check_tensor_finite

        pairs = list(named_tensors)
        for name, tensor in pairs:
            check_tensor_finite(name, tensor)
        self._held.extend((name, tensor.detach().to("cpu", copy=True)) for name, tensor in pairs)

    def commit(self) -> LoadReport:
        if self._held is not None:
            held, self._held = self._held, None  # from here on the engine may hold part of it
            # each tensor's values were checked on arrival, and these host copies are ours: not read again
            one = self._engine.load_weights(held, version=self._version)
            return LoadReport(one.num_tensors, one.num_bytes, 1 if held else 0, one.seconds)
        self._engine.load_weights([], version=self._version)
        r = self._reports
        return LoadReport(sum(x.num_tensors for x in r), sum(x.num_bytes for x in r), len(r), sum(x.seconds for x in r))

    def abort(self, exc: BaseException | None = None) -> None:
        if self._held is not None:
            self._held.clear()  # nothing of the sync reached the engine
        # otherwise each bucket's load_weights already settled the engine's state

    def __enter__(self) -> _PerBucketLoads:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return


def begin_load(engine: GenerationEngine, version: int, check_finite: bool) -> WeightLoadSession:
    """The sync's load session on ``engine``: its own ``begin_load`` (one check, one flush and the version at
    the commit), or for an engine without sessions one ``load_weights`` a bucket."""
    if isinstance(engine, SupportsLoadSessions):
        return engine.begin_load(check_finite=check_finite, version=version)
    return _PerBucketLoads(engine, check_finite, version)


def written(session: WeightLoadSession | None, loaded: int) -> int:
    """How many of the ``loaded`` buckets reached the engine: none while the session holds them for its commit."""
    return 0 if getattr(session, "holds_writes", False) else loaded


def open_session(
    engine: GenerationEngine, version: int, check_finite: bool
) -> tuple[WeightLoadSession | None, tuple[int, int, BaseException] | None]:
    """A receiver's first step: the sync's load session, or the failure to report for bucket 0 (the receiver
    then drains the sync in step with the sender and loads nothing)."""
    try:
        return begin_load(engine, version, check_finite), None
    except Exception as exc:
        return None, (LOAD_FAILED, 0, exc)


def finish_load(
    session: WeightLoadSession | None, failure: tuple[int, int, BaseException] | None, num_buckets: int
) -> tuple[int, int, BaseException] | None:
    """A sync's end on a receiver: commit the session (its one flush and the version), or abort it with the
    sync's failure; returns the failure, a failed commit's included."""
    if session is None:
        return failure
    if failure is not None:
        session.abort(failure[2])
        return failure
    try:
        session.commit()
    except Exception as exc:
        return (LOAD_FAILED, max(num_buckets - 1, 0), exc)
    return None


def device_of(spec: TransportSpec) -> torch.device:
    import torch

    if spec.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Buffers:
    """Two reusable flat byte buffers on one device, grown when a sync needs more."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: list[torch.Tensor] = []

    def get(self, nbytes: int) -> list[torch.Tensor]:
        import torch

        if not self._bufs or self._bufs[0].numel() < nbytes:
            self._bufs = []  # free the old pair first
            self._bufs = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._bufs

    def clear(self) -> None:
        self._bufs = []


def side_stream(device: torch.device) -> Any:
    """A CUDA stream that has waited for the current one (the trainer's writes), or None on CPU."""
    import torch

    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


@contextlib.contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    import torch

    if stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def plan_or_refuse(
    group: Group,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    version: int,
    seq: int,
    share: Callable[[Any], bool] | None = None,
    check: Callable[[], object] | None = None,
) -> layout.Plan:
    """The sync's plan; a stream the checks refuse (or the sender's own ``check``) is refused on every rank
    (receivers raise at once)."""
    spec = group.spec
    try:
        if check is not None:
            check()
        return layout.plan(
            named_tensors, version=version, bucket_bytes=spec.bucket_bytes, checksum=spec.checksum, share=share
        )
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        group.broadcast_bytes(json.dumps({"error": reason, "seq": seq}).encode(), "refusing the sync")
        raise


def raise_for_status(group: Group, plan: layout.Plan, statuses: dict[int, list[int]], seq: int) -> None:
    problems = []
    for rank, row in sorted(statuses.items()):
        code, bucket, their_seq = row[:STATUS_WIDTH]
        if their_seq != seq:
            problems.append(f"rank {rank} answered for sync {their_seq}, not this one ({seq}): out of step")
        elif code != OK:
            where = plan.buckets[bucket].describe(bucket) if 0 <= bucket < len(plan.buckets) else f"bucket {bucket}"
            problems.append(f"rank {rank}: {_CODES.get(code, f'status {code}')} at {where}")
    if problems:
        raise TransportError(
            f"{group.describe(f'sync of version {plan.version}')}: not every replica loaded it; "
            + "; ".join(problems)
            + " (each replica's own error says more); those replicas keep their old version, and one that had a"
            " bucket written refuses to generate until a sync lands whole (an engine without load sessions may"
            " hold a mix): sync again"
        )


def read_metadata(group: Group) -> dict[str, Any]:
    """A receiver's first step of a sync: the sender's metadata, or the sender's refusal raised here."""
    meta = layout.Plan.parse(group.broadcast_bytes(None, "waiting for the sync's metadata"))
    if "error" in meta:
        raise TransportError(f"{group.describe('receive')}: the sender refused this sync: {meta['error']}")
    return meta


_AFTER = (
    "written, so the load was aborted: with any written the engine refuses to generate until a whole sync lands "
    "(its version stays the old one); sync again"
)


def aborted_error(group: Group, version: int, bucket: layout.Bucket, k: int, loaded: int) -> TransportError:
    return TransportError(
        f"{group.describe('receive')}: the sender aborted the sync of version {version} at "
        f"{bucket.describe(k)} (its error is raised on the trainer); {loaded} earlier bucket(s) were "
        f"{_AFTER}"
    )


def checksum_error(group: Group, version: int, bucket: layout.Bucket, k: int, loaded: int) -> ChecksumError:
    return ChecksumError(
        f"{group.describe('receive')}: {bucket.describe(k)} of the sync of version {version} arrived "
        f"corrupted (its checksum differs from the sender's); nothing of it was loaded, nor of any later "
        f"bucket. {loaded} earlier bucket(s) were {_AFTER}"
    )


def raise_failure(failure: tuple[int, int, BaseException], loaded: int) -> NoReturn:
    """A receiver's failed sync: its error, telling how many buckets landed (a pool keeps a mix out of traffic)."""
    with contextlib.suppress(Exception):
        failure[2].buckets_loaded = loaded  # type: ignore[attr-defined]
    raise failure[2]


class Endpoint:
    """What either end of a bucketed sync holds: its group and two bucket buffers on the spec's device."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self._device = device_of(group.spec)
        self._buffers = _Buffers(self._device)

    def close(self) -> None:
        self._buffers.clear()
        self.group.close()


class SenderBase(Endpoint):
    """A sender: an endpoint that numbers its syncs and starts each one the same way."""

    def __init__(self, group: Group) -> None:
        super().__init__(group)
        self._seq = 0

    def _plan(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        share: Callable[[Any], bool] | None = None,
        check: Callable[[], object] | None = None,
    ) -> tuple[layout.Plan, float]:
        """The sync's plan (refused on every rank in step when the tensors are bad, or ``check`` raises) and its
        start time; ``share`` picks the tensors the receivers read in place (``layout.plan``)."""
        self.group.check_usable()
        check_version(version)
        start = time.perf_counter()
        self._seq += 1
        return plan_or_refuse(self.group, named_tensors, version, self._seq, share, check), start


class BroadcastSender(SenderBase):
    """Rank 0's end of a broadcast group."""

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> SyncReport:
        g = self.group
        trace = Trace("sender")
        plan, start = self._plan(named_tensors, version)
        trace.mark("plan")
        receivers = list(range(1, g.spec.world_size))
        g.broadcast_bytes(plan.metadata(seq=self._seq), "sending the sync's metadata")
        bufs = self._buffers.get(plan.buffer_bytes)
        stream = side_stream(self._device)
        trace.mark("metadata")
        pending: deque[tuple[int, Work]] = deque()
        error: BaseException | None = None
        try:
            for k, bucket in enumerate(plan.buckets):
                trace.next_bucket()
                if len(pending) == 2:  # the buffer about to be packed is still in flight
                    done = pending[0][0]
                    g.wait(pending.popleft()[1], f"broadcasting {plan.buckets[done].describe(done)}", receivers)
                trace.mark("buffer_wait")
                buf = bufs[k % 2][: bucket.nbytes + layout.TRAILER]
                with on_stream(stream):
                    try:
                        layout.pack(plan, k, buf)
                    except Exception as exc:  # e.g. a DTensor gather failing: stop every rank here, in step
                        error = exc
                        layout.mark_aborted(buf, bucket)
                    trace.mark("pack")
                    pending.append((k, g.broadcast(buf, data=True)))
                trace.mark("broadcast")
                if error is not None:
                    break
            trace.next_bucket()
            while pending:
                done = pending[0][0]
                g.wait(pending.popleft()[1], f"broadcasting {plan.buckets[done].describe(done)}", receivers)
        except BaseException:
            pending.clear()  # the group is broken: nothing here may keep its process groups (and connections) alive
            raise
        if stream is not None:
            stream.synchronize()
        trace.mark("drain")
        statuses = g.gather_status(STATUS_WIDTH, "waiting for every replica to load the sync")
        trace.mark("status_wait")
        if error is not None:
            raise error
        raise_for_status(g, plan, statuses, self._seq)
        report = SyncReport(version, plan.num_tensors, plan.num_bytes, len(plan.buckets), time.perf_counter() - start)
        trace.write(self._seq, report)
        return report


class BroadcastReceiver(Endpoint):
    """A replica's end of a broadcast group."""

    def receive(self, engine: GenerationEngine, *, check_finite: bool = False) -> SyncReport:
        g = self.group
        g.check_usable()
        start = time.perf_counter()
        trace = Trace("receiver")
        meta = read_metadata(g)
        version: int = meta["version"]
        buckets: list[layout.Bucket] = meta["buckets"]
        bufs = self._buffers.get(int(meta["buffer_bytes"]))
        slices = [bufs[k % 2][: b.nbytes + layout.TRAILER] for k, b in enumerate(buckets)]
        works: dict[int, Work] = {}
        if buckets:
            works[0] = g.broadcast(slices[0], data=True)
        trace.mark("metadata")
        tensors = nbytes = loaded = 0
        session, failure = open_session(engine, version, check_finite)
        trace.mark("session")
        try:
            for k, bucket in enumerate(buckets):
                trace.next_bucket()
                g.wait(works.pop(k), f"receiving {bucket.describe(k)} of {len(buckets)}", [0])
                trace.mark("receive_wait")
                flag, expected = layout.read_trailer(slices[k], bucket)
                if flag == layout.FLAG_ABORT:
                    failure = failure or (ABORTED, k, aborted_error(g, version, bucket, k, written(session, loaded)))
                    break
                if k + 1 < len(buckets):
                    works[k + 1] = g.broadcast(slices[k + 1], data=True)  # in flight while bucket k loads
                if failure is not None or session is None:
                    continue  # drain the sync, in step with the sender, but load nothing more
                if meta["checksum"]:
                    actual = int(layout.checksum_of(slices[k], bucket.nbytes).item())
                    trace.mark("checksum")
                    if actual != expected:
                        failure = (CHECKSUM, k, checksum_error(g, version, bucket, k, written(session, loaded)))
                        continue
                try:
                    session.write(bucket.views(slices[k]))
                except Exception as exc:
                    failure = (LOAD_FAILED, k, exc)
                    continue
                trace.mark("write")
                loaded += 1
                tensors += len(bucket.entries)
                nbytes += sum(e.nbytes for e in bucket.entries)
            trace.next_bucket()
            failure = finish_load(session, failure, len(buckets))
            trace.mark("commit")
        except BaseException as exc:  # the group failed mid-sync (a dead peer, a timeout): the load ends with it
            if session is not None:
                session.abort(exc)
            raise
        code, at = (failure[0], failure[1]) if failure else (OK, -1)
        g.send_status([code, at, int(meta["seq"])], "reporting the sync's outcome to the sender")
        trace.mark("status")
        if failure is not None:
            raise_failure(failure, written(session, loaded))  # after the commit: a held sync reached it there
        report = SyncReport(version, tensors, nbytes, loaded, time.perf_counter() - start)
        trace.write(int(meta["seq"]), report)
        return report


class _BroadcastTransport:
    name: str
    device: str
    nccl: bool

    def sender(self, spec: TransportSpec) -> BroadcastSender:
        check_spec(spec, self.name, self.device)
        return BroadcastSender(Group(spec, 0, nccl=self.nccl))

    def receiver(self, spec: TransportSpec, rank: int) -> BroadcastReceiver:
        check_spec(spec, self.name, self.device)
        return BroadcastReceiver(Group(spec, check_rank(spec, rank), nccl=self.nccl))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class GlooTransport(_BroadcastTransport):
    """CPU tensors over gloo: trainers and replicas without GPUs, and the CPU tests of the protocol."""

    name = "gloo"
    device = "cpu"
    nccl = False


class NcclTransport(_BroadcastTransport):
    """CUDA tensors broadcast over NCCL from the trainer's GPU to each replica's (distinct) GPU."""

    name = "nccl"
    device = "cuda"
    nccl = True
