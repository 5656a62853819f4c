"""CUDA IPC handles that can be passed on: memory one process opened from another, handed to a third.

torch shares a CUDA tensor by its allocation's IPC handle, but refuses to share memory that the process itself
opened from a handle (its allocator does not own it). A colocated replica is such a middle process: the
trainer shares its tensors with the replica, whose engine (SGLang) loads them in its own scheduler process.
So the trainer shares each tensor twice: once for the replica to open (:func:`open_shared`), once to be
passed on. :func:`dumps` pickles as torch's ``ForkingPickler`` does, except that a tensor on such memory
travels under its spare share: the third process opens the trainer's memory itself, and nothing is copied.

torch counts every share until a consumer releases it (the producer keeps the memory until the count is
back to zero), so each spare share is used once, and :func:`settle` releases the ones not used (an engine
that loads in its own process, as vLLM here, never passes anything on).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from genengine.errors import GenEngineError

if TYPE_CHECKING:
    import torch

__all__ = ["dumps", "open_shared", "settle", "share"]

_DEVICE = 6
"""The index of ``storage_device`` in ``rebuild_cuda_tensor``'s arguments (stable across torch 2.x)."""

_SPARE: dict[int, tuple[Any, list[tuple[Any, ...]]]] = {}
"""StorageImpl address of an opened storage → (a weak reference, which keeps that address from reuse while
it is here; the spare shares of that storage not passed on yet)."""


def share(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Arguments for :func:`open_shared` in another process: ``tensor`` (a CUDA tensor of this process) by its
    IPC handle. Each call is one share, which one consumer opens (or passes on) once."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor.detach())
    return tuple(args)


def open_shared(args: Sequence[Any], device_index: int, spare: Sequence[Any] | None = None) -> torch.Tensor:
    """The tensor that :func:`share` described, opened on this process's GPU ``device_index`` (the sender's GPU by
    its local index here). ``spare``, a second share of the same tensor, lets :func:`dumps` pass it on once."""
    from torch.multiprocessing import reductions

    opened = list(args)
    opened[_DEVICE] = device_index
    tensor: torch.Tensor = reductions.rebuild_cuda_tensor(*opened)
    if spare is not None:
        storage = tensor.untyped_storage()
        entry = _SPARE.get(storage._cdata)
        if entry is None or entry[0].expired():
            entry = _SPARE[storage._cdata] = (reductions.StorageWeakRef(storage), [])
        forward = list(spare)
        forward[_DEVICE] = device_index
        entry[1].append(tuple(forward))
    return tensor


def settle(tensors: Iterable[torch.Tensor]) -> None:
    """Release the spare shares of ``tensors`` that were not passed on (the producer's count goes back down)."""
    import torch

    for tensor in tensors:
        entry = _SPARE.pop(tensor.untyped_storage()._cdata, None)
        for args in entry[1] if entry is not None else ():
            torch.UntypedStorage._release_ipc_counter_cuda(args[11], args[12])


def _passed_on(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Rebuild arguments for ``tensor`` (a view of an opened storage) under one of its spare shares, or None."""
    entry = _SPARE.get(tensor.untyped_storage()._cdata)
    if entry is None or entry[0].expired():
        return None
    if not entry[1]:
        raise GenEngineError(
            "a tensor opened from another process's memory was passed on more often than it was shared for "
            "(each spare share is opened once); load it once per sync, or copy it first"
        )
    a = entry[1].pop()
    # (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage bytes, storage offset,
    #  requires_grad, ref counter handle and offset, event handle, event sync): the view's geometry, the share's
    # storage.
    return (a[0], tensor.size(), tensor.stride(), tensor.storage_offset(), a[4], tensor.dtype, *a[6:10], False, *a[11:])


def dumps(obj: Any) -> bytes:
    """``obj`` pickled for another process with torch's reductions (CUDA tensors travel as IPC handles); a tensor
    opened by :func:`open_shared` with a spare share travels under that share."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    from torch.multiprocessing import reductions

    class _Pickler(ForkingPickler):  # type: ignore[misc, valid-type]
        def reducer_override(self, o: Any) -> Any:
            if _SPARE and isinstance(o, torch.Tensor) and o.is_cuda:
                args = _passed_on(o)
                if args is not None:
                    return reductions.rebuild_cuda_tensor, args
            return NotImplemented

    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return buf.getvalue()
