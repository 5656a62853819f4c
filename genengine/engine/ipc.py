"""CUDA IPC handles that can be passed on: memory one process opened from another, handed to a third.

torch shares a CUDA tensor by its allocation's IPC handle, but refuses to share memory that the process itself
opened from a handle (its allocator does not own it). A colocated replica is such a middle process: the
trainer shares its tensors with the replica, whose engine (SGLang) loads them in its own scheduler process.
So the trainer shares each tensor twice when the replica's engine declares that it passes the tensors of a load
on (``EngineBase.passes_tensors_on``, which the receiver announces to the sender at the start of each sync): once
for the replica to open (:func:`open_shared`), once to be passed on. The receiver keeps the second share in a
:class:`PassOn`, one per sync, and hands it to its engine's load session (``LoadSession.pass_on``), whose
:meth:`PassOn.dumps` pickles as torch's ``ForkingPickler`` does, except that a tensor on such memory travels under
its spare share: the third process opens the trainer's memory itself, and nothing is copied.

torch counts every share until a consumer releases it (the producer keeps the memory until the count is
back to zero), so each spare share is used once, and :meth:`PassOn.settle` releases the ones not used. A tensor
passed on with no spare share left (or none sent) travels as a copy in this process's memory, as any tensor of
its own does.

Opened tensors wait on no CUDA event of the trainer's: a sender makes its writes finish before the receivers
read (``cuda_ipc`` synchronises before it announces a bucket), and each event costs a handle to open.

By default (``GENENGINE_CUDA_IPC_HANDLES=driver``) the receiver's own share is instead one CUDA driver handle per
allocation the tensors lie in (:func:`share_allocations`, :class:`Opened`): no IPC event, reference count or
torch storage bookkeeping per tensor. Nothing counts those handles, so the protocol must: the sender keeps the
tensors referenced until every receiver acknowledged, and a receiver closes each allocation (when its last view
dies) before it acknowledges. The spares stay torch's: a third process's lifetime is not the protocol's.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import io
import logging
import os
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from genengine.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = [
    "HANDLES",
    "HANDLES_ENV",
    "Opened",
    "PassOn",
    "dumps",
    "handles",
    "open_shared",
    "release",
    "share",
    "share_allocations",
]

log = logging.getLogger(__name__)

HANDLES_ENV = "GENENGINE_CUDA_IPC_HANDLES"
"""How ``cuda_ipc``'s sender shares the tensors its receivers read in place, read at each sync: ``driver`` (the
default: one CUDA driver handle per allocation; torch's way for a sync where the driver cannot share one of
them, as memory of expandable segments) or ``torch`` (torch's handle per tensor)."""
HANDLES = ("driver", "torch")
"""The ways of sharing ``HANDLES_ENV`` allows, the default first."""

# Indices into ``rebuild_cuda_tensor``'s arguments (stable across torch 2.x): (tensor_cls, size, stride,
# offset, storage_cls, dtype, device, handle, storage bytes, storage offset, requires_grad, ref counter
# handle and offset, event handle, event sync).
_DEVICE, _REF_COUNTER, _EVENT_SYNC = 6, 11, 14


def share(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Arguments for :func:`open_shared` in another process: ``tensor`` (a CUDA tensor of this process) by its
    IPC handle. Each call is one share, which one consumer opens (or passes on) once."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor.detach())
    return tuple(args)


def open_shared(args: Sequence[Any], device_index: int) -> torch.Tensor:
    """The tensor that :func:`share` described, opened on this process's GPU ``device_index`` (the sender's GPU by
    its local index here). To pass it on, :meth:`PassOn.lend` it."""
    from torch.multiprocessing import reductions

    tensor: torch.Tensor = reductions.rebuild_cuda_tensor(*_here(args, device_index))
    return tensor


def _here(args: Sequence[Any], device_index: int) -> tuple[Any, ...]:
    out = list(args)
    out[_DEVICE] = device_index
    out[_EVENT_SYNC] = False
    return tuple(out)


class PassOn:
    """How one sync's tensors that this process opened from another's memory pass on to a third process: the
    receiver :meth:`lend` s each opened tensor (with its spare share, when the sender sent one), hands this
    object to its engine's load session (``LoadSession.pass_on``), and the engine pickles its payloads with
    :meth:`dumps`. :meth:`settle` releases the spares not used. One object per sync, owned by the receiver:
    nothing is kept process-wide."""

    def __init__(self) -> None:
        self._spare: dict[int, tuple[Any, list[tuple[Any, ...]], int]] = {}
        """StorageImpl address of an opened storage → (a weak reference, which keeps that address from reuse
        while it is here; the spare shares of that storage not passed on yet; the element offset of the opened
        storage's start in the spare's storage: 0 for torch's, the trainer tensor's own offset for a driver
        view)."""
        self.passed = 0
        """Tensors on opened memory passed on by :meth:`dumps` (under a spare share or as a copy)."""

    def __len__(self) -> int:
        """How many opened storages are lent here (and not settled)."""
        return len(self._spare)

    def lend(self, tensor: torch.Tensor, spare: Sequence[Any] | None, device_index: int, shift: int = 0) -> None:
        """Remember ``tensor``'s storage as opened memory, with ``spare`` (a second :func:`share` of the same
        tensor, or None) to pass it on once; ``shift`` is the storage's start in the spare's storage (elements)."""
        from torch.multiprocessing import reductions

        storage = tensor.untyped_storage()
        entry = self._spare.get(storage._cdata)
        if entry is None or entry[0].expired():
            entry = self._spare[storage._cdata] = (reductions.StorageWeakRef(storage), [], shift)
        if spare is not None:
            entry[1].append(_here(spare, device_index))

    def settle(self, tensors: Iterable[torch.Tensor]) -> None:
        """Release the spare shares of ``tensors`` not passed on (the producer's count goes back down)."""
        for tensor in tensors:
            entry = self._spare.pop(tensor.untyped_storage()._cdata, None)
            release(entry[1] if entry is not None else ())

    def _passed_on(self, tensor: torch.Tensor) -> Any:
        """How ``tensor`` travels if it lies on opened memory: torch's reduction of a spare share (the view's
        geometry, the share's storage) or of a copy; None for memory of this process's own."""
        from torch.multiprocessing import reductions

        entry = self._spare.get(tensor.untyped_storage()._cdata)
        if entry is None or entry[0].expired():
            return None
        self.passed += 1
        if not entry[1]:
            # torch keeps the copy's memory until the consumer releases it, though our reference ends here.
            return reductions.reduce_tensor(tensor.detach().clone())
        a = entry[1].pop()
        geometry = (a[0], tensor.size(), tensor.stride(), entry[2] + tensor.storage_offset())
        return reductions.rebuild_cuda_tensor, (*geometry, a[4], tensor.dtype, *a[6:10], False, *a[11:])

    def dumps(self, obj: Any) -> bytes:
        """:func:`dumps` of ``obj``, a tensor lent here travelling under its spare share (or as a copy)."""
        return dumps(obj, self)


def release(shares: Iterable[Sequence[Any] | None]) -> None:
    """Release :func:`share`'s shares that nobody will open (their producer's counts go back down): a receiver
    that cannot open a sync's shares releases them, or the trainer's memory stays held for good."""
    import torch

    for args in shares:
        if args is not None:
            torch.UntypedStorage._release_ipc_counter_cuda(args[_REF_COUNTER], args[_REF_COUNTER + 1])


def dumps(obj: Any, pass_on: PassOn | None = None) -> bytes:
    """``obj`` pickled for another process with torch's reductions (CUDA tensors travel as IPC handles); with
    ``pass_on``, a tensor lent there (opened from another process's memory) travels under its spare share, or as
    a copy when none is left."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler

    lent = pass_on if pass_on is not None and len(pass_on) else None

    class _Pickler(ForkingPickler):  # type: ignore[misc, valid-type]
        def reducer_override(self, o: Any) -> Any:
            if lent is not None and isinstance(o, torch.Tensor) and o.is_cuda:
                reduced = lent._passed_on(o)
                if reduced is not None:
                    return reduced
            return NotImplemented

    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return buf.getvalue()


# ---- CUDA driver handles: one per allocation ------------------------------------------------------------------
def handles() -> str:
    """The sender's way of sharing for this sync (``$GENENGINE_CUDA_IPC_HANDLES``, default ``driver``)."""
    value = os.environ.get(HANDLES_ENV, "").strip() or HANDLES[0]
    if value not in HANDLES:
        raise InvalidArgumentError(f"{HANDLES_ENV}={value!r}: allowed are {', '.join(map(repr, HANDLES))}")
    return value


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # CUipcMemHandle


_LEGACY_IPC_CAPABLE = 10  # CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
_LAZY_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class _Driver:
    """libcuda's IPC calls (ctypes), each in the device's primary context, the one torch uses."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, ptr = ctypes.c_uint64, ctypes.POINTER
        for name, args in {
            "cuGetErrorString": (ctypes.c_int, ptr(ctypes.c_char_p)),
            "cuDeviceGet": (ptr(ctypes.c_int), ctypes.c_int),
            "cuDevicePrimaryCtxRetain": (ptr(ctypes.c_void_p), ctypes.c_int),
            "cuCtxPushCurrent_v2": (ctypes.c_void_p,),
            "cuCtxPopCurrent_v2": (ptr(ctypes.c_void_p),),
            "cuMemGetAddressRange_v2": (ptr(u64), ptr(ctypes.c_size_t), u64),
            "cuPointerGetAttribute": (ctypes.c_void_p, ctypes.c_int, u64),
            "cuIpcGetMemHandle": (ptr(_Handle), u64),
            "cuIpcOpenMemHandle_v2": (ptr(u64), _Handle, ctypes.c_uint),
            "cuIpcCloseMemHandle": (u64,),
        }.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        self._lib = lib
        self._contexts: dict[int, ctypes.c_void_p] = {}

    def check(self, result: int, what: str) -> None:
        if result != 0:
            text = ctypes.c_char_p()
            self._lib.cuGetErrorString(result, ctypes.byref(text))
            raise RuntimeError(f"{what}: CUDA driver error {result} ({(text.value or b'?').decode()})")

    @contextlib.contextmanager
    def context(self, device_index: int) -> Iterator[Any]:
        ctx = self._contexts.get(device_index)
        if ctx is None:  # retained once per process and device, as torch's runtime holds it anyway
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            self.check(self._lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
            self.check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self._contexts[device_index] = ctx
        self.check(self._lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            yield self._lib
        finally:
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


@functools.cache
def _driver() -> _Driver | None:
    """The process's driver calls (loaded once); None where libcuda cannot be loaded."""
    try:
        return _Driver()
    except (OSError, AttributeError) as exc:
        log.debug("CUDA driver IPC unavailable: %s", exc)
        return None


def share_allocations(
    tensors: Sequence[torch.Tensor], device_index: int
) -> tuple[list[bytes], list[tuple[int, int, int]]] | None:
    """One driver handle per allocation that ``tensors`` (on GPU ``device_index`` of this process) lie in: (the
    handles, and per tensor (its allocation, its data's byte offset there, its storage offset in elements)).
    None where the driver cannot share one of them (memory of expandable segments, no libcuda): the caller
    shares the torch way. The tensors must stay referenced until every receiver closed the handles."""
    driver = _driver()
    if driver is None:
        return None
    bases: dict[int, int] = {}
    out: list[bytes] = []
    places: list[tuple[int, int, int]] = []
    try:
        with driver.context(device_index) as lib:
            for tensor in tensors:
                pointer = tensor.data_ptr()
                base, size = ctypes.c_uint64(), ctypes.c_size_t()
                driver.check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), pointer), "range")
                index = bases.get(base.value)
                if index is None:
                    capable = ctypes.c_int(0)
                    attribute = _LEGACY_IPC_CAPABLE
                    driver.check(lib.cuPointerGetAttribute(ctypes.byref(capable), attribute, base.value), "attr")
                    if not capable.value:
                        log.debug("CUDA driver IPC: an allocation is not shareable (expandable segments?)")
                        return None
                    handle = _Handle()
                    driver.check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
                    index = bases[base.value] = len(out)
                    out.append(bytes(handle.reserved))
                places.append((index, pointer - base.value, int(tensor.storage_offset())))
    except RuntimeError as exc:
        log.debug("CUDA driver IPC: %s; sharing the torch way", exc)
        return None
    return out, places


class _Mapping:
    """One allocation of the sender's, opened in this process; closed when the last view onto it is gone."""

    def __init__(self, driver: _Driver, handle: bytes, device_index: int) -> None:
        self._driver, self._device = driver, device_index
        pointer = ctypes.c_uint64()
        with driver.context(device_index) as lib:
            flags = _LAZY_PEER_ACCESS
            opened = lib.cuIpcOpenMemHandle_v2(ctypes.byref(pointer), _Handle.from_buffer_copy(handle), flags)
            driver.check(opened, "cuIpcOpenMemHandle")
        self.pointer = pointer.value

    def __del__(self) -> None:
        pointer = getattr(self, "pointer", None)
        if pointer is None:
            return
        try:
            with self._driver.context(self._device) as lib:
                self._driver.check(lib.cuIpcCloseMemHandle(pointer), "cuIpcCloseMemHandle")
        except Exception as exc:  # a finalizer: nothing may escape it
            log.warning("closing a CUDA IPC handle of the trainer's memory failed: %s", exc)


class _Memory:
    """``nbytes`` of a mapping for ``torch.as_tensor`` (CUDA array interface: no copy); the tensor's storage
    keeps this object, and so the mapping, alive."""

    def __init__(self, mapping: _Mapping, offset: int, nbytes: int) -> None:
        self.mapping = mapping
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (mapping.pointer + offset, False),
            "strides": None,
            "version": 2,
        }


class Opened:
    """The allocations of :func:`share_allocations`' handles, opened in this process on GPU ``device_index`` (the
    sender's GPU by its local index here); :meth:`view` gives the tensors. Each allocation closes as soon as no
    view onto it is left, which a receiver lets happen before it acknowledges."""

    def __init__(self, handles: Sequence[bytes], device_index: int) -> None:
        driver = _driver()
        if driver is None:
            raise RuntimeError("the sender shared CUDA driver handles and libcuda cannot be loaded here")
        self._device = device_index
        self._maps: list[_Mapping] | None = [_Mapping(driver, h, device_index) for h in handles]
        self._alive = [weakref.ref(m) for m in self._maps]

    def view(self, place: Sequence[int], dtype: str, shape: Sequence[int], nbytes: int) -> torch.Tensor:
        """The tensor at ``place`` (``share_allocations``'); to pass it on, :meth:`PassOn.lend` it with
        ``shift=place[2]``."""
        import torch

        assert self._maps is not None, "views are made before release()"
        index, offset, _ = place
        raw = torch.as_tensor(_Memory(self._maps[index], offset, nbytes))
        return raw.view(getattr(torch, dtype)).view(tuple(shape))

    def release(self) -> int:
        """Drop this object's hold on the allocations (each closes when its last view is gone); the number still
        open after a garbage collection: views something kept, which hold the trainer's memory."""
        self._maps = None
        if any(alive() is not None for alive in self._alive):
            gc.collect()
        return sum(alive() is not None for alive in self._alive)
