"""Moving the trainer's tensors into SGLang: producer side (every TP rank) and leader side.

Every rank turns its bucket into CUDA-IPC payloads of tensors on its own GPU (the GPU of the scheduler of
the same TP rank); the leader hands rank ``i``'s payload to scheduler ``i``. Nothing is copied across GPUs
and, in ``handles`` mode, nothing at all: the scheduler reads the trainer's memory. torch's CUDA IPC keeps
the memory alive until the consumer drops it (its deleter synchronises first), and our temporaries are
reclaimed by ``torch.cuda.ipc_collect`` after the call; but the trainer may change its own tensors as soon
as ``load_weights`` returns, so the last call of a load is a barrier: SGLang's scheduler runs our
synchronising loader (``_scheduler_hooks.load_weights_and_sync``) before it answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from genengine.backend import ipc_dumps
from genengine_sglang.compat import local_serialized_tensor
from genengine_sglang.errors import SGLangEngineError
from genengine_sglang.settings import SYNC_LOADER

if TYPE_CHECKING:
    import torch

    from genengine.backend import PassOn

__all__ = ["LoadCall", "apply_payloads", "barrier", "producer_payload", "serialize"]


@dataclasses.dataclass(frozen=True)
class LoadCall:
    """How the current load hands its tensors over (the protocol's ``load_weights`` or LightRFT's per-tensor
    ``update_weights_from_tensor``)."""

    mode: str
    load_format: str | None
    flush: bool


def serialize(obj: Any, pass_on: PassOn | None = None) -> bytes:
    """What ``sglang.srt.utils.MultiprocessingSerializer.serialize`` does (ForkingPickler: CUDA tensors travel
    as IPC handles), without importing SGLang on every trainer rank; with ``pass_on`` (the load session's: a
    colocated replica's ``cuda_ipc`` sync) a tensor this process opened from the trainer's memory travels under
    the trainer's own handle."""
    return ipc_dumps(obj, pass_on)


def _materialize(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """The tensor on this rank's GPU, host tensors copied up (one bucket at a time). It arrives detached,
    DTensors gathered and views contiguous: ``EngineBase.load_weights`` prepared the bucket
    (``genengine.weights.WeightValidator.prepare``)."""
    if device is not None and tensor.device != device:
        tensor = tensor.to(device, non_blocking=True)
    return tensor


def producer_payload(
    mode: str, bucket: Sequence[tuple[str, torch.Tensor]], device: torch.device | None, pass_on: PassOn | None = None
) -> tuple[Any, list[Any]]:
    """This rank's payload for one bucket, and the objects to keep alive until the leader's call returns;
    ``pass_on`` is the load session's (tensors opened from another process's memory pass on under it).

    handles → bytes of ``[(name, tensor), ...]``; flattened → bytes of SGLang's flattened-bucket dict;
    per_param → ``[(name, bytes), ...]``.
    """
    import torch

    tensors = [(name, _materialize(t, device)) for name, t in bucket]
    keep: list[Any] = [tensors]
    if mode == "flattened":
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        flat = FlattenedTensorBucket(named_tensors=tensors)
        keep.append(flat)
        payload: Any = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    elif mode == "handles":
        payload = tensors
    elif mode == "per_param":
        payload = None
    else:  # settings validation makes this unreachable
        raise ValueError(f"unknown weight_sync_mode {mode!r}")
    # Another process reads these through IPC with no stream ordering against ours: every write to them
    # (the trainer's step, our copies) must be finished first.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
    if mode == "per_param":
        return [(name, serialize(t, pass_on)) for name, t in tensors], keep
    return serialize(payload, pass_on), keep


def _check(ret: Any, what: str) -> None:
    ok, message = (ret[0], ret[1]) if isinstance(ret, (tuple, list)) else (getattr(ret, "success", True), ret)
    if not ok:
        raise SGLangEngineError(f"SGLang rejected {what}: {message}")


def _send_per_rank(engine: Any, payloads: list[bytes], load_format: str | None, flush: bool) -> Any:
    """``update_weights_from_tensor`` with one pre-serialised payload per TP rank.

    ``sglang.Engine.update_weights_from_tensor`` re-pickles its argument once per rank; the request it
    builds (``UpdateWeightsFromTensorReqInput``) takes per-rank bytes, so we build it ourselves, as the
    Engine method does, and each scheduler deserialises only its own rank's tensors.
    """
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, load_format=load_format, flush_cache=flush)
    return engine.loop.run_until_complete(engine.tokenizer_manager.update_weights_from_tensor(obj, None))


def apply_payloads(
    engine: Any, mode: str, gathered: list[Any], *, synced: bool, load_format: str | None = None
) -> None:
    """On the leader: hand every rank's payload of one bucket to SGLang (no cache flush).

    ``synced`` routes handles through the synchronising loader, so the reply already is a barrier;
    ``load_format`` (per_param only, the reference's argument) is passed to SGLang unchanged.
    """
    if mode == "handles":
        _check(_send_per_rank(engine, gathered, SYNC_LOADER if synced else None, False), "a bucket of weights")
    elif mode == "flattened":
        ret = engine.update_weights_from_tensor(gathered, load_format="flattened_bucket", flush_cache=False)
        _check(ret, "a flattened bucket of weights")
    else:
        LocalSerializedTensor = local_serialized_tensor()
        # LightRFT's shape: one call per parameter, one serialized handle per rank.
        for items in zip(*gathered, strict=True):
            name = items[0][0]
            named = [(name, LocalSerializedTensor(values=[data for _, data in items]))]
            ret = engine.update_weights_from_tensor(named, load_format=load_format, flush_cache=False)
            _check(ret, f"weight {name!r}")


def barrier(engine: Any, tp_size: int, *, flush: bool) -> None:
    """One empty call through the synchronising loader: every earlier copy has landed when it returns
    (requests are handled in order); with ``flush`` it also drops the prefix cache, in the same call."""
    empty = serialize([])
    _check(_send_per_rank(engine, [empty] * tp_size, SYNC_LOADER, flush), "the weight barrier")
