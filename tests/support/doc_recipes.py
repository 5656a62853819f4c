"""Run the Python recipes of the docs as written: the ``python`` blocks of a page's ``## heading`` section, executed
in a fresh namespace (torch's thread count restored after, as a recipe may set it)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[2] / "docs"


def section(page: str, heading: str) -> str:
    """The text of ``docs/page``'s ``## heading`` section, up to the next ``## ``."""
    text = (DOCS / page).read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def run_recipe(code: str, label: str, name: str) -> dict[str, Any]:
    """Execute ``code`` as module ``name`` (``label`` names it in tracebacks); its namespace."""
    import torch

    namespace: dict[str, Any] = {"__name__": name}
    threads = torch.get_num_threads()
    try:
        exec(compile(code, label, "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
    return namespace
