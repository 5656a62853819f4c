"""genengine's SGLang backend (SGLang 0.5.12 - 0.5.17), and a drop-in for ``lightrft.strategy.sglang_utils``.

``SGLangEngine`` (the protocol engine), and LightRFT's ``get_sglang_engine``, ``get_sglang_engine_for_rollout``
and ``RLGenerationEngine``, load lazily: importing this package (which ``genengine_sglang.plugin`` does, and
with it ``genengine backends``) imports neither torch nor SGLang.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from genengine_sglang.engine import SGLangEngine
    from genengine_sglang.lightrft import RLGenerationEngine, get_sglang_engine, get_sglang_engine_for_rollout

__all__ = ["RLGenerationEngine", "SGLangEngine", "get_sglang_engine", "get_sglang_engine_for_rollout"]

_LAZY = {
    "SGLangEngine": "genengine_sglang.engine",
    "RLGenerationEngine": "genengine_sglang.lightrft",
    "get_sglang_engine": "genengine_sglang.lightrft",
    "get_sglang_engine_for_rollout": "genengine_sglang.lightrft",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
