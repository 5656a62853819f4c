"""genengine's SGLang backend (SGLang 0.5.17), and a drop-in for ``lightrft.strategy.sglang_utils``.

``get_sglang_engine``, ``get_sglang_engine_for_rollout`` and ``RLGenerationEngine`` load lazily: importing
this package (which ``genengine_sglang.plugin`` does, and with it ``genengine backends``) imports neither
torch nor SGLang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from genengine_sglang.engine import RLGenerationEngine, get_sglang_engine, get_sglang_engine_for_rollout

__all__ = ["RLGenerationEngine", "get_sglang_engine", "get_sglang_engine_for_rollout"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from genengine_sglang import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
