"""SGLang 0.5.17 on one GPU: the conformance suite's adapter tests (``AdapterTests``) on an engine started with
LoRA enabled (``enable_lora``, ``max_lora_rank``, ``lora_target_modules``: SGLang's own server arguments).

Kept apart from test_sglang_gpu.py's conformance class so that its engine runs as users run it, without LoRA.

Run on the GPU machine:  bash tools/gpu/run_tests.sh sglang tests/gpu/test_sglang_adapters_gpu.py
"""

from __future__ import annotations

import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("sglang")

from genengine import create_engine  # noqa: E402
from genengine.adapters import supports_adapters  # noqa: E402
from genengine.protocol import GenerationEngine  # noqa: E402
from genengine.testing.conformance.adapters import AdapterTests  # noqa: E402

pytestmark = pytest.mark.gpu

for _key, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)

DETERMINISTIC = os.environ.get("GENENGINE_SGLANG_TEST_DETERMINISTIC", "1") == "1"
ALL_TARGETS = (*AdapterTests.adapter_targets, "k_proj")
LORA_OPTIONS: dict[str, Any] = {
    "disable_cuda_graph": os.environ.get("GENENGINE_SGLANG_TEST_CUDA_GRAPH", "0") != "1",
    "enable_deterministic_inference": DETERMINISTIC,
    "log_level": "warning",
    "enable_lora": True,
    "max_lora_rank": AdapterTests.adapter_rank,
    # The suite's targets and k_proj: the sync-mode test's adapter has all of q/k/v (sent with lora_B stacked).
    "lora_target_modules": list(ALL_TARGETS),
}


class TestSGLangAdapters(AdapterTests):
    greedy_matches_hf = False  # bf16 on the GPU vs float32 transformers (with the adapter merged) on the CPU
    logprob_tolerance = 0.01
    compute_dtype = "bfloat16"
    supports_seed = DETERMINISTIC
    seeded_batch_invariant = DETERMINISTIC

    def make_engine(self, model_dir: str, **options: Any) -> GenerationEngine:
        engine: GenerationEngine = create_engine(
            backend="sglang", model=model_dir, mem_util=0.5, **{**LORA_OPTIONS, **options}
        )
        return engine

    def test_the_engine_declares_adapters(self, engine: GenerationEngine) -> None:
        assert supports_adapters(engine) and engine.max_lora_rank == self.adapter_rank  # type: ignore[attr-defined]

    @pytest.mark.parametrize("fast", ["flattened", "cuda_ipc"])
    def test_the_fast_adapter_sync_serves_as_the_first_way(
        self, adapter_engine: Any, original_weights: dict[str, Any], fast: str
    ) -> None:
        """adapter_sync="flattened" (the default) and "cuda_ipc" against "tensors" (the first way): same tokens,
        and SGLang's own copy."""
        self.check_sync_modes_agree(adapter_engine, original_weights, fast=fast, slow="tensors", targets=ALL_TARGETS)
