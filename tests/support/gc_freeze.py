"""Full garbage collections that skip the modules this pytest process imported: ``gc.freeze()`` them.

The embedded engine's ``sleep`` runs ``gc.collect()`` (so that a level-2 sleep shows in RSS), as do the demo's
and the bench's memory readings. A full collection walks every tracked object, and with torch and transformers'
model code imported that is over a million of them: 0.2 s per collection alone, more in a pytest worker that has
run many files (the sync demo test: 37 collections, 8 of its 21 s of CPU). What it walks is almost all module
state that lives until the process ends. So, before the first test, this imports what the fork server of
support/start.py preloads (torch, transformers' Qwen2 code, the embedded engine: what nearly every file of the
suite imports anyway); and before that test and any later one, when the process has imported many modules since
the last freeze, this collects once and moves everything still alive to the permanent generation, which later
collections skip. Garbage made afterwards (engines, tensors, tests' own objects) is collected as before. What
was frozen was alive; the one cost: a module- or session-scoped fixture's objects alive at a freeze, if they
are freed later through reference cycles only, stay in memory until the worker exits (a few a run).
"""

from __future__ import annotations

import gc
import importlib
import sys

import pytest

from support.start import PRELOAD

NEW_MODULES = 200
"""Freeze again once this many modules were imported since the last freeze (a freeze costs one full collection)."""

_frozen_at = [0]  # len(sys.modules) at the last freeze; 0: none yet


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's own fixtures are made (a check of ``len(sys.modules)``: nothing to pay per test)."""
    if not _frozen_at[0]:
        for name in PRELOAD:
            importlib.import_module(name)
    if len(sys.modules) - _frozen_at[0] >= NEW_MODULES:
        gc.collect()
        gc.freeze()
        _frozen_at[0] = len(sys.modules)
