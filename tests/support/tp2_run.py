"""What the two-rank GPU scripts (``tests/gpu/tp2_*.py``) share: PASS/FAIL lines, results gathered on a
gloo group, and the ending every colocated engine must allow: after ``shutdown()`` the trainer's default
group still exists and still reduces. ``init_trainer_world`` also starts ``benchmarks/soak.py``'s ranks.

They are scripts under ``torchrun``, not pytest tests, because two ranks must run one engine together.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["Tp2Run", "exit_with", "init_trainer_world"]


def init_trainer_world(*, bind_device: bool = False) -> None:
    """The default group as a torchrun trainer starts it: NCCL on this rank's GPU (``LOCAL_RANK``), gloo
    without one. ``bind_device`` binds NCCL to the device at once (``device_id``) instead of lazily."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    if bind_device:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("nccl")


class Tp2Run:
    """One rank of a tp_size=2 script: ``start()`` joins the trainer's world, ``finish()`` ends it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rank = int(os.environ.get("RANK", "0"))
        self.t0 = time.time()
        self.fails: list[str] = []
        self.result: dict[str, Any] = {"rank": self.rank}
        self.world: Any = None
        self.gloo: Any = None

    def log(self, msg: str) -> None:
        print(f"[{self.name} r{self.rank} {time.time() - self.t0:7.1f}s] {msg}", flush=True)

    def check(self, cond: bool, msg: str) -> bool:
        self.log(("PASS: " if cond else "FAIL: ") + msg)
        if not cond:
            self.fails.append(msg)
        return cond

    def start(self, *, bind_device: bool) -> int:
        """The trainer's world (``init_trainer_world``), plus a gloo group for the results; the world size."""
        import torch.distributed as dist

        init_trainer_world(bind_device=bind_device)
        self.world = dist.group.WORLD
        self.gloo = dist.new_group(backend="gloo")
        return int(dist.get_world_size())

    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=self.gloo)
        return out

    def finish(self, json_path: str | None) -> int:
        """After the engine's shutdown: the default group must be the trainer's and still work; then results."""
        import torch
        import torch.distributed as dist

        self.check(
            dist.is_initialized() and dist.group.WORLD is self.world, "the default group survives the engine's shutdown"
        )
        total = torch.ones(1, device="cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(total)
        world = dist.get_world_size()
        self.check(total.item() == world, "all_reduce on the trainer's default group works after shutdown")
        ranks = self.gather({**self.result, "fails": self.fails})
        failed = any(r["fails"] for r in ranks)
        if self.rank == 0:
            line = json.dumps({"ranks": ranks, "passed": not failed})
            print(f"{self.name.upper().replace('-', '_')}_RESULT {line}", flush=True)
            if json_path:
                with open(json_path, "w", encoding="utf-8") as fh:
                    fh.write(line + "\n")
        # Tear the groups down in step: the gloo subgroup first, then the world once every rank is past that,
        # so that no rank's gloo threads still talk to a peer that has already gone.
        dist.barrier(group=self.gloo)
        dist.destroy_process_group(self.gloo)
        dist.barrier(group=self.world)
        dist.destroy_process_group()
        self.log(f"{self.name.upper().replace('-', ' ')} {'FAILED' if failed else 'PASSED'}")
        return 1 if failed else 0


def exit_with(run: Tp2Run, main: Callable[[], int]) -> NoReturn:
    """Exit code 2 and the traceback on a rank that raised (its peer then fails on its next collective)."""
    try:
        code = main()
    except Exception:
        run.log("FAIL: exception\n" + traceback.format_exc())
        code = 2
    # os._exit, not sys.exit: the verdict is printed and every group destroyed; what is left is CPython's
    # teardown of torch's C++ statics, which now and then aborts with "terminate called without an active
    # exception" (a gloo thread joined at exit) and would turn a passed run into exit -6.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
