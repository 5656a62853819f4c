"""The API pages of the runtimes cover their packages: every name that ``genengine.ray`` and
``genengine.transport`` export has its ``:::`` entry on its page (docs/reference/pool.md, transport.md), so a
name added to a package's ``__all__`` without a page entry fails here rather than going undocumented."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)
PAGES = {"genengine.ray": "reference/pool.md", "genengine.transport": "reference/transport.md"}


@pytest.mark.parametrize(("package", "page"), sorted(PAGES.items()))
def test_every_exported_name_has_an_entry(package: str, page: str) -> None:
    exported = set(importlib.import_module(package).__all__)
    rendered = {d.removeprefix(package + ".") for d in DIRECTIVE.findall((DOCS / page).read_text(encoding="utf-8"))}
    missing = sorted(exported - rendered)
    assert not missing, f"docs/{page} has no ::: {package}.NAME entry for {missing}"
    unknown = sorted(d for d in rendered if "." not in d and d not in exported)
    assert not unknown, f"docs/{page} renders {unknown}, which {package}.__all__ does not export"
