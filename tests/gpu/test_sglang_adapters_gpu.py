"""SGLang 0.5.17 on one GPU: the conformance suite's adapter tests (``AdapterTests``) on an engine started with
LoRA enabled (``enable_lora``, ``max_lora_rank``, ``lora_target_modules``: SGLang's own server arguments).

Kept apart from test_sglang_gpu.py's conformance class so that its engine runs as users run it, without LoRA.

Run on the GPU machine:  bash tools/gpu/run_tests.sh sglang tests/gpu/test_sglang_adapters_gpu.py
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("sglang")

from genengine_sglang.compat import lora_tensors_per_rank  # noqa: E402

if not lora_tensors_per_rank():
    pytest.skip(
        "this SGLang takes LoRA adapters from tensors as one payload for every TP rank (before 0.5.17: "
        "LoadLoRAAdapterFromTensorsReqInput.serialized_tensors); genengine sends one per rank "
        "(serialized_named_tensors) and refuses adapter loads there (compat.BRANCHES)",
        allow_module_level=True,
    )

from genengine import create_engine  # noqa: E402
from genengine.adapters import supports_adapters  # noqa: E402
from genengine.protocol import GenerationEngine  # noqa: E402
from genengine.testing.conformance.adapters import AdapterTests, random_adapter  # noqa: E402
from genengine.testing.conformance.base import GREEDY, PROMPTS, token_ids_of  # noqa: E402

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

    def test_a_recycled_buffer_serves_the_new_adapter(
        self, adapter_engine: Any, original_weights: dict[str, Any]
    ) -> None:
        """adapter_sync="flattened" recycles the shared-memory buffer of an unloaded adapter: the third version of
        a name goes in the first one's buffer (unloaded when the second replaced it) and serves as that adapter
        loaded the first way ("tensors"), not as the first version."""
        engine = adapter_engine
        versions = [
            {
                k: v.to("cuda", torch.bfloat16)
                for k, v in random_adapter(original_weights, self.adapter_targets, r=self.adapter_rank, seed=s).items()
            }
            for s in (11, 12, 13)
        ]
        params = dataclasses.replace(GREEDY, adapter="recycled")
        engine.load_adapter("recycled", versions[0], self._config(), version=1)
        first = token_ids_of(engine.generate(PROMPTS, params))
        engine.load_adapter("recycled", versions[1], self._config(), version=2)
        info = engine.load_adapter("recycled", versions[2], self._config(), version=3)
        assert info.phases.get("flatten_reused") == 1.0, f"no buffer reused: {info.phases}"
        served = token_ids_of(engine.generate(PROMPTS, params))
        default = engine.adapter_sync
        try:
            engine.adapter_sync = "tensors"
            engine.load_adapter("recycled-ref", versions[2], self._config())
        finally:
            engine.adapter_sync = default
        reference = token_ids_of(engine.generate(PROMPTS, dataclasses.replace(GREEDY, adapter="recycled-ref")))
        assert served == reference, "the recycled buffer served other tokens than the adapter loaded per tensor"
        assert served != first, "the third version served as the first"
