"""genengine's vLLM backend (vLLM 0.24.0 - 0.26.0, colocated in the trainer's processes).

Importing this package (which ``genengine_vllm.plugin`` does when backends are listed) loads neither
vLLM nor torch: the public names resolve on first use.

Modules, shaped as the SGLang plugin's: ``engine`` (the protocol class), ``settings`` (engine config →
``vllm.LLM`` arguments), ``mapping`` (our types ↔ vLLM's), ``raw`` (the bench's plain ``vllm.LLM``),
``plugin`` (registration), ``lightrft`` (the reference-style ``get_vllm_engine``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from genengine_vllm.engine import VLLMEngine
    from genengine_vllm.lightrft import get_vllm_engine

__all__ = ["VLLMEngine", "get_vllm_engine"]

_LAZY = {"VLLMEngine": "genengine_vllm.engine", "get_vllm_engine": "genengine_vllm.lightrft"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
