"""SGLang 0.5.17 on one GPU: the conformance suite, plus what only the real engine shows.

Beyond the suite: logprobs against transformers' forward on the same bf16 weights on the same GPU, over 20
weight syncs from CUDA tensors (mean |Δ| <= 0.01 and not growing: the SGLang drift users report); a
trainer overwriting its tensors right after load_weights changes nothing (the barrier); each weight-sync mode
(handles, flattened, per-parameter) against the fresh engine on the new weights; sleep gives back >= 99% of
the engine's memory and wake takes it back; the reference's face (``lightrft.strategy.sglang_utils``) on the
same engine; ``sgl_model_saver``.

Machine settings (not product defaults) come from the environment: ``$GENENGINE_SGLANG_OPTIONS`` (what
tools/gpu/run_tests.sh sets for the H200 kit: triton attention, pytorch sampling) and the test knobs
``GENENGINE_SGLANG_TEST_CUDA_GRAPH=1`` (default: CUDA graphs off, for a fast start),
``GENENGINE_SGLANG_TEST_DETERMINISTIC=0`` (default on: seeds are honoured only in SGLang's deterministic
mode), ``GENENGINE_SGLANG_TEST_MEM`` (default 0.6, the memory fraction of the engine under test).

Run on the GPU machine:  bash tools/gpu/run_tests.sh sglang tests/gpu/test_sglang_gpu.py
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("sglang")

from support.gpu_checks import (  # noqa: E402
    GIB,
    ParityOverSyncs,
    assert_loads_like_fresh,
    assert_sleep_freed,
    free_gpu_memory,
    prefix_cache_drift,
    sleep_and_wake,
    token_ids,
    weight_sync_mode,
)

from genengine import create_engine  # noqa: E402
from genengine.errors import EngineSleepingError, WeightLoadError, WeightsNotLoadedError  # noqa: E402
from genengine.protocol import GenerationEngine, GenerationResult  # noqa: E402
from genengine.testing.conformance import GREEDY, PROMPTS, EngineConformance  # noqa: E402
from genengine.testing.tiny_model import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.gpu

for _key, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)

MEM_UTIL = float(os.environ.get("GENENGINE_SGLANG_TEST_MEM", "0.6"))
DETERMINISTIC = os.environ.get("GENENGINE_SGLANG_TEST_DETERMINISTIC", "1") == "1"
TEST_OPTIONS: dict[str, Any] = {
    "disable_cuda_graph": os.environ.get("GENENGINE_SGLANG_TEST_CUDA_GRAPH", "0") != "1",
    "enable_deterministic_inference": DETERMINISTIC,
    "log_level": "warning",
}
_MEMORY: dict[str, int] = {}


class TestSGLangConformance(EngineConformance):
    greedy_matches_hf = False  # bf16 on the GPU vs float32 transformers on the CPU
    logprob_tolerance = 0.01  # the goal; bf16 engines get 1.25x transformers' own bf16 gap if larger
    compute_dtype = "bfloat16"
    supports_images = False  # the tiny Qwen2 is text-only
    supports_seed = DETERMINISTIC
    seeded_batch_invariant = DETERMINISTIC

    def make_engine(self, model_dir: str, **options: Any) -> GenerationEngine:
        main = model_dir == str(tiny_model_dir(**self.model_kwargs))
        options = {**TEST_OPTIONS, **options}
        # A trainer's allocator setting that would make the memory saver refuse to start (or free nothing):
        # the engine must keep it out of its processes, and this process's environment must stay as it was.
        saved = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        try:
            before = free_gpu_memory()
            engine = create_engine(backend="sglang", model=model_dir, mem_util=MEM_UTIL if main else 0.3, **options)
            assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        finally:
            if saved is None:
                os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            else:
                os.environ["PYTORCH_CUDA_ALLOC_CONF"] = saved
        if main:
            _MEMORY["before_start"] = before
            _MEMORY["engine"] = before - free_gpu_memory()
        return engine

    # ---- logprobs and weight syncs -------------------------------------------------------------------------
    def test_logprobs_match_transformers_over_20_weight_syncs(
        self, engine: GenerationEngine, original_weights: dict[str, Any], model_dir: str
    ) -> None:
        """A trainer's loop: step the weights, send them (bf16 CUDA tensors), roll out, compare with the
        trainer's own forward on the same bf16 values (computed in float32, so the difference is the
        engine's bf16 arithmetic alone). Mean |Δlogprob| <= 0.01 at every step, and it must not grow."""
        import transformers

        hf: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        hf = hf.to("cuda").eval()
        gen = torch.Generator(device="cuda").manual_seed(0)
        parity = ParityOverSyncs("sglang")
        with self.restoring(engine, original_weights):
            for _ in range(20):
                with torch.no_grad():
                    for p in hf.parameters():
                        if p.dim() == 2:
                            p.add_(torch.randn(p.shape, generator=gen, device="cuda") * 2e-3)
                            p.copy_(p.to(torch.bfloat16).float())  # both sides hold the same bf16 values
                sent = {n: t.detach().to(torch.bfloat16) for n, t in hf.state_dict().items()}
                engine.load_weights(sent.items())
                parity.measure(engine, hf)
        del hf
        parity.check()

    @pytest.mark.parametrize("mode", ["handles", "flattened", "per_param"])
    def test_each_weight_sync_mode_equals_a_fresh_engine(
        self,
        engine: Any,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        other_record: dict[str, Any],
        mode: str,
    ) -> None:
        """From CUDA tensors (the trainer's case) and host tensors, in small buckets: a mode that copies takes
        several calls; ``handles`` reads CUDA tensors in place, so they need one call whatever the bucket."""
        cuda_weights = {n: t.cuda() for n, t in other_weights.items()}
        largest = max(t.numel() * t.element_size() for t in cuda_weights.values())
        # The mode outside ``restoring``: the original weights come back through the mode under test too.
        with weight_sync_mode(engine, mode), self.restoring(engine, original_weights):
            report = assert_loads_like_fresh(engine, cuda_weights, other_record["results"], bucket_bytes=2 * largest)
            assert report.num_buckets == 1 if mode == "handles" else report.num_buckets > 1, (mode, report)
            engine.load_weights(original_weights.items())
            report = assert_loads_like_fresh(engine, other_weights, other_record["results"], bucket_bytes=2 * largest)
            assert report.num_buckets > 1, (mode, "host tensors", report)
        self.assert_baseline(engine, baseline)

    def test_weights_changed_right_after_load_are_not_seen(
        self, engine: GenerationEngine, baseline: list[GenerationResult], original_weights: dict[str, Any]
    ) -> None:
        """load_weights returns only once SGLang has read the tensors: overwriting them then changes nothing."""
        cuda_weights = {n: t.cuda() for n, t in original_weights.items()}
        with self.restoring(engine, original_weights):
            engine.load_weights(cuda_weights.items())
            for t in cuda_weights.values():
                t.fill_(float("nan"))
            torch.cuda.synchronize()
            self.assert_baseline(engine, baseline)

    def test_prefix_cache_hit_keeps_logprobs_in_deterministic_mode(self, engine: GenerationEngine) -> None:
        """The documented setting for equal logprobs on repeated prompts (docs/contract.md): SGLang's deterministic
        inference keeps the radix cache and gives a hit the miss's logprobs bit for bit. Without it a hit moved
        greedy logprobs by up to 0.0026 on this model (docs/benchmarks.md), so the claim is checked only here."""
        drift = prefix_cache_drift(engine, PROMPTS, GREEDY)
        print("SGLANG_CACHE_DRIFT " + drift.describe())
        assert drift.tokens_equal, drift.describe()
        if DETERMINISTIC:
            assert drift.hit == 0.0 and drift.flushed == 0.0, drift.describe()

    # ---- memory --------------------------------------------------------------------------------------------
    @pytest.mark.parametrize("level", [1, 2])
    def test_wake_takes_back_what_sleep_freed(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        level: int,
    ) -> None:
        with self.restoring(engine, original_weights):
            r = sleep_and_wake(engine, level, _MEMORY["before_start"])
            assert r.freed > 0.9 * r.held, r.describe()
            assert abs(r.not_taken_back) <= 0.01 * r.held, r.describe()
        self.assert_baseline(engine, baseline)

    @pytest.mark.xfail(
        strict=True,
        reason="SGLang 0.5.17's scheduler keeps ~0.85 GiB (CUDA context, cuBLAS) plus ~64 B per KV token (eager "
        "input buffers, free lists) outside its memory saver: 6 GiB for this tiny model's 87M-token pool, 93.1% "
        "freed on 2026-11-30; 98.9% at 7B (docs/benchmarks.md)",
    )
    @pytest.mark.parametrize("level", [1, 2])
    def test_sleep_frees_99_percent(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        level: int,
    ) -> None:
        with self.restoring(engine, original_weights):
            r = sleep_and_wake(engine, level, _MEMORY["before_start"])
        self.assert_baseline(engine, baseline)
        assert_sleep_freed(r)

    # ---- the reference's face ------------------------------------------------------------------------------
    def test_reference_face(
        self,
        engine: Any,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        other_record: dict[str, Any],
    ) -> None:
        """LightRFT's calls on the same engine: generate(input_ids=...) → SGLang dicts; sleep(release_weights=
        True) → wake_up → per-parameter update_weights_from_tensor (flushing at the last) → the new model."""
        ids = [r.prompt_token_ids for r in baseline]
        outs = engine.generate(
            sampling_params={"temperature": 0.0, "max_new_tokens": GREEDY.max_new_tokens},
            input_ids=ids,
            return_logprob=True,
        )
        assert [o["output_ids"] for o in outs] == [r.outputs[0].token_ids for r in baseline]
        assert all("output_token_logprobs" in o["meta_info"] for o in outs)
        single = engine.generate(prompt=PROMPTS[0], sampling_params={"temperature": 0.0, "max_new_tokens": 4})
        assert isinstance(single, dict) and single["output_ids"] == baseline[0].outputs[0].token_ids[:4]
        with self.restoring(engine, original_weights):
            engine.sleep(release_weights=True)
            engine.wake_up(release_weights=True)
            with pytest.raises(WeightsNotLoadedError):
                engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2})
            items = list(other_weights.items())
            with pytest.raises(WeightLoadError, match="did you mean"):
                engine.update_weights_from_tensor("model.norm.weigth", items[0][1])
            for i, (name, tensor) in enumerate(items):
                engine.update_weights_from_tensor(name, tensor.cuda(), flush_cache=i == len(items) - 1)
            results = engine.generate(PROMPTS, GREEDY)
            assert token_ids(results) == token_ids(other_record["results"])
        engine.sleep(release_weights=False)
        with pytest.raises(EngineSleepingError):
            engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2})
        engine.wake_up()
        self.assert_baseline(engine, baseline)

    def test_sgl_model_saver(self, engine: Any, baseline: list[GenerationResult]) -> None:
        from genengine_sglang import sgl_model_saver

        sgl_model_saver.release_memory_occupation(engine)
        assert engine.is_sleeping and engine.state.sleep_level == 1
        sgl_model_saver.resume_memory_occupation()  # every live engine of the process
        assert not engine.is_sleeping
        self.assert_baseline(engine, baseline)

    def test_engine_facts(self, engine: Any) -> None:
        """What the run used, printed for the record (and the processes belong to the engine alone)."""
        sgl = engine.sglang_engine
        assert sgl is not None and len(sgl.get_all_child_pids()) >= 2
        facts = {
            "engine_memory_gib": round(_MEMORY["engine"] / GIB, 2),
            "weight_sync_mode": engine.weight_sync_mode,
            "options": {k: v for k, v in engine.settings.server_overrides.items()},
            "deterministic": DETERMINISTIC,
            "uniform_logprob": -math.log(512),
        }
        print("SGLANG_GPU_FACTS " + json.dumps(facts, default=str))


def test_server_args_fallback_equals_the_installed_fields() -> None:
    """Options are checked against the installed ``ServerArgs``, and against a copy of 0.5.17's fields where
    SGLang is not installed: the copy must hold exactly the installed fields (the same names, order aside),
    so a config accepted on a CPU machine is accepted here and the other way round."""
    import dataclasses

    import sglang
    from sglang.srt.server_args import ServerArgs

    from genengine_sglang._server_args import SERVER_ARGS_FIELDS
    from genengine_sglang.settings import OUR_OPTIONS, passthrough_options

    installed = [f.name for f in dataclasses.fields(ServerArgs)]
    missing, extra = sorted(set(installed) - set(SERVER_ARGS_FIELDS)), sorted(set(SERVER_ARGS_FIELDS) - set(installed))
    assert not missing and not extra, f"SGLang {sglang.__version__}: fallback lacks {missing}, has extra {extra}"
    assert len(SERVER_ARGS_FIELDS) == len(installed)
    assert passthrough_options() <= set(installed) and not passthrough_options() & set(OUR_OPTIONS)
