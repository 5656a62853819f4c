"""The TP group an ``SGLangEngine`` runs in: built from the trainer's world (or a lone one), its collective
timeout, and the leader's errors as the other ranks raise them. Shared by :mod:`genengine_sglang.engine` and
the LightRFT face (:mod:`genengine_sglang.lightrft`), which builds groups of its own."""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

from genengine.distributed import (
    EngineGroup,
    compute_topology,
    default_collective_timeout_s,
    engine_group,
    parse_cuda_visible_devices,
)
from genengine.errors import DistributedSetupError, GenEngineError
from genengine_sglang._process import current_gpu
from genengine_sglang.errors import SGLangEngineError
from genengine_sglang.settings import SGLangSettings

__all__ = ["collective_timeout", "make_group", "on_leader", "portable_error", "torch_dist"]

T = TypeVar("T")


# ---- groups ------------------------------------------------------------------------------------------------
def torch_dist() -> Any:
    """``torch.distributed``, imported when first needed (this module stays light)."""
    import torch.distributed as dist

    return dist


def collective_timeout(settings: SGLangSettings) -> float:
    """The bound of the group's collectives and of a delegated SGLang call: the setting, else the default."""
    return settings.collective_timeout_s or default_collective_timeout_s()


def make_group(settings: SGLangSettings, *, require_distributed: bool) -> tuple[EngineGroup, bool]:
    """This rank's group from the trainer's world (or a lone one), and whether its engine port was checked."""
    dist = torch_dist()
    if dist.is_available() and dist.is_initialized():
        group = engine_group(
            settings.tp_size, base_port=settings.base_port, check_port=True, timeout_s=collective_timeout(settings)
        )
        return group, True
    if require_distributed or settings.tp_size > 1:
        raise DistributedSetupError(
            "torch.distributed is not initialised: the trainer owns the process group and must call "
            "torch.distributed.init_process_group() before an engine is created"
            + (f" (tp_size={settings.tp_size} needs a group of that many ranks)" if settings.tp_size > 1 else "")
        )
    topo = compute_topology(
        0, 1, 0, 1, 1, parse_cuda_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES")), settings.base_port
    )
    gpu = current_gpu()
    if gpu is not None and gpu != topo.gpu_id:  # a lone engine serves the GPU this process already uses
        topo = dataclasses.replace(topo, gpu_id=gpu, base_gpu_id=gpu, gpu_ids=(gpu,))
    return EngineGroup(topo, None, None, "gloo", collective_timeout(settings)), False  # type: ignore[arg-type]


def portable_error(exc: BaseException, rank: int) -> BaseException:
    """The leader's error as it will be raised on the other ranks."""
    if isinstance(exc, GenEngineError):
        try:
            pickle.loads(pickle.dumps(exc))
            return exc
        except Exception:
            pass
        base: type[GenEngineError] = type(exc) if isinstance(exc, SGLangEngineError) else SGLangEngineError
        return base(f"on the TP leader (rank {rank}): {exc}")
    return SGLangEngineError(f"{type(exc).__name__} on the TP leader (rank {rank}): {exc}")


def on_leader(g: EngineGroup, op: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on the leader; its result, or its error, reaches every rank of the group."""
    if g.topology.tp_size == 1:
        return fn()
    payload: tuple[str, Any] | None = None
    error: BaseException | None = None
    if g.is_leader:
        try:
            payload = ("ok", fn())
        except Exception as exc:
            error = exc
            payload = ("err", portable_error(exc, g.topology.rank))
    kind, value = g.broadcast_object(payload, op=op)
    if kind == "err":
        if error is not None:
            raise error
        raise value
    return value  # type: ignore[no-any-return]
