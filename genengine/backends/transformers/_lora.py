"""The embedded backend's LoRA: a forward hook on each adapted linear layer adds, row by row, the delta of the
adapter that row is generated with (``scaling * x @ A.T @ B.T``), so one batch can mix adapters and the base.

The base weights are never touched (no merged copy); an adapter's tensors are copied once, to the engine's
device and dtype, when it is loaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from genengine.adapters import Adapter

__all__ = ["LoraLayers", "LoraWeights"]


@dataclass(eq=False)
class LoraWeights:
    """One adapter on the engine's device: module path → ``(A [r, in], B [out, r])``, and its scale."""

    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float


class LoraLayers:
    """The hooks, and the rows' adapters of the model call in progress (set by ``rows`` around each call)."""

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        self._modules = dict(model.named_modules())
        self._device, self._dtype = device, dtype
        self._hooks: dict[str, Any] = {}
        self._groups: list[tuple[LoraWeights, torch.Tensor]] = []

    def prepare(self, adapter: Adapter) -> LoraWeights:
        """The adapter's tensors on the engine's device and dtype, with a hook on each module it adapts."""
        import torch

        with torch.no_grad():
            pairs = {
                path: (
                    a.detach().to(self._device, self._dtype, copy=True),
                    b.detach().to(self._device, self._dtype, copy=True),
                )
                for path, (a, b) in adapter.pairs.items()
            }
        for path in pairs:
            if path not in self._hooks:
                self._hooks[path] = self._modules[path].register_forward_hook(self._hook(path))
        return LoraWeights(pairs, adapter.config.scaling)

    @contextlib.contextmanager
    def rows(self, loras: Sequence[LoraWeights | None]) -> Iterator[None]:
        """Within the block, row ``i`` of the model's input is generated with ``loras[i]`` (None: the base)."""
        import torch

        if all(lora is None for lora in loras):
            yield
            return
        groups: dict[int, tuple[LoraWeights, list[int]]] = {}
        for i, lora in enumerate(loras):
            if lora is not None:
                groups.setdefault(id(lora), (lora, []))[1].append(i)
        self._groups = [(lora, torch.tensor(idx, device=self._device)) for lora, idx in groups.values()]
        try:
            yield
        finally:
            self._groups = []

    def _hook(self, path: str) -> Any:
        def add_delta(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            for lora, index in self._groups:
                pair = lora.pairs.get(path)
                if pair is None:
                    continue
                a, b = pair
                x = args[0].index_select(0, index)
                output.index_add_(0, index, ((x @ a.T) @ b.T).mul_(lora.scaling).to(output.dtype))
            return output

        return add_delta

    def close(self) -> None:
        for hook in self._hooks.values():
            hook.remove()
        self._hooks = {}
        self._groups = []
        self._modules = {}  # so that a shut-down engine holds no reference to its model
