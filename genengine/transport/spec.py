"""What a weight-sync group is (``TransportSpec``), what a sync reports, and the interfaces transports implement.

Imports no torch: a pool can build and check specs in a process that never touches a tensor.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from genengine.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

    from genengine.protocol import GenerationEngine

__all__ = [
    "SyncReport",
    "TransportSpec",
    "WeightReceiver",
    "WeightSender",
    "WeightTransport",
]

_DEVICES = ("cpu", "cuda")
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+)$")


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"TransportSpec {name}={value!r} must be a positive integer")
    return value


@dataclass(frozen=True)
class TransportSpec:
    """How one weight-sync group is formed: rank 0 is the trainer (sender), ranks 1..world_size-1 the replicas.

    Checked when built, so a bad spec is refused before any port, process group or memory is taken.
    """

    transport: str
    """A registered transport name: ``"gloo"``, ``"nccl"``, ``"cuda_ipc"`` or a plugin's."""
    address: str
    """``"host:port"`` of the rendezvous: a ``torch.distributed.TCPStore`` that rank 0 opens."""
    world_size: int
    group_name: str
    """Unique per group: a group formed again after a replica restart gets a new name."""
    timeout_s: float = 60.0
    """Hard timeout of every collective and wait: a dead or stuck peer makes the others raise, never hang."""
    bucket_bytes: int = 512 << 20
    """Bytes of weights per bucket (a larger tensor travels alone); each side holds two buckets' buffers.
    ``cuda_ipc`` counts only what it packs: tensors dense on the trainer's GPU are read in place."""
    checksum: bool = False
    """Per-bucket checksum of the copied bytes: a bucket corrupted on the way raises ChecksumError on the
    receiver, unloaded (``cuda_ipc``'s in-place tensors are not copied)."""
    device: str = "cpu"
    """``"cpu"`` for gloo; ``"cuda"`` (the current CUDA device) for nccl and cuda_ipc."""

    def __post_init__(self) -> None:
        if not isinstance(self.transport, str) or not self.transport:
            raise InvalidArgumentError(f"TransportSpec transport={self.transport!r} must be a transport name")
        self._host_port()
        if _positive_int("world_size", self.world_size) < 2:
            raise InvalidArgumentError(
                f"TransportSpec world_size={self.world_size!r} must be >= 2: rank 0 is the sender, "
                "ranks 1.. the replicas"
            )
        if not isinstance(self.group_name, str) or not self.group_name or "/" in self.group_name:
            raise InvalidArgumentError(
                f"TransportSpec group_name={self.group_name!r} must be a non-empty string without '/'"
            )
        timeout = self.timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not (math.isfinite(timeout) and timeout > 0)
        ):
            raise InvalidArgumentError(f"TransportSpec timeout_s={timeout!r} must be a finite number of seconds > 0")
        _positive_int("bucket_bytes", self.bucket_bytes)
        if not isinstance(self.checksum, bool):
            raise InvalidArgumentError(f"TransportSpec checksum={self.checksum!r} must be True or False")
        if self.device not in _DEVICES:
            raise InvalidArgumentError(f"TransportSpec device={self.device!r}: allowed are {', '.join(_DEVICES)}")

    def _host_port(self) -> tuple[str, int]:
        address = self.address
        allowed = "allowed: 'host:port' with a port in 1..65535, e.g. '10.0.0.1:29600' or '[::1]:29600'"
        if not isinstance(address, str):
            raise InvalidArgumentError(f"TransportSpec address={address!r} is not a string; {allowed}")
        host, sep, port = address.rpartition(":")
        if not sep or not _HOST.match(host) or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise InvalidArgumentError(f"TransportSpec address={address!r}; {allowed}")
        return host.strip("[]"), int(port)

    @property
    def host(self) -> str:
        return self._host_port()[0]

    @property
    def port(self) -> int:
        return self._host_port()[1]


@dataclass(frozen=True)
class SyncReport:
    """What one sync moved, on the side that reports it (the numbers a trainer logs per step)."""

    version: int
    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float


@runtime_checkable
class WeightSender(Protocol):
    """Trainer side, rank 0 of the group."""

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> SyncReport:
        """Send one whole sync; returns once every receiver said it loaded it (raises naming any that did not)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class WeightReceiver(Protocol):
    """Replica side, ranks >= 1, inside the replica's process."""

    def receive(self, engine: GenerationEngine, *, check_finite: bool = False) -> SyncReport:
        """Receive one whole sync into one load session of ``engine`` (``begin_load``, a ``write`` per bucket,
        one ``commit`` with ``version=<the sender's>``: one check, one cache flush and one version change per
        sync; an engine without sessions gets one ``load_weights`` a bucket, or with ``check_finite`` one at the end).
        ``check_finite`` refuses NaN/inf.
        Returns once the sync is committed, or raises TransportError / TransportTimeoutError / ChecksumError
        (the session aborted: the old version stays)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class WeightTransport(Protocol):
    """A registered way to move weights: forms groups and hands out the two ends."""

    name: str

    def sender(self, spec: TransportSpec) -> WeightSender:
        """Rank 0's end; blocks until every rank joined (or raises after ``spec.timeout_s``, naming the absent)."""
        ...

    def receiver(self, spec: TransportSpec, rank: int) -> WeightReceiver:
        """Rank ``rank``'s end (1 <= rank < world_size); blocks until every rank joined."""
        ...
