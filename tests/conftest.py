"""Shared test setup: offline, quiet, and the tiny model built once per session."""

from __future__ import annotations

import os

import pytest

pytest_plugins = ("support.ray_pool",)  # the Ray pool files' module-scoped fixtures (cluster, model, ...)

# OMP_NUM_THREADS=1, before anything imports torch, here and in every process a test starts (trainer children,
# torchrun ranks, the Ray cluster's workers inherit it): the tiny models gain nothing from intra-op threads, and
# on the 2-core CI machine, whose other core runs the other pytest worker, spinning OpenMP threads only burn CPU
# (the transformers conformance file: 91 s of user CPU with torch's default threads, 55 s with one).
_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
for _key, _value in _ENV.items():
    os.environ.setdefault(_key, _value)

# The files that take half a minute or more, the Ray files first, then longest first. Under pytest-xdist (`make test`
# runs two workers, one file per worker at a time) they are handed out first, so that no worker is left running one
# of them alone at the end; the Ray files one after another, so that each worker starts its Ray cluster once and
# stops it when they are done (support/ray_pool.py). Estimates (2-core machine, both workers busy, 2026-12-02):
# the Ray files 80, 70, 55, 50 s; the template's fresh venv 70, soak 68, demo 64, bench 56, the conformance suite
# 52, cleanup 47, fuzz 40, distributed 36 s.
_LONG_FILES = (
    "test_ray_conformance.py",
    "test_ray_pool_sync.py",
    "test_ray_pool.py",
    "test_ray_colocated.py",
    "test_template_plugin.py",
    "test_soak.py",
    "test_demo.py",
    "test_bench.py",
    "test_conformance_transformers.py",
    "test_cleanup.py",
    "test_fuzz.py",
    "test_distributed.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """Keep the order below under ``--dist loadfile``: pytest-xdist otherwise hands files out by their number of
    tests, most first, which left the fresh-venv file (3 tests, 1.5 min) to start last and run alone."""
    if hasattr(config.option, "loadscopereorder") and "--loadscope-reorder" not in config.invocation_params.args:
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(_LONG_FILES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: same order on every worker
