"""The reference's memory saver (``lightrft.strategy.sglang_utils.sgl_model_saver``), on genengine's engine.

LightRFT patches these two into SGLang's ``Scheduler``; SGLang 0.5.17 has them built in (docs/upstream.md), so
here they keep their meaning at the level users call: release the GPU memory of an engine with its weights kept
(a level-1 ``sleep``: in host memory with the engine option ``enable_weights_cpu_backup``, else left on the
GPU), and take it back. Both act on one ``RLGenerationEngine`` (any ``SGLangEngine``), or, without an argument,
on every live engine of this process; collective like the engine's own methods: every rank of a TP group calls
them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from genengine.engine.lifecycle import live_engines
from genengine.errors import InvalidArgumentError

if TYPE_CHECKING:
    from genengine_sglang.engine import SGLangEngine

__all__ = ["release_memory_occupation", "resume_memory_occupation"]


def _engines(engine: Any) -> list[SGLangEngine]:
    from genengine_sglang.engine import SGLangEngine

    if engine is None:
        return live_engines(SGLangEngine)
    if not isinstance(engine, SGLangEngine):
        raise InvalidArgumentError(
            f"expected a genengine_sglang RLGenerationEngine (or None for every live engine), got "
            f"{type(engine).__name__}"
        )
    return [engine]


def release_memory_occupation(engine: SGLangEngine | None = None) -> None:
    """Release GPU memory while keeping the weights (a level-1 sleep); returns once the memory is free.

    A no-op for engines already asleep.
    """
    for each in _engines(engine):
        each.sleep(1)


def resume_memory_occupation(engine: SGLangEngine | None = None, tags: Sequence[str] | None = None) -> None:
    """Take the released memory back: all of it, or ``tags`` (``"weights"``, ``"kv_cache"``, ``"cuda_graph"``)."""
    for each in _engines(engine):
        each.wake(tags)
