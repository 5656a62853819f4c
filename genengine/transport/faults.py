"""Fault injection for tests: one module-level object that the built-in transports read once per sync.

A test sets a field before the syncs it wants faulty and clears it after (``injected`` does both), in the
process that runs the sender::

    from genengine.transport import faults

    with faults.injected(corrupt_bucket=1):
        sender.send(stream, version=3)  # bucket 1 arrives corrupted: every receiver raises ChecksumError

The sender takes the fields into the sync's plan when it plans it, so nothing is read per tensor or per
bucket, and a change made during a sync applies from the next one. Nothing in genengine sets them. Imports
nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["FAULTS", "Faults", "injected"]


@dataclass
class Faults:
    """The faults the next syncs inject; the defaults inject none."""

    corrupt_bucket: int | None = None
    """The sender flips a byte of bucket N (an index into the sync's buckets) after computing its checksum, as a
    bad link would: the receivers' checksum (``TransportSpec(checksum=True)``) must catch it."""


FAULTS = Faults()
"""The one hook object the transports read (``_layout.plan``)."""


@contextlib.contextmanager
def injected(**fields: object) -> Iterator[Faults]:
    """Set ``fields`` of :data:`FAULTS` for the block, then restore them (an unknown field raises TypeError)."""
    names = {f.name for f in dataclasses.fields(Faults)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise TypeError(f"unknown fault(s) {unknown}; allowed: {sorted(names)}")
    before = {name: getattr(FAULTS, name) for name in fields}
    for name, value in fields.items():
        setattr(FAULTS, name, value)
    try:
        yield FAULTS
    finally:
        for name, value in before.items():
            setattr(FAULTS, name, value)
