"""Code SGLang's scheduler processes import by name (``custom_weight_loader``); keep it tiny.

SGLang answers ``update_weights_from_tensor`` once its scheduler returns from ``load_weights``, but the
copies it launched may still be running on the GPU: the trainer would be told its tensors are free while
they are still being read. This loader synchronises the device before returning, so the reply is the
barrier. It costs the copy time itself (which has to be waited for anyway), against the ~66 ms of a
one-token generate used as a barrier elsewhere, and it works while the KV cache is released, when a
generate cannot run. Called with no tensors it is a pure barrier.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["load_weights_and_sync"]


def load_weights_and_sync(model: Any, named_tensors: Iterable[tuple[str, Any]]) -> None:
    import torch

    tensors = list(named_tensors)
    if tensors:
        model.load_weights(tensors)
    torch.cuda.synchronize()
