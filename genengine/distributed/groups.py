"""TP process groups and the collectives that move data inside them, each with a deadline.

:func:`engine_group` builds (once per ``tp_size``) the TP process groups and returns an
:class:`EngineGroup` whose helpers move data inside a group: outputs broadcast from the leader, weight
handles gathered to it, inputs checked for equality, all with a deadline so that a dead or diverged rank
raises :class:`~genengine.errors.CollectiveTimeoutError` instead of hanging the job.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import socket
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from genengine.distributed.digests import input_digest
from genengine.distributed.topology import (
    DEFAULT_BASE_PORT,
    Topology,
    format_ranks,
    port_problem,
    topology_from_env,
    torch_dist,
)
from genengine.errors import (
    CollectiveTimeoutError,
    DistributedSetupError,
    InconsistentInputsError,
    InvalidArgumentError,
)

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup, Work

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "TIMEOUT_ENV",
    "EngineGroup",
    "clear_group_cache",
    "default_collective_timeout_s",
    "engine_group",
]

T = TypeVar("T")

#: torch's own default for gloo groups: long, because non-leaders wait in a broadcast while the leader
#: generates, and a rollout can take minutes.
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0
TIMEOUT_ENV = "GENENGINE_COLLECTIVE_TIMEOUT_S"

# Status codes of the roll call (see EngineGroup._roll_call).
_OK, _MISSING, _DIFFERS, _OUT_OF_STEP = 0, 1, 2, 3
_ROLL_CALL_TAG = 0x67656E  # p2p tags live in their own gloo slot space, apart from collectives'


# --- timeouts --------------------------------------------------------------------------------------------
def _check_timeout(value: object, source: str) -> float:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{source} must be a number of seconds > 0; got {value!r}") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise InvalidArgumentError(f"{source} must be a finite number of seconds > 0; got {value!r}")
    return seconds


def default_collective_timeout_s() -> float:
    """``$GENENGINE_COLLECTIVE_TIMEOUT_S`` if set, else :data:`DEFAULT_COLLECTIVE_TIMEOUT_S`."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    return _check_timeout(raw, TIMEOUT_ENV)


# --- process groups --------------------------------------------------------------------------------------
# Built once per tp_size for the current default group; replaced when the trainer re-initialises
# torch.distributed (vLLM's external_launcher destroys the default group at shutdown).
_GROUP_CACHE: dict[str, Any] = {"world": None, "by_tp": {}}


def clear_group_cache() -> None:
    """Forget cached TP groups (``destroy_process_group`` already freed them); the next call rebuilds."""
    _GROUP_CACHE["world"] = None
    _GROUP_CACHE["by_tp"] = {}


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host still runs (an exited, unreaped zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return True  # no /proc (not Linux): the signal check said it exists
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X")


def _device_backend() -> str:
    """NCCL when the trainer's default group uses it (e.g. ``"nccl"``, ``"cpu:gloo,cuda:nccl"``), else gloo.

    Following the trainer rather than ``torch.cuda.is_available()`` keeps a gloo world gloo on a GPU host.
    """
    return "nccl" if "nccl" in str(torch_dist().get_backend()).lower() else "gloo"


def _tp_groups(topo: Topology, timeout_s: float) -> tuple[Any, Any, str, tuple[tuple[str, int], ...]]:
    dist = torch_dist()
    world = dist.group.WORLD
    if _GROUP_CACHE["world"] is not world:
        _GROUP_CACHE["world"] = world
        _GROUP_CACHE["by_tp"] = {}
    cached = _GROUP_CACHE["by_tp"].get(topo.tp_size)
    if cached is not None:
        return tuple(cached)  # type: ignore[return-value]
    enumeration = topo.all_tp_group_ranks()
    # The group timeout is gloo's per-operation bound; our own deadlines are shorter or equal.
    pg_timeout = timedelta(seconds=max(timeout_s, DEFAULT_COLLECTIVE_TIMEOUT_S))
    backend = _device_backend()
    device_group, _ = dist.new_subgroups_by_enumeration(enumeration, timeout=pg_timeout, backend=backend)
    if backend == "gloo":
        cpu_group = device_group
    else:
        cpu_group, _ = dist.new_subgroups_by_enumeration(enumeration, timeout=pg_timeout, backend="gloo")
        # NCCL creates a communicator lazily, inside the first collective and outside Work.wait's
        # timeout: create it now, while every rank is known to be here.
        import torch

        probe = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(probe, group=device_group)
    # Who is who (host, pid), while every rank is known to be here: a later failure can name the dead.
    peers: list[Any] = [None] * topo.tp_size
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid()), group=cpu_group)
    entry = (device_group, cpu_group, backend, tuple((str(h), int(p)) for h, p in peers))
    _GROUP_CACHE["by_tp"][topo.tp_size] = entry
    return entry


def engine_group(
    tp_size: int,
    *,
    allow_multi_node: bool = False,
    base_port: int = DEFAULT_BASE_PORT,
    check_port: bool = True,
    timeout_s: float | None = None,
) -> EngineGroup:
    """This rank's :class:`EngineGroup`, building the TP groups on the first call for ``tp_size``.

    Collective: every rank of the world must call it, in the same order, with the same arguments
    (``new_subgroups_by_enumeration`` creates every group on every rank). With ``check_port``, the
    leader checks its engine port is free and the verdict is broadcast, so the whole group raises.

    ``timeout_s`` (default ``$GENENGINE_COLLECTIVE_TIMEOUT_S``, else 1800 s) bounds each helper call.
    The groups' own timeout, gloo's hard per-operation bound, is fixed when they are first built:
    ``max(timeout_s, 1800 s)``.
    """
    if timeout_s is None:
        timeout_s = default_collective_timeout_s()
    timeout_s = _check_timeout(timeout_s, "timeout_s")
    topo = topology_from_env(tp_size, allow_multi_node=allow_multi_node, base_port=base_port)
    device_group, cpu_group, backend, peers = _tp_groups(topo, timeout_s)
    group = EngineGroup(topo, device_group, cpu_group, backend, timeout_s, peers=peers)
    if check_port:
        problem = port_problem(topo) if topo.is_leader else None
        problem = group.broadcast_object(problem, op="engine port check")
        if problem is not None:
            raise DistributedSetupError(f"TP group {format_ranks(topo.tp_group_ranks)}: {problem}")
    return group


class EngineGroup:
    """One TP group and the ways data moves inside it.

    ``device_group`` (NCCL if the trainer's default group uses it, else gloo) carries tensors;
    ``cpu_group`` (always gloo, the same object on a gloo world) carries pickled Python objects, as the
    reference hands SGLang a gloo copy of its group.
    Every method is collective over the group and waits at most ``timeout_s`` (the group's default, or
    the argument). After a :class:`~genengine.errors.CollectiveTimeoutError` the group is out of step
    and must not be used again: as with a NCCL timeout, the job should stop.
    """

    def __init__(
        self,
        topology: Topology,
        device_group: ProcessGroup,
        cpu_group: ProcessGroup,
        backend: str,
        timeout_s: float,
        *,
        peers: Sequence[tuple[str, int]] | None = None,
    ) -> None:
        self.topology = topology
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.backend = backend
        self.timeout_s = timeout_s
        #: (hostname, pid) of each rank of the group in TP-rank order, when known: names the dead in errors.
        self.peers = tuple(peers) if peers is not None else None
        self._calls = 0  # methods called on this group: ranks out of step show at the next roll call

    def __repr__(self) -> str:
        t = self.topology
        return (
            f"EngineGroup(rank={t.rank}, tp_group={format_ranks(t.tp_group_ranks)}, leader={t.leader_rank}, "
            f"backend={self.backend!r}, timeout_s={self.timeout_s})"
        )

    @property
    def is_leader(self) -> bool:
        return self.topology.is_leader

    @property
    def device(self) -> torch.device:
        """Where ``broadcast_tensor`` puts tensors: this rank's GPU under NCCL, else the CPU."""
        import torch

        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- plumbing ---------------------------------------------------------------------------------------
    def _start(self, timeout_s: float | None) -> tuple[float, float]:
        """(timeout in seconds, deadline) of a call; counts the call for the roll call's step check."""
        seconds = self.timeout_s if timeout_s is None else _check_timeout(timeout_s, "timeout_s")
        self._calls += 1
        return seconds, time.monotonic() + seconds

    def _describe(self, op: str, seconds: float) -> str:
        t = self.topology
        return (
            f"{op} in TP group {format_ranks(t.tp_group_ranks)} (leader rank {t.leader_rank}, "
            f"this rank {t.rank}, timeout {seconds:g} s)"
        )

    def dead_ranks(self, *, wait_s: float = 0.0) -> list[int]:
        """Ranks of the group whose process is gone, as far as this rank can tell (peers on its own host).

        ``wait_s`` gives a peer whose connection just closed the moment it takes to finish exiting.
        """
        if self.peers is None:
            return []
        host, me = socket.gethostname(), os.getpid()
        local = [(r, pid) for r, (h, pid) in zip(self.topology.tp_group_ranks, self.peers, strict=True) if h == host]
        deadline = time.monotonic() + wait_s
        while True:
            dead = [r for r, pid in local if pid != me and not pid_alive(pid)]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)

    def _wait(self, work: Work, deadline: float, op: str, seconds: float) -> None:
        # gloo and NCCL both honour Work.wait(timeout). 0 would mean "the group's timeout", hence the
        # floor, which also lets a peer that did arrive be counted after another one's deadline passed.
        remaining = max(deadline - time.monotonic(), 0.05)
        try:
            done = work.wait(timeout=timedelta(seconds=remaining))
        except RuntimeError as exc:
            text = str(exc)
            timed_out = "timed out" in text.lower() or "timeout" in text.lower()  # gloo, resp. NCCL's watchdog
            dead = self.dead_ranks(wait_s=0.0 if timed_out else 1.0)
            if dead:
                why = f"rank(s) {format_ranks(dead)} of the group died (their processes are gone)"
            elif timed_out:
                why = "a rank of the group did not join in time (it is stuck elsewhere, diverged, or dead)"
            else:
                why = "the operation failed, most likely because a rank of the group died"
            raise CollectiveTimeoutError(f"{self._describe(op, seconds)}: {why}: {text.strip()}") from exc
        if done is False:
            raise CollectiveTimeoutError(f"{self._describe(op, seconds)}: did not finish in time")

    def _broadcast_bytes(self, data: bytes | None, deadline: float, op: str, seconds: float) -> bytes:
        import torch

        dist = torch_dist()
        src = self.topology.leader_rank
        if self.is_leader:
            assert data is not None  # internal invariant, not a user check
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._wait(dist.broadcast(size, src=src, group=self.cpu_group, async_op=True), deadline, op, seconds)
        if self.is_leader:
            assert data is not None
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(dist.broadcast(buf, src=src, group=self.cpu_group, async_op=True), deadline, op, seconds)
        return data if data is not None else buf.numpy().tobytes()

    # -- public -----------------------------------------------------------------------------------------
    def broadcast_object(self, obj: T | None, *, timeout_s: float | None = None, op: str = "broadcast_object") -> T:
        """The leader's ``obj`` on every rank of the group (others pass anything, e.g. None).

        How the leader's engine outputs reach the ranks that hold no engine.
        """
        seconds, deadline = self._start(timeout_s)
        if self.topology.tp_size == 1:
            return obj  # type: ignore[return-value]
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.is_leader else None
        result: T = pickle.loads(self._broadcast_bytes(data, deadline, op, seconds))
        return result

    def broadcast_tensor(self, tensor: torch.Tensor | None, *, timeout_s: float | None = None) -> torch.Tensor:
        """The leader's ``tensor`` on every rank, on :attr:`device`; non-leaders pass None.

        Shape and dtype travel first over the gloo group, so receivers need not know them; the data
        goes over the device group (NCCL on GPUs). A leader without a tensor makes every rank raise.
        """
        import torch

        op = "broadcast_tensor"
        seconds, deadline = self._start(timeout_s)
        meta: object = None
        if self.is_leader:
            meta = (
                (tuple(tensor.shape), tensor.dtype)
                if isinstance(tensor, torch.Tensor)
                else f"the leader passed {type(tensor).__name__}, not a tensor"
            )
        if self.topology.tp_size > 1:
            meta = pickle.loads(
                self._broadcast_bytes(pickle.dumps(meta) if self.is_leader else None, deadline, op, seconds)
            )
        if isinstance(meta, str):
            raise InvalidArgumentError(f"{self._describe(op, seconds)}: {meta}")
        shape: tuple[int, ...]
        dtype: torch.dtype
        shape, dtype = meta  # type: ignore[misc]
        if self.is_leader:
            assert tensor is not None
            buf = tensor.to(self.device).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
        if self.topology.tp_size > 1:
            dist = torch_dist()
            work = dist.broadcast(buf, src=self.topology.leader_rank, group=self.device_group, async_op=True)
            self._wait(work, deadline, op, seconds)
        return buf

    def gather_object(self, obj: object, *, timeout_s: float | None = None) -> list[Any] | None:
        """Every rank's ``obj`` on the leader, in TP-rank order; None on the other ranks.

        How each rank's weight handles (e.g. CUDA-IPC handles) reach the engine's owner.
        """
        import torch

        op = "gather_object"
        seconds, deadline = self._start(timeout_s)
        n = self.topology.tp_size
        if n == 1:
            return [obj]
        dist = torch_dist()
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        work = dist.all_gather(sizes, size, group=self.cpu_group, async_op=True)
        self._wait(work, deadline, op, seconds)
        lengths = [int(s.item()) for s in sizes]
        buf = torch.zeros(max(lengths), dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gather_list = [torch.empty_like(buf) for _ in range(n)] if self.is_leader else None
        work = dist.gather(
            buf, gather_list=gather_list, dst=self.topology.leader_rank, group=self.cpu_group, async_op=True
        )
        self._wait(work, deadline, op, seconds)
        if gather_list is None:
            return None
        return [pickle.loads(t[:length].numpy().tobytes()) for t, length in zip(gather_list, lengths, strict=True)]

    def barrier(self, *, timeout_s: float | None = None) -> None:
        """Wait for every rank of the group; on timeout, name the ranks that did not come.

        Unlike ``monitored_barrier`` (whose non-zero ranks wait past the timeout for rank 0), every
        rank here gives up at the deadline.
        """
        seconds, deadline = self._start(timeout_s)
        self._roll_call(bytes(32), deadline, "barrier", seconds, what="")

    def check_consistent(self, value: object, *, what: str = "inputs", timeout_s: float | None = None) -> None:
        """Raise on every rank unless all ranks of the group passed equal ``value``.

        For engines that run one process per rank (vLLM's external_launcher) and hang or return
        garbage when TP ranks see different prompts or seeds. Also a barrier: a missing rank is named.

        Raises:
            InconsistentInputsError: naming the ranks whose ``value`` differs from the majority (the
                leader's on a tie).
            CollectiveTimeoutError: naming the ranks that did not arrive.
        """
        seconds, deadline = self._start(timeout_s)
        self._roll_call(input_digest(value), deadline, "check_consistent", seconds, what=what)

    def _roll_call(self, digest: bytes, deadline: float, op: str, seconds: float, what: str) -> None:
        """Non-leaders send (call count, digest) to the leader; it answers each with every rank's status.

        Point-to-point with per-peer deadlines, so the leader learns exactly who is missing, who is out
        of step and who differs, and every rank that came raises the same error.
        """
        import torch

        t = self.topology
        n = t.tp_size
        if n == 1:
            return
        dist = torch_dist()
        ranks = t.tp_group_ranks
        mine = torch.tensor([self._calls, *digest], dtype=torch.int64)
        if not t.is_leader:
            status = torch.full((n,), -1, dtype=torch.int64)
            works = [dist.isend(mine, dst=t.leader_rank, group=self.cpu_group, tag=_ROLL_CALL_TAG)]
            works.append(dist.irecv(status, src=t.leader_rank, group=self.cpu_group, tag=_ROLL_CALL_TAG))
            try:
                for work in works:
                    self._wait(work, deadline, op, seconds)
            except CollectiveTimeoutError as exc:
                cause = str(exc.__cause__).strip()
                raise CollectiveTimeoutError(
                    f"{self._describe(op, seconds)}: the leader rank {t.leader_rank} did not answer (it is "
                    f"stuck elsewhere, diverged, or dead): {cause}"
                ) from exc.__cause__
            self._raise_for(status.tolist(), op, seconds, what)
            return
        received = [torch.zeros_like(mine) for _ in range(n - 1)]
        works = [
            dist.irecv(buf, src=r, group=self.cpu_group, tag=_ROLL_CALL_TAG)
            for buf, r in zip(received, ranks[1:], strict=True)
        ]
        arrived: list[bool] = []
        for work in works:
            try:
                self._wait(work, deadline, op, seconds)
                arrived.append(True)
            except CollectiveTimeoutError:
                arrived.append(False)
        rows = [mine.tolist(), *(buf.tolist() for buf in received)]
        status_list = [_OK] * n
        for i, ok in enumerate(arrived, start=1):
            if not ok:
                status_list[i] = _MISSING
            elif rows[i][0] != rows[0][0]:
                status_list[i] = _OUT_OF_STEP
        present = [i for i in range(n) if status_list[i] == _OK]
        counts: dict[tuple[int, ...], list[int]] = {}
        for i in present:
            counts.setdefault(tuple(rows[i][1:]), []).append(i)
        # Majority wins; on a tie, the group holding the leader (index 0, always present).
        reference = max(counts.values(), key=lambda idx: (len(idx), 0 in idx))
        for i in present:
            if i not in reference:
                status_list[i] = _DIFFERS
        status = torch.tensor(status_list, dtype=torch.int64)
        sends = [
            dist.isend(status, dst=ranks[i], group=self.cpu_group, tag=_ROLL_CALL_TAG)
            for i in range(1, n)
            if arrived[i - 1]
        ]
        for work in sends:
            # A rank that cannot be told times out on its own; the error below already names the problem.
            with contextlib.suppress(CollectiveTimeoutError):
                self._wait(work, deadline + 1.0, op, seconds)
        self._raise_for(status_list, op, seconds, what)

    def _raise_for(self, status: list[int], op: str, seconds: float, what: str) -> None:
        ranks = self.topology.tp_group_ranks
        missing = [ranks[i] for i, s in enumerate(status) if s == _MISSING]
        step = [ranks[i] for i, s in enumerate(status) if s == _OUT_OF_STEP]
        differ = [ranks[i] for i, s in enumerate(status) if s == _DIFFERS]
        if missing or step:
            parts = []
            dead = [r for r in self.dead_ranks() if r in missing]
            missing = [r for r in missing if r not in dead]
            if dead:
                parts.append(f"rank(s) {format_ranks(dead)} died (their processes are gone)")
            if missing:
                parts.append(f"rank(s) {format_ranks(missing)} did not arrive (stuck elsewhere, diverged, or dead)")
            if step:
                parts.append(f"rank(s) {format_ranks(step)} arrived from a different call of this group (out of step)")
            raise CollectiveTimeoutError(f"{self._describe(op, seconds)}: " + "; ".join(parts))
        if differ:
            agree = [ranks[i] for i, s in enumerate(status) if s == _OK]
            raise InconsistentInputsError(
                f"rank(s) {format_ranks(differ)} of TP group {format_ranks(ranks)} passed different {what} "
                f"than rank(s) {format_ranks(agree)}; every rank of a TP group must pass identical {what} "
                "(prompts, sampling parameters and seed)"
            )
