"""Every error class has the builtin base the docs promise (issue 20), read from the docs themselves.

docs/troubleshooting.md has a table of every class with its base classes; docs/contract.md's "Errors"
section promises builtins in prose ("`X`/`Y` are `ValueError`s, the state errors are `RuntimeError`s, ...").
Both are parsed, so a class whose bases change, or a doc that says otherwise, fails here.
"""

from __future__ import annotations

import builtins
import re
from pathlib import Path

from genengine import errors

DOCS = Path(__file__).resolve().parents[2] / "docs"
CLASSES = {n: getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)}


def _troubleshooting_table() -> dict[str, set[str]]:
    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8").split("## Errors at a glance", 1)[1]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = set(re.findall(r"`(\w+)`", cells[1]))
    return rows


def _contract_promises() -> dict[str, str]:
    """Class name -> the builtin docs/contract.md says it is."""
    text = (DOCS / "contract.md").read_text(encoding="utf-8").split("\n## Errors\n", 1)[1]
    clauses = " ".join(text.split()).split("would catch:", 1)[1].rstrip(".").split(", ")
    promises = {}
    for clause in clauses:
        names = re.findall(r"`(\w+)`", clause)
        assert names, clause
        builtin = names[-1].removesuffix("s")
        targets = names[:-1]
        if clause.startswith("the state errors"):
            targets = [n for n, c in CLASSES.items() if issubclass(c, errors.EngineStateError)]
        assert targets, f"docs/contract.md: cannot tell which errors {clause!r} is about"
        for name in targets:
            promises[name] = builtin
    return promises


def _direct_bases(cls: type) -> set[str]:
    bases = {b.__name__ for b in cls.__bases__} - {"GenEngineError"}
    return bases or {"GenEngineError"}


def test_every_error_has_the_documented_bases() -> None:
    table = _troubleshooting_table()
    assert set(table) == set(CLASSES) - {"GenEngineError"}, "troubleshooting.md and genengine.errors differ"
    for name, cls in CLASSES.items():
        assert issubclass(cls, errors.GenEngineError), name
        if name != "GenEngineError":
            assert _direct_bases(cls) == table[name], f"{name}: code {_direct_bases(cls)}, docs {table[name]}"

    promises = _contract_promises()
    assert {"InvalidArgumentError", "EngineStateError", "BackendNotFoundError", "BackendImportError"} <= set(promises)
    for name, builtin in promises.items():
        assert name in CLASSES, f"docs/contract.md names {name}, which genengine.errors does not define"
        base = getattr(builtins, builtin)
        assert isinstance(base, type) and issubclass(base, BaseException), builtin
        assert issubclass(CLASSES[name], base), f"docs/contract.md says {name} is a {builtin}; it is not"
