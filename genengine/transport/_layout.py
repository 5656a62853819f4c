"""The wire format of a sync, shared by every built-in transport: a plan of buckets, packing, unpacking.

A sync is a JSON metadata record (version, names, dtypes, shapes, each tensor's byte offset in its
bucket), then one flat ``uint8`` buffer per bucket: each tensor's bytes at a 64-byte aligned offset
(so that the receiver's ``view(dtype)`` is legal and bf16 travels bit for bit), then a 16-byte trailer
of two int64 words: the checksum (the sum of the data viewed as int64 words, wrapping, computed where the
buffer lives) and a flag (1: the sender aborted the sync here). A transport that lets the receivers read
some tensors where they are (``cuda_ipc``: the trainer's own memory) marks those entries ``shared``: they
take no room in the buffer and cost nothing towards the bucket's size, so they load with the bucket they
fall in, the checksum covering the copied bytes alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from genengine.transport.faults import FAULTS
from genengine.weights import check_stream, group_buckets, materialize, tensor_nbytes

if TYPE_CHECKING:
    import torch

__all__ = ["ALIGN", "TRAILER", "Bucket", "Entry", "Plan"]

ALIGN = 64
TRAILER = 16

FLAG_OK, FLAG_ABORT = 0, 1


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    """torch's name without the ``torch.`` prefix, e.g. ``bfloat16``."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the bucket's buffer (-1 for a shared entry, which has none)."""
    nbytes: int
    shared: bool = False
    """Read by the receivers where the sender holds it (the transport hands them the tensor), not copied."""


@dataclass(frozen=True)
class Bucket:
    entries: tuple[Entry, ...]
    nbytes: int
    """Data bytes in the buffer (aligned; shared entries have none); the trailer follows."""

    def describe(self, index: int) -> str:
        names = [e.name for e in self.entries]
        shown = ", ".join(repr(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        return f"bucket {index} ({len(names)} tensor(s): {shown})"

    def views(self, buf: torch.Tensor, shared: dict[str, torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors in order: views of ``buf``, and the shared entries from ``shared``. No copy."""
        import torch

        out = []
        for e in self.entries:
            if e.shared:
                if shared is None or e.name not in shared:
                    raise ValueError(f"tensor {e.name!r} is shared by the sender, and its handle did not arrive")
                out.append((e.name, shared[e.name]))
                continue
            dtype = getattr(torch, e.dtype, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"tensor {e.name!r} arrived with dtype {e.dtype!r}, which is not a torch dtype")
            out.append((e.name, buf[e.offset : e.offset + e.nbytes].view(dtype).view(e.shape)))
        return out


@dataclass
class Plan:
    """The sender's plan of one sync: its buckets and, for each, the trainer's (checked) tensors."""

    version: int
    checksum: bool
    buckets: list[Bucket]
    tensors: list[list[tuple[str, torch.Tensor]]]
    corrupt_bucket: int | None = None
    """Fault injection for tests (``genengine.transport.faults``, read when the sync is planned): ``pack``
    flips a byte of this bucket after its checksum."""

    @property
    def buffer_bytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0) + TRAILER

    @property
    def num_tensors(self) -> int:
        return sum(len(b.entries) for b in self.buckets)

    @property
    def num_bytes(self) -> int:
        return sum(e.nbytes for b in self.buckets for e in b.entries)

    def metadata(self, **extra: Any) -> bytes:
        record = {
            "version": self.version,
            "checksum": self.checksum,
            "buffer_bytes": self.buffer_bytes,
            "buckets": [
                {
                    "nbytes": b.nbytes,
                    "entries": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes, e.shared] for e in b.entries],
                }
                for b in self.buckets
            ],
            **extra,
        }
        return json.dumps(record).encode()

    @staticmethod
    def parse(data: bytes) -> dict[str, Any]:
        record: dict[str, Any] = json.loads(data.decode())
        if "buckets" in record:
            record["buckets"] = [
                Bucket(
                    tuple(Entry(n, d, tuple(s), int(o), int(nb), bool(sh)) for n, d, s, o, nb, sh in b["entries"]),
                    int(b["nbytes"]),
                )
                for b in record["buckets"]
            ]
        return record


def plan(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    bucket_bytes: int,
    checksum: bool,
    share: Callable[[Any], bool] | None = None,
) -> Plan:
    """Check the trainer's stream and lay it out in buckets, reading no tensor data.

    ``share`` (a transport's) says which tensors the receivers read where they are: those are ``shared``
    entries, with no bytes in the buffer and no cost towards ``bucket_bytes``.

    The stream's pairs are pulled first (references only; DTensors are gathered later, one bucket at a time),
    because the receivers get the whole layout before the first bucket. Then the sender's one check of each
    tensor (``genengine.weights.check_stream``: ``load_weights``' checks that need no engine: kinds with data,
    floating dtypes, no name twice), so a bad tensor is refused before anything is sent; ``pack`` checks
    nothing again (no trainer code runs in between), and each receiver's load session checks the names and
    shapes against its engine.
    """
    if isinstance(named_tensors, dict):
        named_tensors = named_tensors.items()
    checked = check_stream(list(named_tensors))
    shared = share or (lambda _: False)
    groups = list(group_buckets(checked, bucket_bytes, cost=lambda t: 0 if shared(t) else _aligned(tensor_nbytes(t))))
    buckets = []
    for group in groups:
        entries, offset = [], 0
        for name, tensor in group:
            nbytes = tensor_nbytes(tensor)
            dtype = str(tensor.dtype).removeprefix("torch.")
            if shared(tensor):
                entries.append(Entry(name, dtype, tuple(tensor.shape), -1, nbytes, True))
                continue
            entries.append(Entry(name, dtype, tuple(tensor.shape), offset, nbytes))
            offset += _aligned(nbytes)
        buckets.append(Bucket(tuple(entries), offset))
    return Plan(version, checksum, buckets, groups, FAULTS.corrupt_bucket)


def pack(plan_: Plan, index: int, buf: torch.Tensor) -> None:
    """Bucket ``index``'s tensors into ``buf`` (on ``buf``'s device, the current stream), then its trailer.

    The tensors were checked by ``plan``; here they are only gathered (DTensors) and made contiguous."""
    import torch

    bucket = plan_.buckets[index]
    with torch.no_grad():
        ready = materialize(plan_.tensors[index])
        for (_, tensor), entry in zip(ready, bucket.entries, strict=True):
            if entry.nbytes and not entry.shared:
                src = tensor.reshape(-1).view(torch.uint8)
                buf[entry.offset : entry.offset + entry.nbytes].copy_(src, non_blocking=True)
        trailer = buf[bucket.nbytes : bucket.nbytes + TRAILER].view(torch.int64)
        if plan_.checksum:
            trailer[0:1].copy_(checksum_of(buf, bucket.nbytes).reshape(1))
        else:
            trailer[0] = 0
        trailer[1] = FLAG_OK
        if plan_.corrupt_bucket == index and bucket.nbytes:
            buf[0:1].bitwise_xor_(0x5A)


def mark_aborted(buf: torch.Tensor, bucket: Bucket | None) -> None:
    import torch

    end = bucket.nbytes if bucket is not None else 0
    buf[end : end + TRAILER].view(torch.int64)[1] = FLAG_ABORT


def checksum_of(buf: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The sum of ``buf[:nbytes]`` as int64 words (wrapping): a 0-d tensor on ``buf``'s device (no sync).

    Summed in the words' own dtype: an int64 sum of int32 words makes torch cast the whole bucket to int64
    first, a copy twice its size (docs/benchmarks-history.md has the figures). ``nbytes`` is a multiple of ``ALIGN``,
    and any one changed byte changes the sum.
    """
    import torch

    return buf[:nbytes].view(torch.int64).sum()


def read_trailer(buf: torch.Tensor, bucket: Bucket) -> tuple[int, int]:
    """(flag, sender's checksum) of a received bucket (one device sync on CUDA)."""
    import torch

    words = buf[bucket.nbytes : bucket.nbytes + TRAILER].view(torch.int64).tolist()
    return int(words[1]), int(words[0])
