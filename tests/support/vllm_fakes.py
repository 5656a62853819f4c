"""What the vllm plugin's CPU test files (tests/vllm_plugin/) share: whether vLLM is installed, an engine made
from a config, and a completion shaped like vLLM 0.26's ``CompletionOutput``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_no_vllm = pytest.mark.skipif(HAS_VLLM, reason="checks the error raised when vLLM is missing")


def engine_from_config(model_dir: Path, **fields: Any) -> Any:
    from genengine.config import EngineConfig
    from genengine_vllm.engine import VLLMEngine

    return VLLMEngine.from_config(EngineConfig(backend="vllm", model=str(model_dir), mem_util=0.3, **fields))


def completion(index: int, ids: list[int], text: str, reason: str, stop: Any = None, lps: Any = None) -> Any:
    return SimpleNamespace(index=index, token_ids=ids, text=text, finish_reason=reason, stop_reason=stop, logprobs=lps)
