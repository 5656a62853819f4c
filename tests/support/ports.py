"""Free TCP ports for the tests' rendezvous, chosen so that two tests running side by side never meet.

A port the kernel hands out for ``bind(0)`` lies in the ephemeral range (32768-60999 on Linux), and
once closed it is free for anyone binding 0: a gloo listener, a Ray worker, or the outgoing side of
a connection. Under ``pytest -n 2`` the other worker does all of those, so a rendezvous port taken
that way can be stolen between choosing it and binding it, and a client retrying against a port
nobody listens on yet can even connect to itself. So tests take ports below the ephemeral range,
where the kernel never hands one out, and each xdist worker draws from its own slice of it.
"""

from __future__ import annotations

import os
import random
import socket

LOW, HIGH = 20000, 32000  # below Linux's default ephemeral range (32768-60999)
_given: set[int] = set()


def _slice() -> tuple[int, int]:
    """This xdist worker's share of ``LOW .. HIGH`` (all of it outside xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    width = (HIGH - LOW) // max(count, 1)
    start = LOW + width * (index % max(count, 1))
    return start, start + width


def _bindable(port: int) -> bool:
    """Free on every interface (a wildcard bind fails while any address holds the port)."""
    try:
        with socket.socket() as s:
            s.bind(("", port))
    except OSError:
        return False
    return True


def free_port_block(n: int = 1) -> int:
    """A base port with ``base .. base + n - 1`` all free, none handed out before in this process."""
    start, stop = _slice()
    for _ in range(500):
        base = random.randrange(start, stop - n)
        block = range(base, base + n)
        if _given.isdisjoint(block) and all(_bindable(p) for p in block):
            _given.update(block)
            return base
    raise RuntimeError(f"no free block of {n} ports in {start}..{stop}")


def free_port() -> int:
    """One free port (see the module docstring for why not ``bind(0)``)."""
    return free_port_block(1)
