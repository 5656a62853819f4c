"""CUDA IPC: the trainer and its replicas on one GPU read the trainer's memory (no broadcast).

A tensor already dense on the trainer's GPU is read where it is: the sender shares it by its IPC handle
(with a spare share when a replica's engine passes the tensors of its loads on to another process: the engine
declares it, ``EngineBase.passes_tensors_on``, and its receiver announces it at the start of each sync; see
``genengine.engine.ipc``) and it
takes no room in a bucket, so a trainer's whole model is one bucket and one engine load, as an in-process load of
the same tensors is. The rest (host tensors, DTensors, views that are not dense) is packed into one of two
CUDA buffers whose handles went out once with the sync's metadata (over the gloo control group, keyed by the
GPU's UUID so that a receiver with another ``CUDA_VISIBLE_DEVICES`` finds the same GPU); then the sender
tells the receivers "bucket k is ready". Each receiver copies bucket k's packed bytes into a buffer of its
own (one device copy), verifies them, loads the bucket, waits for its engine's copies, and acknowledges. The
sender reuses a buffer, and the trainer its tensors, only once every receiver acknowledged (slime's rule:
never overwrite memory the engine may still be reading), packing bucket k+1 in the other buffer meanwhile.
The same bucket layout, checksum (of the packed bytes: shared tensors are not copied) and abort flag as the
broadcast transports.
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from genengine.engine import ipc
from genengine.transport import _layout as layout
from genengine.transport._group import Group
from genengine.transport._trace import Trace
from genengine.transport.broadcast import (
    ABORTED,
    CHECKSUM,
    LOAD_FAILED,
    OK,
    STATUS_WIDTH,
    UNREACHABLE,
    Endpoint,
    SenderBase,
    aborted_error,
    check_rank,
    check_spec,
    checksum_error,
    finish_load,
    open_session,
    raise_failure,
    raise_for_status,
    read_metadata,
    side_stream,
    written,
)
from genengine.transport.errors import TransportError
from genengine.transport.spec import SyncReport, TransportSpec

if TYPE_CHECKING:
    import torch

    from genengine.protocol import GenerationEngine

__all__ = ["CudaIpcTransport"]

log = logging.getLogger(__name__)


def _uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def shareable(device: torch.device) -> Callable[[Any], bool]:
    """Which of the trainer's tensors the receivers read in place: dense tensors with data on ``device``
    (plain tensors and parameters; a DTensor's local shard is not the whole tensor)."""
    import torch

    def share(tensor: Any) -> bool:
        return (
            type(tensor) in (torch.Tensor, torch.nn.Parameter)
            and tensor.device == device
            and tensor.numel() > 0
            and tensor.is_contiguous()
        )

    return share


def _share(bufs: list[torch.Tensor], plan: layout.Plan, spares: bool, handles: str) -> tuple[str, str]:
    """The GPU's UUID, a share of each buffer and of each shared tensor for the receiver (torch's, or with
    ``handles="driver"`` its place in an allocation whose driver handle is in the list: the buffers too, as a
    process opens an allocation once and small ones share an allocation with the trainer's tensors) with, when
    ``spares``, a torch share its engine passes on; as text for the metadata; and the way taken (torch's where
    the driver could not share every allocation)."""
    pairs = [
        (entry.name, tensor)
        for bucket, group in zip(plan.buckets, plan.tensors, strict=True)
        for entry, (_, tensor) in zip(bucket.entries, group, strict=True)
        if entry.shared
    ]
    device = bufs[0].device.index
    every = [*bufs, *(t for _, t in pairs)]
    by_driver = ipc.share_allocations(every, device) if handles == "driver" else None
    if by_driver is None:
        allocations, places = None, [ipc.share(t) for t in every]
    else:
        allocations, places = by_driver
    tensors = {
        name: (places[len(bufs) + i], ipc.share(tensor) if spares else None) for i, (name, tensor) in enumerate(pairs)
    }
    payload = (_uuid(device), places[: len(bufs)], allocations, tensors)
    return base64.b64encode(pickle.dumps(payload)).decode(), "torch" if allocations is None else "driver"


def _open(
    shared: str, group: Group, buckets: list[layout.Bucket], buffer_bytes: int, version: int, pass_on: ipc.PassOn
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], ipc.Opened | None]:
    """The sender's buffers and shared tensors in this process, on the local index of the sender's GPU (and the
    allocations opened by driver handle, if the sender shared those); each shared tensor lent to ``pass_on`` with
    its spare share, if one came. Failing, it leaves nothing counted: torch counts each share until a consumer
    releases it, so the shares it did not open are released here."""
    import torch

    uuid, bufs, allocations, tensors = pickle.loads(base64.b64decode(shared))  # from our own sender
    opened: dict[str, torch.Tensor] = {}
    buffers: list[torch.Tensor] = []
    mapped: ipc.Opened | None = None
    try:
        local = [i for i in range(torch.cuda.device_count()) if _uuid(i) == uuid]
        if not local:
            seen = [_uuid(i) for i in range(torch.cuda.device_count())]
            raise TransportError(
                f"{group.describe('opening the shared buffers')}: cuda_ipc needs the sender and the replica on one "
                f"GPU; the sender's GPU {uuid} is not visible here (visible: {seen}); use the nccl transport"
            )
        fail_at = _fail_open(version)
        if allocations is not None:
            mapped = ipc.Opened(allocations, local[0])
        entries = {e.name: e for b in buckets for e in b.entries if e.shared}
        for name, (own, spare) in tensors.items():
            if len(opened) == fail_at:
                raise TransportError(f"{group.describe('opening the shared tensors')}: failed ({FAIL_OPEN_ENV})")
            if mapped is None:
                tensor, shift = ipc.open_shared(own, local[0]), 0
            else:
                e = entries[name]
                tensor, shift = mapped.view(own, e.dtype, e.shape, e.nbytes), own[2]
            pass_on.lend(tensor, spare, local[0], shift)
            opened[name] = tensor
        for b in bufs:
            nb = buffer_bytes
            buffers.append(ipc.open_shared(b, local[0]) if mapped is None else mapped.view(b, "uint8", (nb,), nb))
        return buffers, opened, mapped
    except BaseException:
        # Every torch share of the payload opened or released once: the spares of what was opened, and the
        # shares of what was not (driver handles count nothing: an allocation closes with its last view).
        pass_on.settle(opened.values())
        ipc.release(spare for name, (_, spare) in tensors.items() if name not in opened)
        if allocations is None:
            ipc.release(own for name, (own, _) in tensors.items() if name not in opened)
            ipc.release(bufs[len(buffers) :])
        opened.clear()
        buffers.clear()
        if mapped is not None:
            mapped.release()
        raise


FAIL_OPEN_ENV = "GENENGINE_CUDA_IPC_FAIL_OPEN"
"""Fault injection for tests: ``VERSION:N`` makes a receiver fail to open the sync of that version after N of its
shared tensors (as a replica on another GPU, or a driver error, does)."""


def _fail_open(version: int) -> int | None:
    at, _, count = os.environ.get(FAIL_OPEN_ENV, "").partition(":")
    return int(count) if at.strip() == str(version) and count.strip().isdigit() else None


ANNOUNCE_WIDTH = 1
"""A receiver's announcement, its first word of each sync (before the sender shares anything): 1 when its engine
passes the tensors of its loads on to another process (``passes_on``), else 0."""


def passes_on(engine: object) -> bool:
    """Whether ``engine`` declares that its loads pass the tensors written to them on to another process
    (``EngineBase.passes_tensors_on``; an engine that declares nothing does not)."""
    return getattr(engine, "passes_tensors_on", False) is True


def _hand_over(session: object, pass_on: ipc.PassOn) -> None:
    """Give the load session the sync's spare shares (an ``EngineBase`` session has ``pass_on``; a session of
    another kind takes none, and its engine must not pass opened memory on)."""
    if session is not None and hasattr(session, "pass_on"):
        session.pass_on = pass_on


class CudaIpcSender(SenderBase):
    def __init__(self, group: Group) -> None:
        super().__init__(group)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> SyncReport:
        import torch

        g = self.group
        trace = Trace("sender")
        g.check_usable()
        # Each receiver's announcement: a second share of each tensor only where an engine passes them on (SGLang
        # loads in its scheduler process; vLLM in the replica's own, which would only release it unused).
        announced = g.gather_status(ANNOUNCE_WIDTH, "waiting for every replica to announce itself for the sync")
        spares = any(row[0] for row in announced.values())
        trace.mark("announce_wait")
        plan, start = self._plan(named_tensors, version, share=shareable(self._device), check=ipc.handles)
        handles = ipc.handles()  # a bad value was refused on every rank by the plan's check
        bufs = self._buffers.get(plan.buffer_bytes)
        trace.mark("plan")
        # a share nobody opens would hold its memory for good
        shared, handles = _share(bufs, plan, spares, handles) if plan.buckets else ("", handles)
        trace.mark("share")
        g.broadcast_bytes(plan.metadata(seq=self._seq, shared=shared), "sending the sync's metadata")
        trace.mark("metadata")
        stream = side_stream(self._device)
        assert stream is not None
        statuses: dict[int, list[int]] = {}
        error: BaseException | None = None

        def pack(k: int) -> None:
            """Bucket k into its buffer on the side stream (marked aborted if packing fails)."""
            nonlocal error
            buf = bufs[k % 2][: plan.buckets[k].nbytes + layout.TRAILER]
            with torch.cuda.stream(stream):
                try:
                    layout.pack(plan, k, buf)
                except Exception as exc:
                    error = exc
                    layout.mark_aborted(buf, plan.buckets[k])

        # Every rank issues the control group's operations in one order: announce k, then the acks of k (a
        # receiver acknowledges k before it waits for k+1; gloo would deadlock on any other order). Bucket
        # k+1 is packed between the two, while the receivers load k: its buffer held bucket k-1, whose acks
        # are in, so no receiver still reads it (slime's rule).
        if plan.buckets:
            pack(0)
        for k, bucket in enumerate(plan.buckets):
            failed_here = error is not None
            trace.next_bucket()
            stream.synchronize()  # the receivers read through IPC, with no stream ordering against ours
            trace.mark("pack_wait")
            notice = torch.tensor([k, int(failed_here)], dtype=torch.int64)  # the abort, for a receiver that
            # could not open the buffers (whose trailers say it too)
            g.wait(g.broadcast(notice, data=False), f"announcing {bucket.describe(k)}", range(1, g.spec.world_size))
            trace.mark("announce")
            if not failed_here and k + 1 < len(plan.buckets):
                pack(k + 1)
            trace.mark("pack_issue")
            got = g.gather_status(STATUS_WIDTH, f"waiting for every replica to load {bucket.describe(k)}")
            trace.mark("ack_wait")
            for rank, row in got.items():
                if rank not in statuses or (statuses[rank][0] == OK and row[0] != OK):
                    statuses[rank] = row  # a replica's first failure is the one to report
            if failed_here:
                break  # bucket k carried the abort flag: every receiver stopped at it
        if not plan.buckets:
            statuses = g.gather_status(STATUS_WIDTH, "waiting for every replica to take the sync")
        if error is not None:
            raise error
        raise_for_status(g, plan, statuses, self._seq)
        report = SyncReport(version, plan.num_tensors, plan.num_bytes, len(plan.buckets), time.perf_counter() - start)
        trace.write(self._seq, report, handles=handles, spares=spares)
        return report

    def close(self) -> None:
        import torch

        super().close()
        torch.cuda.ipc_collect()  # our buffers' memory, once the receivers dropped their handles


class CudaIpcReceiver(Endpoint):
    def receive(self, engine: GenerationEngine, *, check_finite: bool = False) -> SyncReport:
        import torch

        g = self.group
        g.check_usable()
        start = time.perf_counter()
        trace = Trace("receiver")
        g.send_status([int(passes_on(engine))], "announcing this replica for the sync")
        meta = read_metadata(g)
        version: int = meta["version"]
        seq = int(meta["seq"])
        buckets: list[layout.Bucket] = meta["buckets"]
        trace.mark("metadata")
        nbuf = int(meta["buffer_bytes"])
        unreachable = None
        pass_on = ipc.PassOn()  # this sync's spare shares, for the engine to pass its tensors on with
        try:
            opened = _open(meta["shared"], g, buckets, nbuf, version, pass_on) if buckets else ([], {}, None)
            shared, lent, mapped = opened
        except Exception as exc:  # reported in step below: the sender hears of it at once, not at its timeout
            traceback.clear_frames(exc.__traceback__)
            shared, lent, mapped, unreachable = [], {}, None, (UNREACHABLE, 0, exc)
        handles = "torch" if mapped is None else "driver"
        local = self._buffers.get(nbuf) if buckets else []
        trace.mark("open")
        tensors = nbytes = loaded = 0
        session, failure = (None, unreachable) if unreachable else open_session(engine, version, check_finite)
        _hand_over(session, pass_on)
        began = session  # ``session`` is None once committed
        trace.mark("session")
        try:
            for k, bucket in enumerate(buckets):
                trace.next_bucket()
                notice = torch.zeros(2, dtype=torch.int64)
                g.wait(g.broadcast(notice, data=False), f"waiting for {bucket.describe(k)}", [0])
                trace.mark("notice_wait")
                # The packed bytes copied into this process's memory (one device copy: the sender packs the next
                # bucket into the other buffer meanwhile); the shared tensors are read where the trainer has them.
                buf = local[k % 2][: bucket.nbytes + layout.TRAILER]
                if shared:
                    buf.copy_(shared[k % 2][: bucket.nbytes + layout.TRAILER])
                    flag, expected = layout.read_trailer(buf, bucket)
                else:  # nothing opened (its failure is what this receiver reports): the notice says an abort
                    flag, expected = (layout.FLAG_ABORT if int(notice[1]) else layout.FLAG_OK), 0
                trace.mark("copy")
                if flag == layout.FLAG_ABORT:
                    failure = failure or (ABORTED, k, aborted_error(g, version, bucket, k, written(session, loaded)))
                    if mapped is not None:  # closed before the sender hears of it (it lets go of its tensors)
                        _release(mapped, g, lent, shared, pass_on)
                        mapped = None
                    g.send_status([ABORTED, k, seq], "acknowledging the abort")
                    break
                if (
                    failure is None
                    and meta["checksum"]
                    and int(layout.checksum_of(buf, bucket.nbytes).item()) != expected
                ):
                    failure = (CHECKSUM, k, checksum_error(g, version, bucket, k, written(session, loaded)))
                trace.mark("checksum")
                if failure is None and session is not None:
                    try:
                        session.write(bucket.views(buf, lent))
                        trace.mark("write")
                        torch.cuda.synchronize()  # the engine's copies have read the buffer before we ack
                        trace.mark("write_sync")
                        loaded += 1
                        tensors += len(bucket.entries)
                        nbytes += sum(e.nbytes for e in bucket.entries)
                    except Exception as exc:
                        traceback.clear_frames(exc.__traceback__)  # its frames' locals hold the trainer's memory
                        failure = (LOAD_FAILED, k, exc)
                if k == len(buckets) - 1 and failure is None:
                    # The commit (the one cache flush, the version) before the last ack: the sender returns
                    # once every replica acknowledged, with the sync in force everywhere.
                    failure = finish_load(session, None, len(buckets))
                    session = None
                    trace.mark("commit")
                # spare shares not passed on (none opened when this receiver could not open the sync)
                pass_on.settle(lent.pop(e.name) for e in bucket.entries if e.shared and e.name in lent)
                if mapped is not None and k == len(buckets) - 1:
                    _release(mapped, g, lent, shared, pass_on)
                    mapped = None
                trace.mark("release")  # the last references to the bucket's opened tensors: their handles close
                code, at = (failure[0], failure[1]) if failure else (OK, k)
                g.send_status([code, at, seq], f"acknowledging {bucket.describe(k)}")
                trace.mark("ack")
            if session is not None:
                failure = finish_load(session, failure, len(buckets))
            if not buckets:
                code, at = (failure[0], failure[1]) if failure else (OK, -1)
                g.send_status([code, at, seq], "acknowledging the sync")
        except BaseException as exc:  # the group failed mid-sync (a dead peer, a timeout): the load ends with it
            if session is not None:
                session.abort(exc)
            raise
        finally:
            pass_on.settle(lent.values())
            del shared, lent  # drop our references to the sender's memory
            if mapped is not None:
                _release(mapped, g, {}, [], pass_on)  # lent and shared dropped above
        if failure is not None:
            raise_failure(failure, written(began, loaded))
        report = SyncReport(version, tensors, nbytes, loaded, time.perf_counter() - start)
        trace.write(seq, report, handles=handles, passed_on=pass_on.passed)
        return report


def _release(
    mapped: ipc.Opened,
    group: Group,
    lent: dict[str, torch.Tensor],
    shared: list[torch.Tensor],
    pass_on: ipc.PassOn,
) -> None:
    """Drop the views left (``lent``, emptied; the buffers ``shared``) and let the allocations opened by driver
    handle close: nothing counts those handles, so one still open when the receiver acknowledges holds the
    trainer's memory (the trainer may free it meanwhile)."""
    pass_on.settle(lent.values())
    lent.clear()
    del shared[:]
    left = mapped.release()
    if left:
        log.warning(
            "%s: %d allocation(s) of the trainer's memory stay open after the sync: something kept a tensor the "
            "engine loaded from (the trainer must not free that memory before the engine lets go of it)",
            group.describe("receive"),
            left,
        )


class CudaIpcTransport:
    """The trainer and its replicas on one GPU (colocated): buckets shared through CUDA IPC handles."""

    name = "cuda_ipc"
    device = "cuda"

    def sender(self, spec: TransportSpec) -> CudaIpcSender:
        check_spec(spec, self.name, self.device)
        return CudaIpcSender(Group(spec, 0))

    def receiver(self, spec: TransportSpec, rank: int) -> CudaIpcReceiver:
        check_spec(spec, self.name, self.device)
        return CudaIpcReceiver(Group(spec, check_rank(spec, rank)))

    def __repr__(self) -> str:
        return "CudaIpcTransport()"
