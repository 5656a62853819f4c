"""A pool of long-lived worker processes that run real torch.distributed (gloo) scenarios for the tests.

Spawning a process and importing torch costs seconds on a 2-core machine, so the workers are started
once; each job sets torchrun's variables, initialises a fresh default group over ``env://`` on a free
port, runs one scenario from :data:`SCENARIOS`, and destroys the group again. Results (or the
exception's type, message and base classes) come back through a queue; a worker that dies is noticed
and restarted on the next job. A job that hangs fails with the ranks that did not finish and where each
one was (a stack dump taken from the stuck workers), not with pytest-timeout's bare "Timeout".

Timing on a loaded 2-core machine: a scenario marks where the call under test starts
(:func:`mark_call_start`), so ``Result.elapsed`` never includes process-group setup; and a rank that
stays away from a call (or lingers after it) waits for its peers' done-markers in ``sync_dir`` rather
than sleeping a fixed time, so "the peer was still there when the timeout fired" is a fact the test can
assert, not a race between two clocks.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from support.outcomes import Result as Result
from support.ports import free_port as free_port
from support.ports import free_port_block as free_port_block

ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "GENENGINE_COLLECTIVE_TIMEOUT_S",
)


# --- scenarios (run inside the workers) ------------------------------------------------------------------
_CALL: dict[str, float] = {}  # per job: when the call under test started (see mark_call_start)


def mark_call_start() -> None:
    """``Result.elapsed`` counts from here: the call under test, without the group's setup before it."""
    _CALL["start"] = time.monotonic()


def _done_marker(sync_dir: str, rank: int) -> Path:
    return Path(sync_dir) / f"done-{rank}"


@contextlib.contextmanager
def _marks_done(sync_dir: str, rank: int) -> Iterator[None]:
    """Leave this rank's done-marker when the call under test ends, returned or raised."""
    try:
        yield
    finally:
        _done_marker(sync_dir, rank).touch()


def _wait_for_done(sync_dir: str, ranks: list[int], cap_s: float) -> bool:
    """Whether every rank in ``ranks`` left its done-marker within ``cap_s`` seconds."""
    deadline = time.monotonic() + cap_s
    while not all(_done_marker(sync_dir, r).exists() for r in ranks):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _helpers(tp_size: int, base_port: int, allow_multi_node: bool = False) -> dict[str, Any]:
    """Build the groups and use every helper once; report what each rank saw."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from genengine.distributed import engine_group

    rank = dist.get_rank()
    eg = engine_group(tp_size, base_port=base_port, allow_multi_node=allow_multi_node, timeout_s=30)
    again = engine_group(tp_size, base_port=base_port, allow_multi_node=allow_multi_node, timeout_s=30)
    out: dict[str, Any] = {"topology": dataclasses.asdict(eg.topology), "backend": eg.backend}
    out["cached"] = again.cpu_group is eg.cpu_group and again.device_group is eg.device_group
    out["group_ranks"] = dist.get_process_group_ranks(eg.cpu_group)
    out["broadcast"] = eg.broadcast_object({"from": rank, "text": "héllo"} if eg.is_leader else None)
    sent = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) * (rank + 1) if eg.is_leader else None
    got = eg.broadcast_tensor(sent)
    out["tensor"] = (got.float().tolist(), str(got.dtype), tuple(got.shape))
    out["gathered"] = eg.gather_object({"rank": rank, "handle": "ipc-" + "x" * rank})
    eg.check_consistent(["the same prompt", {"seed": 7, "temperature": 0.7}], what="prompts")
    eg.barrier()
    total = torch.tensor([float(rank)], device=eg.device)
    dist.all_reduce(total, group=eg.device_group)
    out["sum"] = total.item()
    return out


def _multi_node(base_port: int) -> dict[str, Any]:
    """tp_size 8 on 2 nodes of 4: refused unless the backend spans nodes, then a working group."""
    from genengine.distributed import engine_group
    from genengine.errors import DistributedSetupError

    try:
        engine_group(8, base_port=base_port)
        refused = ""
    except DistributedSetupError as exc:
        refused = str(exc)
    out = _helpers(8, base_port, allow_multi_node=True)
    out["refused"] = refused
    return out


def _invalid(tp_sizes: list[Any]) -> list[tuple[str, str, bool]]:
    """Each bad tp_size raises on every rank, and the world stays usable afterwards."""
    import torch
    import torch.distributed as dist

    from genengine.distributed import engine_group

    out = []
    for tp in tp_sizes:
        try:
            engine_group(tp, check_port=False)
            out.append(("none", "", False))
        except Exception as exc:
            out.append((type(exc).__name__, str(exc), isinstance(exc, AssertionError)))
    x = torch.ones(1)
    dist.all_reduce(x)
    out.append(("all_reduce after errors", str(x.item()), True))
    return out


def _consistency(tp_size: int, odd_ranks: list[int], timeout_s: float = 30) -> str:
    import torch
    import torch.distributed as dist

    from genengine.distributed import engine_group

    rank = dist.get_rank()
    eg = engine_group(tp_size, check_port=False, timeout_s=timeout_s)
    prompt = "a different prompt" if rank in odd_ranks else "the prompt"
    # Equal content built differently (dict order, tensor copies) must still match.
    params = {"seed": 1, "max_new_tokens": 8} if rank % 2 else {"max_new_tokens": 8, "seed": 1}
    eg.check_consistent([prompt, params, torch.tensor([1, 2, 3]).clone()], what="prompts")
    return "consistent"


def _absent(
    tp_size: int,
    plan: dict[int, str],
    sync_dir: str,
    absent_for_s: float,
    timeout_s: float | None = None,
    linger_s: float = 0.0,
) -> str:
    """Ranks in ``plan`` call that helper; the others never join it.

    An absent rank stays away until every rank of its group that calls a helper has finished its call
    (returned or raised), for at most ``absent_for_s``; a rank whose helper returns stays likewise, for at
    most ``linger_s``, so a diverged peer is stuck, not gone. Each returns "absent" (resp. "returned")
    when its peers finished first, i.e. they gave up while it was still there, and says otherwise.
    """
    import torch
    import torch.distributed as dist

    from genengine.distributed import engine_group

    rank = dist.get_rank()
    eg = engine_group(tp_size, check_port=False, timeout_s=timeout_s)
    callers = [r for r in eg.topology.tp_group_ranks if r in plan and r != rank]
    op = plan.get(rank)
    if op is None:
        if _wait_for_done(sync_dir, callers, absent_for_s):
            return "absent"
        return f"absent, then left after {absent_for_s:g} s: ranks {callers} were still inside their calls"
    calls: dict[str, Callable[[], object]] = {
        "broadcast_object": lambda: eg.broadcast_object("x" if eg.is_leader else None),
        "broadcast_tensor": lambda: eg.broadcast_tensor(torch.ones(3) if eg.is_leader else None),
        "gather_object": lambda: eg.gather_object(rank),
        "check_consistent": lambda: eg.check_consistent("prompt"),
        "barrier": eg.barrier,
        # A leader that diverged: it sends what looks like broadcast_tensor's metadata, then leaves.
        "broadcast_meta": lambda: eg.broadcast_object(((3,), torch.float32)),
    }
    mark_call_start()
    with _marks_done(sync_dir, rank):
        calls[op]()
    if _wait_for_done(sync_dir, callers, linger_s):
        return "returned"
    return f"returned, then left after {linger_s:g} s: ranks {callers} were still inside their calls"


def _dies(tp_size: int, plan: dict[int, str], die_after_s: float, timeout_s: float) -> str:
    """Every rank enters ``plan[rank]``; ranks marked ``die:`` are killed by a timer while inside it.

    A leader enters its helper only once its group's victims are gone (``dead_ranks``), so a victim can
    never be sent what it waits for and return before its timer fires: it dies inside the helper.
    """
    import torch.distributed as dist

    from genengine.distributed import engine_group

    rank = dist.get_rank()
    eg = engine_group(tp_size, check_port=False, timeout_s=timeout_s)
    eg.barrier()
    op = plan[rank]
    if op.startswith("die:"):
        op = op[4:]
        threading.Timer(die_after_s, os._exit, args=(3,)).start()
    if eg.is_leader:
        victims = {r for r in eg.topology.tp_group_ranks if plan[r].startswith("die:")}
        deadline = time.monotonic() + 20  # they die die_after_s after the barrier: 20 s is load, not a race
        while not victims <= set(eg.dead_ranks()):
            assert time.monotonic() < deadline, f"victims {sorted(victims)} still alive after 20 s"
            time.sleep(0.02)
    mark_call_start()
    if op == "broadcast_object":
        eg.broadcast_object("outputs" if eg.is_leader else None)
    elif op == "gather_object":
        eg.gather_object(rank)
    return "returned"


def _hangs(seconds: float) -> str:
    """Stay busy for ``seconds`` (longer than the job's timeout): what a hung collective looks like to the pool."""
    time.sleep(seconds)
    return "woke"


def _ports(held_port: int) -> list[tuple[int, str, str]]:
    """Engine port already taken (by a test socket, then by the rendezvous itself)."""
    from genengine.distributed import engine_group

    out = []
    for base in (held_port, int(os.environ["MASTER_PORT"])):
        try:
            eg = engine_group(2, base_port=base, timeout_s=20)
            out.append((base, "ok", str(eg.topology.port)))
        except Exception as exc:
            out.append((base, type(exc).__name__, str(exc)))
    return out


def _tp_group_cpu(model: str) -> dict[str, Any]:
    """LightRFT's constructor, ``RLGenerationEngine(tp_group_cpu, model_path=...)``, on every rank of a world of
    4 with groups of the right size (2) but the wrong ranks: ``[0, 2]`` and ``[1, 3]``; then
    ``new_group([0, 2])``, which ranks 1 and 3 are not in; then the right ``[0, 1]`` and ``[2, 3]``. The engine's
    start is replaced by a recorder, so "refused before any engine starts" is seen, SGLang installed or not."""
    import torch
    import torch.distributed as dist

    from genengine_sglang.engine import SGLangEngine
    from genengine_sglang.lightrft import RLGenerationEngine

    started: list[str] = []

    def record_start(self: Any, *args: Any, **kwargs: Any) -> None:
        started.append(case)
        raise RuntimeError("the engine's start was reached")

    out: dict[str, Any] = {}
    groups = {
        "crossed": dist.new_subgroups_by_enumeration([[0, 2], [1, 3]], backend="gloo")[0],
        "listed": dist.new_group([0, 2], backend="gloo"),
        "right": dist.new_subgroups_by_enumeration([[0, 1], [2, 3]], backend="gloo")[0],
    }
    original = SGLangEngine.__init__
    SGLangEngine.__init__ = record_start  # type: ignore[method-assign]
    try:
        for case, group in groups.items():
            try:
                RLGenerationEngine(group, model_path=model)
                out[case] = ("ok", "", False)
            except Exception as exc:
                out[case] = (type(exc).__name__, str(exc), isinstance(exc, AssertionError))
    finally:
        SGLangEngine.__init__ = original  # type: ignore[method-assign]
    out["started"] = started
    total = torch.ones(1)
    dist.all_reduce(total)  # nobody was left hanging
    out["after"] = total.item()
    return out


SCENARIOS: dict[str, Callable[..., Any]] = {
    "helpers": _helpers,
    "multi_node": _multi_node,
    "invalid": _invalid,
    "consistency": _consistency,
    "absent": _absent,
    "dies": _dies,
    "hangs": _hangs,
    "ports": _ports,
    "tp_group_cpu": _tp_group_cpu,
}


def _serve(inbox: Any, outbox: Any, stack_file: str) -> None:
    import faulthandler

    import torch.distributed as dist

    from genengine.distributed import clear_group_cache

    # SIGUSR1 appends every thread's stack to stack_file: how a hung job says where each stuck rank is.
    stacks = open(stack_file, "a")  # noqa: SIM115 (open for the worker's life; the handler writes to it)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    outbox.put(("ready", os.getpid(), None))
    while True:
        job = inbox.get()
        if job is None:
            return
        job_id, rank, env, backend, exit_after, scenario, kwargs = job
        for key in ENV_KEYS:
            os.environ.pop(key, None)
        os.environ.update(env)
        _CALL.clear()
        start = time.monotonic()
        in_setup = True
        try:
            if "nccl" in backend:
                import torch

                torch.cuda.set_device(int(env["LOCAL_RANK"]))
            dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=60))
            start, in_setup = time.monotonic(), False
            value = SCENARIOS[scenario](**kwargs)
            res = Result(rank, "ok", value, elapsed=time.monotonic() - _CALL.get("start", start))
        except BaseException as exc:
            res = Result(
                rank,
                "err",
                error_type=type(exc).__name__,
                message=str(exc),
                mro=[c.__name__ for c in type(exc).__mro__],
                elapsed=time.monotonic() - _CALL.get("start", start),
                value=traceback.format_exc(),
                in_setup=in_setup,
            )
        if exit_after:
            # After a NCCL timeout, destroy_process_group hangs (NCCL cannot abort a pending kernel
            # cleanly): report, flush the queue, and leave; the pool starts a fresh worker.
            outbox.put((job_id, rank, res))
            outbox.close()
            outbox.join_thread()
            os._exit(0)
        if dist.is_initialized():
            dist.destroy_process_group()
        clear_group_cache()
        outbox.put((job_id, rank, res))


class WorkerPool:
    """``size`` spawned workers; :meth:`run` gives ranks ``0 .. world_size - 1`` one job each."""

    def __init__(self, size: int) -> None:
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = [None] * size
        self._inboxes: list[Any] = [None] * size
        self._outbox = self._ctx.Queue()
        self._job = 0
        self._stack_dir = tempfile.mkdtemp(prefix="dist-worker-stacks-")
        for i in range(size):
            self._start(i)
        self._await_ready(size)

    def _start(self, i: int) -> None:
        inbox = self._ctx.Queue()
        proc = self._ctx.Process(target=_serve, args=(inbox, self._outbox, self._stack_file(i)), daemon=True)
        proc.start()
        self._procs[i], self._inboxes[i] = proc, inbox

    def _stack_file(self, i: int) -> str:
        return os.path.join(self._stack_dir, f"worker-{i}.txt")

    def _stacks(self, ranks: list[int]) -> str:
        """Where each of ``ranks`` is now: its worker's stack dump (every thread's)."""
        asked = []
        for rank in ranks:
            proc = self._procs[rank]
            if proc.is_alive():
                open(self._stack_file(rank), "w").close()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGUSR1)
                asked.append(rank)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(os.path.getsize(self._stack_file(r)) for r in asked):
            time.sleep(0.05)
        parts = []
        for rank in ranks:
            if rank not in asked:
                parts.append(f"--- rank {rank}: its worker is gone (exit code {self._procs[rank].exitcode})")
                continue
            with open(self._stack_file(rank)) as fh:
                dump = fh.read().strip() or "(no stack dump within 5 s)"
            parts.append(f"--- rank {rank} (pid {self._procs[rank].pid}):\n{dump}")
        return "\n".join(parts)

    def _await_ready(self, n: int) -> None:
        for _ in range(n):
            msg = self._outbox.get(timeout=120)
            assert msg[0] == "ready", msg

    def run(
        self,
        scenario: str,
        world_size: int,
        *,
        local_world_size: int | None = None,
        env: dict[str, str] | None = None,
        backend: str = "gloo",
        exit_after: bool = False,
        timeout: float = 60.0,
        **kwargs: Any,
    ) -> list[Result]:
        """Run ``scenario(**kwargs)`` on ranks ``0 .. world_size - 1``; results in rank order.

        ``timeout`` counts from when the jobs are handed out: restarting workers that died in an earlier
        job comes first, and is not part of it. On a hang, raise naming the ranks still busy and their stacks.
        """
        dead = [i for i in range(world_size) if not self._procs[i].is_alive()]
        for i in dead:
            self._start(i)
        if dead:
            self._await_ready(len(dead))
        self._job += 1
        lws = world_size if local_world_size is None else local_world_size
        common = {
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(lws),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            **(env or {}),
        }
        for rank in range(world_size):
            rank_env = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank % lws)}
            self._inboxes[rank].put((self._job, rank, rank_env, backend, exit_after, scenario, kwargs))
        results: dict[int, Result] = {}
        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            try:
                job_id, rank, res = self._outbox.get(timeout=0.2)
            except queue.Empty:
                for rank in range(world_size):
                    if rank not in results and not self._procs[rank].is_alive():
                        results[rank] = Result(rank, "died", self._procs[rank].exitcode)
                if time.monotonic() > deadline:
                    stuck = sorted(set(range(world_size)) - set(results))
                    stacks = self._stacks(stuck)
                    self._kill(stuck)  # the next job that needs them starts fresh ones
                    raise AssertionError(
                        f"{scenario} hung: ranks {stuck} did not finish in {timeout:g} s; where they were:\n{stacks}"
                    ) from None
                continue
            if job_id == self._job:
                results[rank] = res
        if any(r.in_setup for r in results.values()):
            # A failed rendezvous leaves ranks' gloo state unknown: the next job gets fresh workers.
            self._restart(range(world_size))
        return [results[r] for r in range(world_size)]

    def _restart(self, indices: Iterable[int]) -> None:
        restart = list(indices)
        for i in restart:
            with contextlib.suppress(Exception):
                self._inboxes[i].put(None)
            self._procs[i].join(timeout=5)
            if self._procs[i].is_alive():
                self._procs[i].kill()
                self._procs[i].join(timeout=5)
            self._start(i)
        self._await_ready(len(restart))

    def _kill(self, indices: Iterable[int]) -> None:
        for i in indices:
            if self._procs[i].is_alive():
                self._procs[i].kill()
                self._procs[i].join(timeout=5)

    def close(self) -> None:
        for proc, inbox in zip(self._procs, self._inboxes, strict=True):
            if proc is not None and proc.is_alive():
                with contextlib.suppress(Exception):
                    inbox.put(None)
        for proc in self._procs:
            if proc is None:
                continue
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        shutil.rmtree(self._stack_dir, ignore_errors=True)
