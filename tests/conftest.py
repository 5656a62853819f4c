"""Shared test setup: offline, quiet, and the tiny model built once per session."""

from __future__ import annotations

import os
from typing import Any

import pytest

# The Ray pool files' module-scoped fixtures (cluster, model, ...); per-file times with GENENGINE_FILE_TIMES set;
# full garbage collections that skip the imported modules (support/gc_freeze.py).
pytest_plugins = ("support.ray_pool", "support.file_times", "support.gc_freeze")

# OMP_NUM_THREADS=1, before anything imports torch, here and in every process a test starts (trainer children,
# torchrun ranks, the Ray cluster's workers inherit it): the tiny models gain nothing from intra-op threads, and
# on the 2-core CI machine, whose other core runs the other pytest worker, spinning OpenMP threads only burn CPU
# (the transformers conformance file: 91 s of user CPU with torch's default threads, 55 s with one).
_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
for _key, _value in _ENV.items():
    os.environ.setdefault(_key, _value)

# The files that take half a minute or more, the Ray files first, then longest first. Under pytest-xdist (`make test`
# runs two workers, one file per worker at a time) they are handed out first, so that no worker is left running one
# of them alone at the end. The Ray files make two work units (pytest_xdist_make_scheduler below), one per worker at
# the start, each unit's files one after another on its worker, sharing one Ray cluster (support/ray_pool.py). As one
# unit (one cluster for the suite) they held one worker for about half the suite (315 s of 353; 780 s of a run on a
# loaded machine), so any slowdown of the Ray files made the suite's end; a second cluster costs 4-8 s of CPU (seven
# Python and C++ daemons). Times (2026-12-03, two workers, a loaded machine): the Ray files 75, 72, 43 and 89, 22,
# 57 s; the template's fresh venv 45, soak 83, demo 62, bench 112 (before its smaller run), the conformance suite 57,
# cleanup 55, fuzz 39, distributed 40 s.
_RAY_UNITS = (
    ("test_ray_conformance.py", "test_ray_pool_sync.py", "test_ray_colocated.py"),
    # the pool's own tests and TRL async's on its pool; verl's own client on the plugin; tests/cli's bench --sync --pool
    ("test_ray_pool.py", "test_verl.py", "test_ray_bench_sync.py"),
)
_LONG_FILES = (
    *(name for unit in _RAY_UNITS for name in unit),
    "test_template_plugin.py",
    "test_soak.py",
    "test_demo.py",
    "test_bench.py",
    "test_conformance_transformers.py",
    "test_cleanup.py",
    "test_fuzz.py",
    "test_distributed.py",
)
_RAY_UNIT_OF = {name: f"the Ray files ({i + 1})" for i, unit in enumerate(_RAY_UNITS) for name in unit}


def pytest_configure(config: pytest.Config) -> None:
    """Keep the order below under ``--dist loadfile``: pytest-xdist otherwise hands files out by their number of
    tests, most first, which left the fresh-venv file (3 tests, 1.5 min) to start last and run alone."""
    if hasattr(config.option, "loadscopereorder") and "--loadscope-reorder" not in config.invocation_params.args:
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with the Ray files as the two work units of ``_RAY_UNITS`` (a worker runs a unit's
    files in ``_LONG_FILES`` order); every other file is its own unit, as loadfile makes them."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RayFilesInTwo(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return _RAY_UNIT_OF.get(os.path.basename(scope), scope)

    return RayFilesInTwo(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(_LONG_FILES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: same order on every worker
