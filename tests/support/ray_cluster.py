"""A real local Ray cluster for the Ray tests: 2 CPUs, no dashboard, and workers that import this checkout."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def local_cluster(num_cpus: int = 2, *, faults_dir: str | None = None) -> Iterator[Any]:
    """``ray.init`` on this machine; the workers get this checkout (and tests/) first on ``sys.path``, since
    the venv's editable install points at another checkout. With ``faults_dir``, every worker has the fault
    switch of :mod:`support.ray_faults` on that folder."""
    import ray

    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    runtime_env: dict[str, Any] = {"env_vars": env}
    if faults_dir is not None:
        env["GENENGINE_TEST_FAULTS_DIR"] = faults_dir
        runtime_env["worker_process_setup_hook"] = "support.ray_faults.install"
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=runtime_env,
        configure_logging=False,
        # No workers started ahead for the driver: every process here is an actor's (Ray gives each actor a new
        # worker of its own), so the two that Ray starts at init sat idle until shutdown, a second of CPU each.
        _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False},
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def pool_actors(ray: Any) -> list[str]:
    """Names of the live actors any EnginePool made."""
    return sorted(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("genengine-pool-")
    )


def pool_placement_groups(ray: Any) -> list[str]:
    """Names of the placement groups any EnginePool made that are not removed."""
    table = ray.util.placement_group_table()
    return sorted(
        pg["name"] for pg in table.values() if pg["name"].startswith("genengine-pool-") and pg["state"] != "REMOVED"
    )


def pool_leftovers(ray: Any, timeout_s: float = 60.0) -> tuple[list[str], list[str]]:
    """``pool_actors`` and ``pool_placement_groups`` once both are empty, or what is left after ``timeout_s``:
    ``ray.kill`` returns before the cluster lists the actor as dead."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        left = (pool_actors(ray), pool_placement_groups(ray))
        if left == ([], []) or time.monotonic() > deadline:
            return left
        time.sleep(0.1)
