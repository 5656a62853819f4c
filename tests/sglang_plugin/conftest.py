"""The sglang plugin's CPU test files' shared fixtures: the tiny model, no options from the environment, and the
caller's loop kinds for the loop driver's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.sglang_loop import new_loop

from genengine.models.tiny_model import tiny_model_dir
from genengine_sglang.settings import OPTIONS_ENV


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture(autouse=True)
def _no_env_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OPTIONS_ENV, raising=False)


@pytest.fixture(params=["asyncio", "uvloop"])
def sgl_loop(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    loop = new_loop(request.param)
    yield request.param, loop
    loop.close()
