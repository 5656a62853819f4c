"""vLLM 0.26 on one GPU: the conformance suite's adapter tests (``AdapterTests``) on an engine started with LoRA
enabled (vLLM's own ``enable_lora``, ``max_lora_rank``, ``max_loras``, ``max_cpu_loras``).

Kept apart from test_vllm_gpu.py's conformance class so that its engine runs as users run it, without LoRA.

Run on the GPU machine:  bash tools/gpu/run_tests.sh vllm tests/gpu/test_vllm_adapters_gpu.py
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from genengine import create_engine  # noqa: E402
from genengine.adapters import supports_adapters  # noqa: E402
from genengine.models.tiny_model import tiny_model_dir  # noqa: E402
from genengine.protocol import GenerationEngine  # noqa: E402
from genengine.testing.conformance.adapters import AdapterTests  # noqa: E402

pytestmark = pytest.mark.gpu

if importlib.util.find_spec("flashinfer") is None:  # the GPU kit does not carry flashinfer
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

LORA_OPTIONS: dict[str, Any] = {
    "disable_cuda_graph": True,
    "max_model_len": 1024,
    "enable_lora": True,
    "max_lora_rank": AdapterTests.adapter_rank,
    "max_loras": 2,  # a replacement beside the adapter a request in flight still uses
    "max_cpu_loras": 4,
}


class TestVLLMAdapters(AdapterTests):
    greedy_matches_hf = False  # bf16 on the GPU vs float32 transformers (with the adapter merged) on the CPU
    logprob_tolerance = 0.01
    compute_dtype = "bfloat16"

    def make_engine(self, model_dir: str, **options: Any) -> GenerationEngine:
        if model_dir != str(tiny_model_dir(**self.model_kwargs)):
            options.setdefault("enable_sleep", False)  # the fresh reference engine: sleep mode is one per process
        engine: GenerationEngine = create_engine(
            backend="vllm", model=model_dir, mem_util=0.3, **{**LORA_OPTIONS, **options}
        )
        return engine

    def test_the_engine_declares_adapters(self, engine: GenerationEngine) -> None:
        assert supports_adapters(engine) and engine.max_lora_rank == self.adapter_rank  # type: ignore[attr-defined]

    def test_the_fast_adapter_sync_serves_as_the_first_way(
        self, adapter_engine: Any, original_weights: dict[str, Any]
    ) -> None:
        """adapter_sync='memory' (the default) against 'folder' (the first way): same tokens, and its own copy."""
        targets = (*self.adapter_targets, "k_proj")  # all of q/k/v: vLLM packs them
        self.check_sync_modes_agree(adapter_engine, original_weights, fast="memory", slow="folder", targets=targets)
