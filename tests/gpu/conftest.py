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
