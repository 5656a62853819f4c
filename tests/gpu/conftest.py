"""GPU tests (marker ``gpu``) are skipped cleanly where there is no CUDA device.

Shared by the engines' GPU modules; each module also skips itself when its engine is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def _no_cuda_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "needs torch with CUDA"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") and _HERE in Path(item.path).parents]
    if not gpu_items:
        return
    reason = _no_cuda_reason()
    if reason is not None:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_unconfigure(config: pytest.Config) -> None:
    """A GPU run's process must exit soon after its summary (an engine left running, a non-daemon thread or an
    atexit join has held it for minutes before). Past ``$GENENGINE_EXIT_DUMP_S`` seconds (default 30; 0: off)
    every thread's stack is printed and the process ends, so the run's log says what held it. Only where CUDA is:
    a CPU run (CI) is never cut short."""
    import faulthandler
    import os
    import sys

    delay = float(os.environ.get("GENENGINE_EXIT_DUMP_S", "30"))
    if delay > 0 and _no_cuda_reason() is None:
        import time

        print(f"\nGENENGINE_EXIT_WATCH at {time.time():.3f}: exiting (stacks dumped after {delay:g} s)", flush=True)
        faulthandler.dump_traceback_later(delay, exit=True, file=sys.stderr)
