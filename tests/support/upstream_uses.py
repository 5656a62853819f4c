"""Check a plugin's declared upstream uses against the installed engine by importing it (GPU machine only).

``tests/plugins/test_engine_surfaces.py`` checks the uses against surfaces read from the wheels by AST; this checks
the same uses against the real, imported engine, so a fault of the AST reading (a name it finds that does not
exist at run time, or a signature it misreads) shows on the GPU machine. Importable without the engine.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any

__all__ = ["unresolved_uses"]

_ROOT = Path(__file__).resolve().parent.parent.parent


def _tool() -> Any:
    spec = importlib.util.spec_from_file_location("engine_surface", _ROOT / "tools" / "engine_surface.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _has_member(cls: type, member: str) -> bool:
    if hasattr(cls, member):
        return True
    if dataclasses.is_dataclass(cls) and member in {f.name for f in dataclasses.fields(cls)}:
        return True
    for klass in inspect.getmro(cls):  # an attribute its methods assign on self
        try:
            if f"self.{member}" in inspect.getsource(klass):
                return True
        except (OSError, TypeError):
            continue
    return member in getattr(cls, "__annotations__", {}) or member in getattr(cls, "__struct_fields__", ())


def _accepts(target: Any, args: list[str]) -> list[str]:
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return []
    return [a for a in args if a not in params]


def unresolved_uses(plugin: str, version: str) -> dict[str, str]:
    """``{use: why}`` for each required use of ``plugin`` (``genengine_vllm`` ...) that the installed engine
    lacks, leaving out those ``compat.BRANCHES`` says ``version`` lacks."""
    tool = _tool()
    upstream = importlib.import_module(f"{plugin}.upstream")
    compat = importlib.import_module(f"{plugin}.compat")
    out: dict[str, str] = {}
    for use in upstream.USES:
        if use.startswith("?") or version in compat.BRANCHES.get(use, ()):
            continue
        module_name, path, args = tool.parse_use(use)
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # an engine that fails to import is as unusable as one that lacks the module
            out[use] = f"import {module_name}: {type(exc).__name__}: {exc}"
            continue
        if not hasattr(module, path[0]):
            out[use] = f"{module_name} has no {path[0]}"
            continue
        target = getattr(module, path[0])
        if len(path) > 1:
            if not _has_member(target, path[1]):
                out[use] = f"{target} has no member {path[1]}"
                continue
            target = getattr(target, path[1], None)
        if args and target is not None:
            absent = _accepts(target, args)
            if absent:
                out[use] = f"{use} takes no {absent}"
    return out
