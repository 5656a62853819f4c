"""Weight transports: moving the trainer's weights into replicas in other processes, as plugins.

A transport forms a group of its own per :class:`TransportSpec` (rank 0 the trainer, ranks 1.. the
replicas; never torch.distributed's default group) and hands out a :class:`WeightSender` and
:class:`WeightReceiver` per rank. Built in: ``gloo`` (CPU), ``nccl`` (a GPU per rank), ``cuda_ipc``
(one GPU); plugins add more through the ``register_weight_transports`` hook. Every wait has a hard
timeout, and the errors name the group, the ranks and the timeout. See docs/transports.md.

Importing this package imports no torch.
"""

from __future__ import annotations

from typing import Any

from genengine.transport._trace import ENV as TRACE_ENV
from genengine.transport.errors import (
    ChecksumError,
    DuplicateTransportError,
    TransportError,
    TransportNotFoundError,
    TransportTimeoutError,
)
from genengine.transport.spec import (
    SyncReport,
    TransportSpec,
    WeightReceiver,
    WeightSender,
    WeightTransport,
)

__all__ = [
    "TRACE_ENV",
    "ChecksumError",
    "DuplicateTransportError",
    "SyncReport",
    "TransportError",
    "TransportNotFoundError",
    "TransportSpec",
    "TransportTimeoutError",
    "WeightReceiver",
    "WeightSender",
    "WeightTransport",
    "available_transports",
    "get_transport",
    "open_receiver",
]


def available_transports() -> list[str]:
    """The names of the registered transports (built-in and plugins'), sorted; imports no torch."""
    from genengine.plugins.registry import available_transports as infos

    return [t.name for t in infos() if t.error is None]


def get_transport(name: str) -> WeightTransport:
    """The registered transport ``name``; an unknown name raises TransportNotFoundError listing the registered."""
    from genengine.plugins.registry import get_transport_info, resolve_ref

    info = get_transport_info(name)
    factory: Any = resolve_ref(info.factory)
    transport: WeightTransport = factory()
    return transport


def open_receiver(spec: TransportSpec, rank: int) -> WeightReceiver:
    """Rank ``rank``'s receiver of the transport ``spec`` names: it receives each sync into one load session of
    the engine handed to ``receive`` (a write per bucket, one commit)."""
    return get_transport(spec.transport).receiver(spec, rank)  # an unknown transport is refused first, by name
