"""A template genengine backend; ``TemplateEngine`` is imported lazily so listing backends stays cheap."""

from __future__ import annotations

from typing import Any

__all__ = ["TemplateEngine"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "TemplateEngine":
        from genengine_template.engine import TemplateEngine

        return TemplateEngine
    raise AttributeError(name)
