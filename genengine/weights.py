"""Checking and bucketing the trainer's (name, tensor) stream, shared by every backend.

Silent name mismatches degrade training without an error (LightRFT PR #55), so every tensor is
checked against the engine's own list of weights before a byte of its bucket is written.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from genengine.errors import WeightLoadError, closest

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_BUCKET_BYTES", "WeightInfo", "WeightValidator", "iter_buckets", "tensor_nbytes"]

DEFAULT_BUCKET_BYTES = 512 << 20
"""Default bucket: big enough that per-call overhead vanishes, small enough for any colocated GPU."""


@dataclass(frozen=True)
class WeightInfo:
    """What the engine expects under one HF parameter name."""

    shape: tuple[int, ...]
    dtype: str
    required: bool = True
    """False for aliases an engine can do without, such as a tied ``lm_head.weight``."""


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


class WeightValidator:
    """Checks one ``load_weights`` call's tensors: known name, not seen before, tensor, floating, shape."""

    def __init__(self, spec: Mapping[str, WeightInfo]) -> None:
        self.spec = spec
        self.seen: set[str] = set()

    def check(self, index: int, item: Any) -> tuple[str, torch.Tensor]:
        import torch

        if not isinstance(item, tuple) or len(item) != 2:
            raise WeightLoadError(f"entry {index} is {type(item).__name__}, expected a (name, tensor) pair")
        name, tensor = item
        if not isinstance(name, str):
            raise WeightLoadError(f"entry {index}: name {name!r} is not a string")
        info = self.spec.get(name)
        if info is None:
            hint = closest(name, self.spec)
            raise WeightLoadError(
                f"unknown weight {name!r}"
                + (f" (did you mean {hint!r}?)" if hint else "")
                + f"; the engine has {len(self.spec)} weights"
            )
        if name in self.seen:
            raise WeightLoadError(f"weight {name!r} given twice in one load_weights call")
        if not isinstance(tensor, torch.Tensor):
            raise WeightLoadError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if not tensor.is_floating_point():
            raise WeightLoadError(
                f"weight {name!r} has dtype {tensor.dtype}; a floating dtype is required "
                f"(it is cast to the engine's {info.dtype})"
            )
        if tuple(tensor.shape) != info.shape:
            raise WeightLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, the engine expects {info.shape}")
        self.seen.add(name)
        return name, tensor


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    validator: WeightValidator,
    bucket_bytes: int,
    *,
    validate_all_first: bool,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group validated pairs into buckets of at most ``bucket_bytes`` (a larger tensor is a bucket alone).

    With ``validate_all_first`` the whole stream is read and checked before the first bucket is
    yielded, which makes a call all-or-nothing at the price of holding every reference at once.
    """
    source: Iterable[Any] = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    if validate_all_first:
        checked = [validator.check(i, item) for i, item in enumerate(source)]
        source_iter: Iterable[tuple[str, torch.Tensor]] = checked
    else:
        source_iter = (validator.check(i, item) for i, item in enumerate(source))
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in source_iter:
        nbytes = tensor_nbytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
