"""Checking, bucketing and materialising the trainer's (name, tensor) stream, shared by every backend.

Silent name mismatches degrade training without an error (LightRFT PR #55), so every tensor is
checked against the engine's own list of weights before a byte of its bucket is written. What a
trainer hands over varies (FSDP2 gives ``DTensor`` shards, ``named_parameters()`` views, bf16 copies),
so the tensor kinds are handled here once: each backend's ``_apply_weights`` receives plain, dense,
contiguous tensors of the engine's shapes and nothing else.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from genengine.errors import InvalidArgumentError, WeightLoadError, closest

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "WeightInfo",
    "WeightValidator",
    "check_load_options",
    "check_named_tensors",
    "check_storage",
    "check_stream",
    "group_buckets",
    "iter_buckets",
    "materialize",
    "tensor_nbytes",
]

DEFAULT_BUCKET_BYTES = 512 << 20
"""Default bucket: big enough that per-call overhead vanishes, small enough for any colocated GPU."""

_ALLOWED = "allowed are dense (strided) tensors with data, on any device, views and DTensors included"

_HOLDS_ITS_TENSORS: tuple[type, ...] = (list, tuple, type({}.items()))
"""Sources whose tensors all exist already (OrderedDict's items view subclasses dict's): checking them
all before the first write holds no extra memory, so such a call is all-or-nothing on every backend."""


@dataclass(frozen=True)
class WeightInfo:
    """What the engine expects under one HF parameter name."""

    shape: tuple[int, ...]
    dtype: str
    required: bool = True
    """False for aliases an engine can do without, such as a tied ``lm_head.weight``."""


def check_load_options(*, bucket_bytes: object, check_finite: object, version: object) -> None:
    """``load_weights``'s options, checked before anything moves (by every engine, and by the Ray pool before
    it reaches a replica)."""
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
        raise InvalidArgumentError(f"version={version!r} must be an integer >= 0 or None")
    if bucket_bytes is not None and (
        isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1
    ):
        raise InvalidArgumentError(f"bucket_bytes={bucket_bytes!r} must be a positive integer or None")
    if not isinstance(check_finite, bool):
        raise InvalidArgumentError(f"check_finite={check_finite!r} must be True or False")


def check_named_tensors(named_tensors: object) -> None:
    """``load_weights`` takes (name, tensor) pairs: any iterable of them or a mapping, not a string."""
    if isinstance(named_tensors, (str, bytes)) or not isinstance(named_tensors, (Iterable, Mapping)):
        raise InvalidArgumentError(
            f"load_weights takes an iterable of (name, tensor) pairs, got {type(named_tensors).__name__}"
        )


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the whole tensor (a DTensor's full size: what its gathered copy holds)."""
    return int(tensor.numel()) * int(tensor.element_size())


def _dtensor_type() -> type | None:
    """``DTensor`` if torch.distributed.tensor was imported; no object can be one otherwise (and importing
    it costs seconds, so a plain trainer never pays for it)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def _storage_bytes_needed(tensor: torch.Tensor) -> int:
    numel = tensor.numel()
    if numel == 0:
        return 0
    if tensor.is_contiguous():  # the common case, without a Python loop over the strides (a load checks every tensor)
        return int(tensor.storage_offset() + numel) * tensor.element_size()
    last = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return int(last + 1) * tensor.element_size()


def check_storage(name: str, tensor: Any) -> None:
    """A plain tensor whose storage is smaller than its shape needs (freed) is refused before anything reads
    it: reading it can crash the process (torch does not always check), or pickle whatever memory follows."""
    import torch

    if type(tensor) in (torch.Tensor, torch.nn.Parameter) and not tensor.is_meta:  # DTensor: its own memory
        if tensor.is_nested or tensor.layout != torch.strided:
            return
        _check_storage_bytes(name, tensor)


def _check_storage_bytes(name: str, tensor: torch.Tensor) -> None:
    """``check_storage`` for a plain strided tensor with data (the caller has checked its kind)."""
    have, need = tensor.untyped_storage().nbytes(), _storage_bytes_needed(tensor)
    if have < need:
        # FSDP frees unsharded parameters so.
        raise WeightLoadError(
            f"weight {name!r} has no data: its storage holds {have} bytes, its shape needs {need} "
            f"(was it freed, e.g. by FSDP's reshard, before load_weights wrote it?); {_ALLOWED}"
        )


def _check_data(name: str, tensor: torch.Tensor, info: WeightInfo | None) -> None:
    """The metadata checks (no data is read): a kind with data, a floating dtype, the engine's shape.

    ``info`` None: a stream checked without an engine's spec (a transport's sender, ``check_stream``): no shape
    to compare, and the dtype message names the tensor's own (as it always has on that side)."""
    import torch

    if tensor.is_meta:
        raise WeightLoadError(f"weight {name!r} is a meta tensor (a shape without data); {_ALLOWED}")
    if tensor.is_nested or tensor.layout != torch.strided:
        kind = "nested" if tensor.is_nested else str(tensor.layout)
        raise WeightLoadError(f"weight {name!r} is a {kind} tensor; {_ALLOWED} (convert it with .to_dense())")
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):  # check_storage, its kind checked just above
        _check_storage_bytes(name, tensor)
    if not tensor.is_floating_point():
        raise WeightLoadError(
            f"weight {name!r} has dtype {tensor.dtype}; a floating dtype is required "
            f"(it is cast to the engine's {tensor.dtype if info is None else info.dtype})"
        )
    if info is not None and tuple(tensor.shape) != info.shape:
        raise WeightLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, the engine expects {info.shape}")


def check_tensor_finite(name: str, tensor: torch.Tensor) -> None:
    import torch

    if not bool(torch.isfinite(tensor).all()):
        raise WeightLoadError(
            f"weight {name!r} holds NaN or infinite values (check_finite=True); only finite weights are loaded"
        )


def _pair(index: int, item: Any) -> tuple[str, Any]:
    """Entry ``index`` of a stream as (name, tensor): a pair whose name is a string."""
    if not isinstance(item, tuple) or len(item) != 2:
        raise WeightLoadError(f"entry {index} is {type(item).__name__}, expected a (name, tensor) pair")
    name, tensor = item
    if not isinstance(name, str):
        raise WeightLoadError(f"entry {index}: name {name!r} is not a string")
    return name, tensor


def _twice(name: str) -> WeightLoadError:
    return WeightLoadError(f"weight {name!r} given twice in one load_weights call")


def _not_a_tensor(name: str, tensor: object) -> WeightLoadError:
    return WeightLoadError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")


def check_stream(items: Iterable[Any]) -> list[tuple[str, torch.Tensor]]:
    """A weight transport sender's one check of the trainer's pulled stream, before anything is sent.

    The sender has no engine's list of weights: it checks what it can without one, with ``load_weights``'
    messages: (name, tensor) pairs, a string name given once, a ``torch.Tensor`` of a kind with data and a
    floating dtype. Reads no tensor data. Names and shapes are checked once more, against the engine, by each
    receiver's load session (the other side of the sync)."""
    import torch

    seen: set[str] = set()
    checked = []
    for index, item in enumerate(items):
        name, tensor = _pair(index, item)
        if name in seen:
            raise _twice(name)
        if not isinstance(tensor, torch.Tensor):
            raise _not_a_tensor(name, tensor)
        _check_data(name, tensor, None)
        seen.add(name)
        checked.append((name, tensor))
    return checked


def materialize(
    bucket: Iterable[tuple[str, torch.Tensor]], *, check_finite: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """Checked pairs as plain dense tensors, right before they are written or packed (no check of their own).

    DTensors are gathered with ``full_tensor()``, a collective over their mesh: every rank reaches it in stream
    order, since every rank handles the same buckets in order (with ``check_finite``, a gathered DTensor's values
    are checked: the whole tensor, so every rank decides alike). Views are made contiguous."""
    import torch

    ready = []
    with torch.no_grad():
        for name, tensor in bucket:
            if _is_dtensor(tensor):
                tensor = tensor.full_tensor()  # type: ignore[attr-defined]
                if check_finite:
                    check_tensor_finite(name, tensor)
            tensor = tensor.detach()
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
            ready.append((name, tensor))
    return ready


class WeightValidator:
    """Checks one ``load_weights`` call's tensors: known name, not seen before, a tensor of a kind with data,
    floating, the engine's shape (and, with ``check_finite``, finite values).

    Each tensor is checked once, by ``check``, right before its bucket is written (``LoadSession.write``, or
    ``iter_buckets`` over a source it pulled whole). Only a one-pass stream's buckets are checked again
    (``recheck``): the trainer's code ran while the rest of the bucket was pulled."""

    def __init__(self, spec: Mapping[str, WeightInfo], *, check_finite: bool = False) -> None:
        self.spec = spec
        self.check_finite = check_finite
        self.seen: set[str] = set()

    def check(self, index: int, item: Any) -> tuple[str, torch.Tensor]:
        import torch

        name, tensor = _pair(index, item)
        info = self.spec.get(name)
        if info is None:
            hint = closest(name, self.spec)
            raise WeightLoadError(
                f"unknown weight {name!r}"
                + (f" (did you mean {hint!r}?)" if hint else "")
                + f"; the engine has {len(self.spec)} weights"
            )
        if name in self.seen:
            raise _twice(name)
        if not isinstance(tensor, torch.Tensor):
            raise _not_a_tensor(name, tensor)
        _check_data(name, tensor, info)
        if self.check_finite and not _is_dtensor(tensor):  # a DTensor's values are checked once gathered
            check_tensor_finite(name, tensor)
        self.seen.add(name)
        return name, tensor

    def recheck(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """A one-pass stream's bucket, checked again right before it is written: the trainer may free or re-point
        a tensor after handing it over (its code runs while the engine pulls the rest of the bucket), and
        reading freed storage crashes the process. The metadata only: names were settled by ``check``."""
        for name, tensor in bucket:
            _check_data(name, tensor, self.spec[name])

    def prepare(self, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """A checked bucket as ``_apply_weights`` takes it: ``materialize`` with this call's ``check_finite``."""
        return materialize(bucket, check_finite=self.check_finite)


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    validator: WeightValidator,
    bucket_bytes: int,
    *,
    validate_all_first: bool,
    cost: Callable[[torch.Tensor], int] = tensor_nbytes,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group checked pairs into buckets of at most ``bucket_bytes`` (a larger tensor is a bucket alone).

    ``cost`` is what a tensor adds to its bucket: the bytes the backend must copy to write it (by default
    all of them). A tensor the backend reads in place costs nothing, so such tensors share one bucket.

    The whole source is checked before the first bucket is yielded when ``validate_all_first`` is set
    (all-or-nothing at the price of holding every reference at once) and when the source is a dict (or
    its items view), list or tuple, which holds every reference anyway. A one-pass iterator is otherwise
    checked bucket by bucket: a bad entry is found before its own bucket is written, not before earlier ones,
    and each bucket's metadata is checked again right before it is yielded (``WeightValidator.recheck``).
    """
    source: Iterable[Any] = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    one_pass = not (validate_all_first or isinstance(source, _HOLDS_ITS_TENSORS))
    if one_pass:
        checked: Iterable[tuple[str, torch.Tensor]] = (validator.check(i, item) for i, item in enumerate(source))
    else:
        # Pulled first, checked after: no trainer code runs between these checks and the writes, so a tensor
        # the trainer released after handing it over is caught here, and needs no second check.
        pulled = list(source)
        checked = [validator.check(i, item) for i, item in enumerate(pulled)]
    for bucket in group_buckets(checked, bucket_bytes, cost):
        if one_pass:
            validator.recheck(bucket)
        yield bucket


def group_buckets(
    pairs: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, cost: Callable[[torch.Tensor], int] = tensor_nbytes
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Checked pairs in order, in buckets whose ``cost`` sums to at most ``bucket_bytes`` (a larger tensor alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in pairs:
        nbytes = cost(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
