"""One weight-sync group: a rendezvous and process groups of its own, and waits that never hang.

The group never touches torch.distributed's default group: rank 0 opens a ``TCPStore`` at ``spec.address``,
every rank builds ``ProcessGroupGloo`` (and, for NCCL, ``ProcessGroupNCCL``) on a ``PrefixStore`` named
after the group and calls the backend objects directly. Joining is a roll call over the store, so every
rank that came raises the same error naming those that did not; every later wait is ``Work.wait(timeout)``
(gloo and NCCL honour it), and a failure names the ranks waited for and those whose processes are gone, and
leaves the group broken: use it no more, form a new one (docs/transports.md, "The group").
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from genengine.distributed.groups import pid_alive
from genengine.distributed.topology import format_ranks
from genengine.transport.errors import TransportError, TransportTimeoutError
from genengine.transport.spec import TransportSpec

if TYPE_CHECKING:
    import torch
    from torch.distributed import Work

__all__ = ["Group"]

_POLL_S = 0.02
_PG_MARGIN_S = 5.0
"""The process groups' own timeout exceeds ours: our ``Work.wait`` fires first, with our message."""
_STATUS_TAG = 0x7753  # p2p tag of the receivers' per-sync status messages


class Group:
    """The process groups of one :class:`TransportSpec`, as rank ``rank`` sees them.

    ``control`` (gloo, CPU) carries metadata and status messages; ``data`` carries the buckets: the same
    gloo group, or a NCCL group when ``nccl`` is set.
    """

    def __init__(self, spec: TransportSpec, rank: int, *, nccl: bool = False) -> None:
        self.spec = spec
        self.rank = rank
        self.broken: str | None = None
        self.peers: dict[int, tuple[str, int]] = {}
        self._store: Any = None
        self._prefix: Any = None
        self.control: Any = None
        self.data: Any = None
        try:
            self._join(nccl)
        except BaseException:
            self.close()
            raise

    # ---- descriptions ---------------------------------------------------------------------------------
    def describe(self, op: str) -> str:
        s = self.spec
        return (
            f"weight-sync group {s.group_name!r} ({s.transport} at {s.address}, this rank {self.rank} of "
            f"world size {s.world_size}, timeout {s.timeout_s:g} s): {op}"
        )

    def dead_ranks(self, ranks: Sequence[int], *, wait_s: float = 0.0) -> list[int]:
        """Those of ``ranks`` whose process is gone, as far as this host can tell (peers on this host)."""
        host = socket.gethostname()
        local = [(r, self.peers[r][1]) for r in ranks if r in self.peers and self.peers[r][0] == host]
        deadline = time.monotonic() + wait_s
        while True:
            dead = [r for r, pid in local if pid != os.getpid() and not pid_alive(pid)]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(_POLL_S)

    def _who(self, ranks: Sequence[int], *, timed_out: bool) -> str:
        dead = self.dead_ranks(ranks, wait_s=0.0 if timed_out else 1.0)
        if dead:
            return f"rank(s) {format_ranks(dead)} died (their processes are gone)"
        who = "the sender (rank 0)" if list(ranks) == [0] else f"rank(s) {format_ranks(ranks)}"
        if timed_out:
            return f"{who} did not arrive in time (stuck elsewhere, diverged, or dead)"
        return f"the connection to {who} broke (a peer failed or closed the group, or died on another host)"

    def fail(self, op: str, ranks: Sequence[int], exc: BaseException | None = None) -> NoReturn:
        """Mark the group broken and raise TransportTimeoutError for ``op``, naming who of ``ranks`` failed."""
        text = " ".join(str(exc).split()) if exc is not None else ""
        timed_out = exc is None or "timed out" in text.lower() or "timeout" in text.lower()
        message = f"{self.describe(op)}: {self._who(ranks, timed_out=timed_out)}"
        if text:
            message += f" ({type(exc).__name__}: {text[:400]})"
        self.broken = message
        self._abort()
        self.close()  # gloo closes a group's connections only once nothing holds it: the peers fail at once
        raise TransportTimeoutError(message) from exc

    def check_usable(self) -> None:
        if self.broken is not None:
            raise TransportError(
                f"weight-sync group {self.spec.group_name!r} is broken and cannot be used again; close it and "
                f"form a new group (a new group_name). It broke on: {self.broken}"
            )

    # ---- forming the group ------------------------------------------------------------------------------
    def _join(self, nccl: bool) -> None:
        from torch.distributed import PrefixStore, TCPStore

        spec = self.spec
        timeout = timedelta(seconds=spec.timeout_s)
        start = time.monotonic()
        try:
            self._store = TCPStore(
                spec.host,
                spec.port,
                None,
                self.rank == 0,
                timeout,
                wait_for_workers=False,
            )
        except Exception as exc:
            text = " ".join(str(exc).split())[:400]
            if self.rank == 0:
                raise TransportError(
                    f"{self.describe('opening the rendezvous')}: cannot listen at {spec.address} ({text}); "
                    "pick a free port on the trainer's host"
                ) from exc
            raise TransportTimeoutError(
                f"{self.describe('joining')}: the sender (rank 0) could not be reached at {spec.address} ({text})"
            ) from exc
        # Only attributes hold the store (close() drops them): an error's traceback must not keep the port bound.
        self._prefix = PrefixStore(f"genengine/transport/{spec.group_name}", self._store)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "transport": spec.transport, "device": spec.device}
        verdict = self._roll_call(me, start) if self.rank == 0 else self._report(me, start)
        if verdict is not None:
            raise verdict
        pg_timeout = timedelta(seconds=spec.timeout_s + _PG_MARGIN_S)
        others = [r for r in range(spec.world_size) if r != self.rank]
        try:
            from torch.distributed import ProcessGroupGloo

            self.control = ProcessGroupGloo(PrefixStore("gloo", self._prefix), self.rank, spec.world_size, pg_timeout)
            self.data = self.control
            if nccl:
                self.data = _nccl_group(PrefixStore("nccl", self._prefix), self.rank, spec.world_size, pg_timeout)
        except Exception as exc:
            self.fail("building the process groups", others, exc)
        if nccl:
            # NCCL creates its communicator lazily, inside the first collective and outside Work.wait's
            # timeout: create it now, while every rank is known to be here.
            import torch

            probe = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
            self.wait(self.broadcast(probe, data=True), "creating the NCCL communicator", others)

    def _roll_call(self, me: dict[str, Any], start: float) -> TransportError | None:
        """Rank 0: wait for every rank's join record, then publish the roster or the error (returned)."""
        spec, store = self.spec, self._prefix
        self.peers = {0: (me["host"], me["pid"])}
        pending = set(range(1, spec.world_size))
        problems: list[str] = []
        deadline = start + spec.timeout_s
        while pending and time.monotonic() < deadline:
            for r in sorted(pending):
                if store.check([f"join/{r}"]):
                    info = json.loads(store.get(f"join/{r}"))
                    pending.discard(r)
                    self.peers[r] = (str(info["host"]), int(info["pid"]))
                    for key in ("transport", "device"):
                        if info[key] != me[key]:
                            problems.append(f"rank {r} joined with {key}={info[key]!r}, the sender has {me[key]!r}")
            if pending:
                time.sleep(_POLL_S)
        if pending:
            message = (
                f"{self.describe('forming the group')}: rank(s) {format_ranks(sorted(pending))} did not join within "
                f"{spec.timeout_s:g} s (joined: {format_ranks(sorted(self.peers))})"
            )
            return self._refuse(message, timeout=True)
        if problems:
            return self._refuse(f"{self.describe('forming the group')}: {'; '.join(problems)}", timeout=False)
        store.set("ready", json.dumps({"peers": {str(r): list(p) for r, p in self.peers.items()}}))
        return None

    def _refuse(self, message: str, *, timeout: bool) -> TransportError:
        """Publish the verdict and give the ranks that came a moment to read it (the store closes with us)."""
        store = self._prefix
        store.set("ready", json.dumps({"error": message, "timeout": timeout}))
        joined = len(self.peers) - 1
        deadline = time.monotonic() + 2.0
        while joined and int(store.add("read", 0)) < joined and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return (TransportTimeoutError if timeout else TransportError)(message)

    def _report(self, me: dict[str, Any], start: float) -> TransportError | None:
        """A receiver: write its join record, wait for rank 0's verdict (returned when it is an error)."""
        spec, store = self.spec, self._prefix
        if store.add(f"count/{self.rank}", 1) > 1:
            return TransportError(
                f"{self.describe('joining')}: rank {self.rank} already joined this group from another process; "
                "every replica needs its own rank"
            )
        store.set(f"join/{self.rank}", json.dumps(me))
        remaining = max(start + spec.timeout_s + 2 * _PG_MARGIN_S - time.monotonic(), 0.1)
        try:
            store.wait(["ready"], timedelta(seconds=remaining))
            ready = json.loads(store.get("ready"))
            store.add("read", 1)
        except Exception as exc:
            return TransportTimeoutError(
                f"{self.describe('joining')}: the sender (rank 0) did not finish forming the group in time "
                f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]})"
            )
        if "error" in ready:
            cls = TransportTimeoutError if ready.get("timeout") else TransportError
            return cls(f"the sender refused the group: {ready['error']}")
        self.peers = {int(r): (str(h), int(p)) for r, (h, p) in ready["peers"].items()}
        return None

    # ---- operations -------------------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, *, data: bool) -> Work:
        """Post a broadcast from rank 0 over the data (or control) group; wait on it with :meth:`wait`."""
        import torch.distributed as dist

        self.check_usable()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        pg = self.data if data else self.control
        return pg.broadcast([tensor], opts)

    def wait(self, work: Work, op: str, ranks: Sequence[int], *, deadline: float | None = None) -> None:
        """Wait for ``work`` at most ``timeout_s`` (or until ``deadline``); on failure name who of ``ranks``."""
        seconds = self.spec.timeout_s if deadline is None else max(deadline - time.monotonic(), 0.05)
        try:
            done = work.wait(timedelta(seconds=seconds))
        except RuntimeError as exc:
            del work  # an error's frames must not keep the failed group alive (see fail)
            self.fail(op, ranks, exc)
        if done is False:
            del work
            self.fail(op, ranks)

    def broadcast_bytes(self, data: bytes | None, op: str) -> bytes:
        """Rank 0's ``data`` on every rank, over the control group (size first, then the bytes)."""
        import torch

        receivers = list(range(1, self.spec.world_size))
        ranks = receivers if self.rank == 0 else [0]
        if self.rank == 0:
            assert data is not None  # internal invariant
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.wait(self.broadcast(size, data=False), op, ranks)
        if self.rank == 0:
            assert data is not None
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
        self.wait(self.broadcast(buf, data=False), op, ranks)
        return data if data is not None else buf.numpy().tobytes()

    def send_status(self, status: Sequence[int], op: str) -> None:
        """A receiver's fixed-size status row (ints) to rank 0."""
        import torch

        self.check_usable()
        row = torch.tensor(list(status), dtype=torch.int64)
        self.wait(self.control.send([row], 0, _STATUS_TAG), op, [0])

    def gather_status(self, width: int, op: str) -> dict[int, list[int]]:
        """Every receiver's status row on rank 0; raises TransportTimeoutError naming the ranks that sent none."""
        import torch

        self.check_usable()
        ranks = list(range(1, self.spec.world_size))
        rows = {r: torch.zeros(width, dtype=torch.int64) for r in ranks}
        works = {r: self.control.recv([rows[r]], r, _STATUS_TAG) for r in ranks}
        deadline = time.monotonic() + self.spec.timeout_s
        missing: list[int] = []
        first: BaseException | None = None
        for r, work in works.items():
            try:
                done = work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.05)))
            except RuntimeError as exc:
                done, first = False, first or exc
            if done is False:
                missing.append(r)
        if missing:
            works.clear()
            self.fail(op, missing, first)
        return {r: row.tolist() for r, row in rows.items()}

    # ---- teardown ---------------------------------------------------------------------------------------
    def _abort(self) -> None:
        """After a failure: abort NCCL at once, so that its watchdog never finds the stuck collective."""
        if self.data is not None and self.data is not self.control:
            with contextlib.suppress(Exception):
                self.data.abort()

    def close(self) -> None:
        for pg in {id(p): p for p in (self.data, self.control) if p is not None}.values():
            with contextlib.suppress(Exception):
                if self.broken is not None:
                    pg.abort()
                else:
                    pg.shutdown()
        self.data = self.control = None
        self._prefix = self._store = None
        if self.broken is None:
            self.broken = "the group was closed"


def _nccl_group(store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
    from torch.distributed import ProcessGroupNCCL  # type: ignore[attr-defined]

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return ProcessGroupNCCL(store, rank, world_size, options)
