"""Shared test setup: offline, quiet, and the tiny model built once per session."""

from __future__ import annotations

import os
from typing import Any

import pytest

# The Ray pool files' module-scoped fixtures (cluster, model, ...); per-file times with GENENGINE_FILE_TIMES set.
pytest_plugins = ("support.ray_pool", "support.file_times")

# OMP_NUM_THREADS=1, before anything imports torch, here and in every process a test starts (trainer children,
# torchrun ranks, the Ray cluster's workers inherit it): the tiny models gain nothing from intra-op threads, and
# on the 2-core CI machine, whose other core runs the other pytest worker, spinning OpenMP threads only burn CPU
# (the transformers conformance file: 91 s of user CPU with torch's default threads, 55 s with one).
_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
for _key, _value in _ENV.items():
    os.environ.setdefault(_key, _value)

# The files that take half a minute or more, the Ray files first, then longest first. Under pytest-xdist (`make test`
# runs two workers, one file per worker at a time) they are handed out first, so that no worker is left running one
# of them alone at the end. The Ray files go to one worker as one unit (pytest_xdist_make_scheduler below), one after
# another, so that the suite starts one Ray cluster (support/ray_pool.py), not one per worker: a cluster's start
# costs 7-8 s of CPU (seven Python and C++ daemons), and the suite is CPU-bound on the 2-core machine. Estimates
# (2-core machine, both workers busy, 2026-12-02): the Ray files 80, 70, 55, 50 s; the template's fresh venv 70,
# soak 68, demo 64, bench 56, the conformance suite 52, cleanup 47, fuzz 40, distributed 36 s.
_LONG_FILES = (
    "test_ray_conformance.py",
    "test_ray_pool_sync.py",
    "test_ray_pool.py",
    "test_ray_colocated.py",
    "test_ray_bench_sync.py",  # tests/cli: bench --sync --pool, on the same cluster
    "test_ray_trl_async.py",
    "test_verl.py",  # verl's own client on the plugin: shares the Ray files' cluster
    "test_template_plugin.py",
    "test_soak.py",
    "test_demo.py",
    "test_bench.py",
    "test_conformance_transformers.py",
    "test_cleanup.py",
    "test_fuzz.py",
    "test_distributed.py",
)
_RAY_FILES = frozenset(name for name in _LONG_FILES if name.startswith(("test_ray_", "test_verl.py")))


def pytest_configure(config: pytest.Config) -> None:
    """Keep the order below under ``--dist loadfile``: pytest-xdist otherwise hands files out by their number of
    tests, most first, which left the fresh-venv file (3 tests, 1.5 min) to start last and run alone."""
    if hasattr(config.option, "loadscopereorder") and "--loadscope-reorder" not in config.invocation_params.args:
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with the Ray files as one work unit (one worker runs them all, in ``_LONG_FILES``
    order); every other file is its own unit, as loadfile makes them."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RayFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "the Ray files" if os.path.basename(scope) in _RAY_FILES else scope

    return RayFilesTogether(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(_LONG_FILES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: same order on every worker
