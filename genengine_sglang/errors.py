"""Errors of the SGLang backend beyond genengine's own."""

from __future__ import annotations

from genengine.errors import GenEngineError

__all__ = ["SGLangEngineError"]


class SGLangEngineError(GenEngineError, RuntimeError):
    """SGLang failed a call (or answered in a way genengine cannot map); its message is included."""
