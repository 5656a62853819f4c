"""The vllm plugin's CPU test files' shared fixtures: the tiny model and a clean sleep-mode slot."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from genengine.models.tiny_model import tiny_model_dir
from genengine_vllm import _process as vprocess


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture
def fresh_slot() -> Iterator[None]:
    """No sleep-mode engine registered before or after the test."""
    vprocess.PROCESS_STATE.sleep_owner = None
    yield
    vprocess.PROCESS_STATE.sleep_owner = None
