"""Shared test setup: offline, quiet, and the tiny model built once per session."""

from __future__ import annotations

import os

import pytest

for _key, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)

# The files that take a minute or more, longest first. Under pytest-xdist (`make test` runs two workers, one file per
# worker at a time) they are handed out first, so that no worker is left running one of them alone at the end.
_LONG_FILES = (  # measured in a clean-clone run (2026-12-02): about 310, 150, 95, 80, 70, 55, 50, 40, 33 s
    "test_ray_pool.py",
    "test_conformance_transformers.py",
    "test_soak.py",
    "test_fuzz.py",  # about 65 s since CI runs half the written example counts
    "test_template_plugin.py",  # about 55 s since torch is linked into the fresh venv, not unpacked by pip
    "test_demo.py",
    "test_bench.py",
    "test_cleanup.py",
    "test_distributed.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(_LONG_FILES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: same order on every worker
