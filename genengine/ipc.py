"""CUDA IPC handles that can be passed on: memory one process opened from another, handed to a third.

torch shares a CUDA tensor by its allocation's IPC handle, but refuses to share memory that the process itself
opened from a handle (its allocator does not own it). A colocated replica is such a middle process: the
trainer shares its tensors with the replica, whose engine (SGLang) loads them in its own scheduler process.
So the trainer shares each tensor twice: once for the replica to open (:func:`open_shared`), once to be
passed on. :func:`dumps` pickles as torch's ``ForkingPickler`` does, except that a tensor on such memory
travels under its spare share: the third process opens the trainer's memory itself, and nothing is copied.

torch counts every share until a consumer releases it (the producer keeps the memory until the count is
back to zero), so each spare share is used once, and :func:`settle` releases the ones not used (an engine
that loads in its own process, as vLLM here, never passes anything on). A tensor passed on with no spare
share left (or none sent: the sender skips them for receivers that passed nothing on last time) travels as a
copy in this process's memory, as any tensor of its own does. :func:`passes` counts the pass-ons, so that a
receiver can tell its sender whether spares are worth sharing.

Opened tensors wait on no CUDA event of the trainer's: a sender makes its writes finish before the receivers
read (``cuda_ipc`` synchronises before it announces a bucket), and each event costs a handle to open.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["dumps", "open_shared", "passes", "settle", "share"]

# Indices into ``rebuild_cuda_tensor``'s arguments (stable across torch 2.x): (tensor_cls, size, stride,
# offset, storage_cls, dtype, device, handle, storage bytes, storage offset, requires_grad, ref counter
# handle and offset, event handle, event sync).
_DEVICE, _REF_COUNTER, _EVENT_SYNC = 6, 11, 14

_SPARE: dict[int, tuple[Any, list[tuple[Any, ...]]]] = {}
"""StorageImpl address of an opened storage → (a weak reference, which keeps that address from reuse while
it is here; the spare shares of that storage not passed on yet)."""

_PASSES = [0]
"""Tensors on opened memory passed on by :func:`dumps` in this process (under a spare share or as a copy)."""


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

    tensor: torch.Tensor = reductions.rebuild_cuda_tensor(*_here(args, device_index))
    storage = tensor.untyped_storage()
    entry = _SPARE.get(storage._cdata)
    if entry is None or entry[0].expired():
        entry = _SPARE[storage._cdata] = (reductions.StorageWeakRef(storage), [])
    if spare is not None:
        entry[1].append(_here(spare, device_index))
    return tensor


def _here(args: Sequence[Any], device_index: int) -> tuple[Any, ...]:
    out = list(args)
    out[_DEVICE] = device_index
    out[_EVENT_SYNC] = False
    return tuple(out)


def passes() -> int:
    """How many tensors on opened memory :func:`dumps` has passed on in this process so far."""
    return _PASSES[0]


def settle(tensors: Iterable[torch.Tensor]) -> None:
    """Release the spare shares of ``tensors`` that were not passed on (the producer's count goes back down)."""
    import torch

    for tensor in tensors:
        entry = _SPARE.pop(tensor.untyped_storage()._cdata, None)
        for args in entry[1] if entry is not None else ():
            torch.UntypedStorage._release_ipc_counter_cuda(args[_REF_COUNTER], args[_REF_COUNTER + 1])


def _passed_on(tensor: torch.Tensor) -> Any:
    """How ``tensor`` travels if it lies on opened memory: torch's reduction of a spare share (the view's
    geometry, the share's storage) or of a copy; None for memory of this process's own."""
    from torch.multiprocessing import reductions

    entry = _SPARE.get(tensor.untyped_storage()._cdata)
    if entry is None or entry[0].expired():
        return None
    _PASSES[0] += 1
    if not entry[1]:
        # torch keeps the copy's memory until the consumer releases it, though our reference ends here.
        return reductions.reduce_tensor(tensor.detach().clone())
    a = entry[1].pop()
    geometry = (a[0], tensor.size(), tensor.stride(), tensor.storage_offset())
    return reductions.rebuild_cuda_tensor, (*geometry, a[4], tensor.dtype, *a[6:10], False, *a[11:])


def dumps(obj: Any) -> bytes:
    """``obj`` pickled for another process with torch's reductions (CUDA tensors travel as IPC handles); a tensor
    opened by :func:`open_shared` travels under a spare share, or as a copy when none is left."""
    from multiprocessing.reduction import ForkingPickler

    import torch

    class _Pickler(ForkingPickler):  # type: ignore[misc, valid-type]
        def reducer_override(self, o: Any) -> Any:
            if _SPARE and isinstance(o, torch.Tensor) and o.is_cuda:
                reduced = _passed_on(o)
                if reduced is not None:
                    return reduced
            return NotImplemented

    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return buf.getvalue()
