"""SGLang 0.5.17 on one GPU: the conformance suite, plus what only the real engine shows.

Beyond the suite: logprobs against transformers' forward on the same bf16 weights on the same GPU, over 20
weight syncs from CUDA tensors (mean |Δ| <= 0.01 and not growing: the SGLang drift users report); a
trainer overwriting its tensors right after load_weights changes nothing (the barrier); each weight-sync mode
(handles, flattened, per-parameter) against the fresh engine on the new weights; sleep gives back >= 99% of
the engine's memory and wake takes it back; the reference's face (``lightrft.strategy.sglang_utils``) on the
same engine; ``sgl_model_saver``. Async beyond the suite's async tests: a sync generate while streams run,
refused during an in-place pause; no prefix computed with the old weights reused after pause(keep) → load →
resume, for both ``clear_cache`` mappings; abort during a clear-cache pause; the stop-id cut under
``ignore_eos`` and seeded ``n > 1`` samples equal to the sync path's; shutdown with streams open.

Machine settings (not product defaults) come from the environment: ``$GENENGINE_SGLANG_OPTIONS`` (what
tools/gpu/run_tests.sh sets for the H200 kit: triton attention, pytorch sampling) and the test knobs
``GENENGINE_SGLANG_TEST_CUDA_GRAPH=1`` (default: CUDA graphs off, for a fast start),
``GENENGINE_SGLANG_TEST_DETERMINISTIC=0`` (default on: seeds are honoured only in SGLang's deterministic
mode), ``GENENGINE_SGLANG_TEST_MEM`` (default 0.6, the memory fraction of the engine under test).

Run on the GPU machine:  bash tools/gpu/run_tests.sh sglang tests/gpu/test_sglang_gpu.py
"""

from __future__ import annotations

import asyncio
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
from genengine.errors import (  # noqa: E402
    EngineClosedError,
    EngineSleepingError,
    EngineStateError,
    WeightLoadError,
    WeightsNotLoadedError,
)
from genengine.models.tiny_model import tiny_model_dir  # noqa: E402
from genengine.protocol import GenerationEngine, GenerationResult, SamplingParams  # noqa: E402
from genengine.testing.conformance import GREEDY, PROMPTS, EngineConformance  # noqa: E402
from genengine_sglang.engine import SGLangEngine  # noqa: E402
from genengine_sglang.lightrft import RLGenerationEngine  # noqa: E402

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
# Long enough that a stream read for a few tokens is still running when the test acts on it.
_LONG = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True, logprobs=True)


# Bounds of the async tests (no pytest-timeout on the GPU machine; faulthandler_timeout only dumps stacks): a
# hang becomes a failure that says what did not answer.
CHUNK_TIMEOUT_S = 30.0
"""A stream gives its next chunk within this (the tiny model makes hundreds of tokens a second)."""
ASYNC_TEST_TIMEOUT_S = 90.0
"""A test's whole coroutine ends within this."""


async def _read(stream: Any, count: int) -> list[int]:
    """Read ``stream`` until it gave ``count`` tokens (or ended); it stays open. Each chunk within
    ``CHUNK_TIMEOUT_S``."""
    tokens: list[int] = []
    while len(tokens) < count:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), CHUNK_TIMEOUT_S)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise AssertionError(
                f"stream {stream.request_id!r} gave no chunk within {CHUNK_TIMEOUT_S:g} s after {len(tokens)} "
                "token(s) (queued behind a pause, or SGLang's loop not running?)"
            ) from None
        tokens.extend(chunk.token_ids)
    return tokens


def _run(engine: Any, coro: Any, timeout_s: float = ASYNC_TEST_TIMEOUT_S) -> Any:
    """``asyncio.run(coro)`` bounded by ``timeout_s``; the failure names the engine's async state. (A coroutine
    blocked in a sync call cannot be interrupted: faulthandler_timeout dumps the stacks then.)"""

    async def bounded() -> Any:
        try:
            return await asyncio.wait_for(coro, timeout_s)
        except TimeoutError:
            raise AssertionError(
                f"the test's coroutine did not end within {timeout_s:g} s: engine paused={engine.paused!r}, "
                f"in_flight={engine.in_flight}"
            ) from None

    return asyncio.run(bounded())


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
            # LightRFT's face on the protocol engine (the registered "sglang" backend is SGLangEngine itself): the
            # suite runs on it and test_reference_face calls its LightRFT methods on the same engine.
            engine = create_engine(
                backend=RLGenerationEngine, model=model_dir, mem_util=MEM_UTIL if main else 0.3, **options
            )
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

    # ---- async: what the conformance suite's async tests do not cover ---------------------------------------
    @pytest.fixture
    def async_ready(self, engine: Any) -> Any:
        """The class engine unpaused with nothing in flight (else a stream would be queued behind a pause an
        earlier test left, and wait forever); left so afterwards."""
        assert engine.paused is None and engine.in_flight == 0, (
            f"an earlier test left the engine paused={engine.paused!r} with {engine.in_flight} request(s) in flight"
        )
        yield engine
        if not engine.state.closed:
            _run(engine, engine.resume_generation(), 30)
            _run(engine, engine.abort(), 30)

    @pytest.mark.usefixtures("async_ready")
    def test_sync_generate_while_async_requests_run(self, engine: Any, baseline: list[GenerationResult]) -> None:
        """Served by the same SGLang engine, batched with the streams (SGLang's loop is on our thread then)."""

        async def main() -> tuple[list[GenerationResult], list[GenerationResult], int]:
            streams = [engine.stream(p, _LONG) for p in PROMPTS[:2]]
            for stream in streams:
                await _read(stream, 2)
            results = engine.generate(PROMPTS, GREEDY)  # blocks this loop; the streams go on in SGLang
            live = engine.in_flight
            await engine.abort()
            return results, [await stream.collect() for stream in streams], live

        results, streamed, live = _run(engine, main())
        assert token_ids(results) == token_ids(baseline) and live == 2
        for result in streamed:
            out = result.outputs[0]
            assert out.finish_reason == "abort" and 2 <= len(out.token_ids) < _LONG.max_new_tokens
        self.assert_baseline(engine, baseline)  # and without async requests (the loop is the callers' again)

    @pytest.mark.usefixtures("async_ready")
    def test_sync_generate_during_an_in_place_pause_is_refused(
        self, engine: Any, baseline: list[GenerationResult]
    ) -> None:
        """SGLang holds every new request during pause(in_place): a sync generate would wait for the resume."""

        async def main() -> None:
            stream = engine.stream(PROMPTS[0], _LONG)
            await _read(stream, 2)
            await engine.pause_generation("keep", clear_cache=False)
            with pytest.raises(EngineStateError, match="resume_generation"):
                engine.generate(PROMPTS, GREEDY)
            with pytest.raises(EngineStateError, match="resume_generation"):
                engine.generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 2})  # the reference's
            await engine.resume_generation()
            assert token_ids(engine.generate(PROMPTS, GREEDY)) == token_ids(baseline)
            await engine.abort()
            assert (await stream.collect()).outputs[0].finish_reason == "abort"

        _run(engine, main())

    @pytest.mark.usefixtures("async_ready")
    @pytest.mark.parametrize("clear_cache", [True, False])
    def test_no_prefix_from_the_old_weights_after_pause_keep(
        self,
        engine: Any,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        other_record: dict[str, Any],
        clear_cache: bool,
    ) -> None:
        """A prompt cached with the old weights must not reuse their KV after the update (the field bug).
        clear_cache=True: the held samples end in SGLang, so it is idle and the load flushes its cache as the
        sync path does; False: they keep their KV in SGLang, which cannot flush, and new requests get a fresh
        radix namespace."""
        engine.generate(PROMPTS, GREEDY)  # the prompts' KV in the radix cache, from the original weights

        async def main() -> tuple[list[GenerationResult], GenerationResult]:
            stream = engine.stream(PROMPTS[1], _LONG)
            await _read(stream, 2)
            await engine.pause_generation("keep", clear_cache=clear_cache)
            engine.load_weights(other_weights.items())
            await engine.resume_generation()
            results = engine.generate(PROMPTS, GREEDY)
            await _read(stream, 2)  # the held sample goes on after the update
            await engine.abort()
            return results, await stream.collect()

        with self.restoring(engine, original_weights):
            results, streamed = _run(engine, main())
        assert token_ids(results) == token_ids(other_record["results"])
        out = streamed.outputs[0]
        assert out.finish_reason == "abort" and len(out.logprobs or []) == len(out.token_ids) >= 4
        self.assert_baseline(engine, baseline)

    @pytest.mark.usefixtures("async_ready")
    def test_abort_during_a_clear_cache_pause_keeps_the_tokens(self, engine: Any) -> None:
        async def main() -> tuple[list[int], list[str], GenerationResult]:
            stream = engine.stream(PROMPTS[2], _LONG, request_id="held")
            head = await _read(stream, 3)
            await engine.pause_generation("keep")
            engine.flush_cache()  # SGLang is idle: the held sample waits here, not in SGLang
            assert engine.in_flight == 1
            aborted = await engine.abort()
            await engine.resume_generation()
            return head, aborted, await stream.collect()

        head, aborted, result = _run(engine, main())
        out = result.outputs[0]
        assert aborted == ["held"] and engine.in_flight == 0
        assert out.finish_reason == "abort" and out.token_ids[: len(head)] == head
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) < _LONG.max_new_tokens

    @pytest.mark.usefixtures("async_ready")
    def test_stop_ids_under_ignore_eos_stream_as_generate_returns(
        self, engine: Any, baseline: list[GenerationResult]
    ) -> None:
        """SGLang's ignore_eos drops stop_token_ids; both paths cut at the first one (mapping.sampling_to_sglang)."""
        tokens = baseline[0].outputs[0].token_ids
        stop = tokens[len(tokens) // 2]
        params = SamplingParams(
            temperature=0.0,
            max_new_tokens=GREEDY.max_new_tokens,
            ignore_eos=True,
            stop_token_ids=(stop,),
            logprobs=True,
        )
        (sync,) = engine.generate(PROMPTS[:1], params)
        streamed = _run(engine, engine.generate_async(PROMPTS[0], params)).outputs[0]
        want = tokens[: tokens.index(stop) + 1]
        assert streamed.token_ids == sync.outputs[0].token_ids == want
        assert (
            (streamed.finish_reason, streamed.stop_reason)
            == ("stop", stop)
            == (
                sync.outputs[0].finish_reason,
                sync.outputs[0].stop_reason,
            )
        )
        assert streamed.text == sync.outputs[0].text and len(streamed.logprobs or []) == len(want)

    @pytest.mark.usefixtures("async_ready")
    @pytest.mark.skipif(not DETERMINISTIC, reason="SGLang honours seeds only in deterministic mode")
    def test_seeded_samples_stream_as_generate_returns(self, engine: Any) -> None:
        params = SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=5, logprobs=True)
        (sync,) = engine.generate(PROMPTS[:1], params)
        streamed = _run(engine, engine.generate_async(PROMPTS[0], params))
        assert [o.token_ids for o in streamed.outputs] == [o.token_ids for o in sync.outputs]
        assert streamed.prompt_token_ids == sync.prompt_token_ids

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


def test_shutdown_with_streams_open_ends_them_with_abort() -> None:
    """Streams end "abort" with every token they were sent (held ones too), queued requests with none;
    shutdown stays idempotent and the engine object refuses everything after it."""
    engine: Any = create_engine(backend="sglang", model=str(tiny_model_dir()), mem_util=0.3, **TEST_OPTIONS)
    assert type(engine) is SGLangEngine  # the registered backend is the protocol class, as vLLM's

    async def main() -> list[tuple[list[int], GenerationResult]]:
        streams = [engine.stream(p, _LONG) for p in PROMPTS[:2]]
        seen = [await _read(stream, 2) for stream in streams]
        await engine.pause_generation("keep", clear_cache=False)  # held in SGLang with their KV
        streams.append(engine.stream(PROMPTS[2], _LONG))  # queued until a resume that never comes
        seen.append([])
        engine.shutdown()
        engine.shutdown()
        for tokens, stream in zip(seen, streams, strict=True):
            tokens.extend(await _read(stream, _LONG.max_new_tokens + 1))  # to its end: shutdown ended it
        with pytest.raises(EngineClosedError):
            engine.stream(PROMPTS[0], GREEDY)
        with pytest.raises(EngineClosedError):
            await engine.abort()
        with pytest.raises(EngineClosedError):
            await engine.resume_generation()
        return [(tokens, stream.result()) for tokens, stream in zip(seen, streams, strict=True)]

    try:
        results = _run(engine, main())
    finally:
        engine.shutdown()
    for tokens, result in results:
        out = result.outputs[0]
        assert out.finish_reason == "abort" and out.token_ids == tokens, (tokens, out)
        assert out.logprobs is not None and len(out.logprobs) == len(tokens)
    assert [len(tokens) >= 2 for tokens, _ in results] == [True, True, False]
    with pytest.raises(EngineClosedError):
        engine.generate(PROMPTS, GREEDY)


def test_server_args_fallback_equals_the_installed_fields() -> None:
    """Options are checked against the installed ``ServerArgs``, and against the recorded fields of the
    installed release (``compat.recorded_server_args()``: ``surfaces/VERSION.json``, read from its wheel by
    AST) where SGLang cannot be imported: they must be exactly the installed fields, in order, so a config
    accepted on a CPU machine is accepted here and the other way round."""
    import dataclasses

    import sglang
    from sglang.srt.server_args import ServerArgs

    from genengine_sglang import compat
    from genengine_sglang.settings import OUR_OPTIONS, passthrough_options

    release = sglang.__version__.split("+")[0]
    assert compat.surface(release) is not None, f"no recorded surface for SGLang {sglang.__version__}"
    recorded = compat.recorded_server_args()
    installed = [f.name for f in dataclasses.fields(ServerArgs)]
    missing, extra = sorted(set(installed) - set(recorded)), sorted(set(recorded) - set(installed))
    assert not missing and not extra, f"SGLang {sglang.__version__}: recorded fields lack {missing}, have extra {extra}"
    assert list(recorded) == installed
    assert passthrough_options() <= set(installed) and not passthrough_options() & set(OUR_OPTIONS)


def test_declared_upstream_uses_exist_in_the_installed_sglang() -> None:
    """Every sglang name, member and keyword the plugin declares (``genengine_sglang.upstream``) exists in the
    installed sglang when imported, as the recorded surface (read from the wheel by AST) says."""
    import importlib.metadata

    from support.upstream_uses import unresolved_uses

    version = importlib.metadata.version("sglang").split("+")[0]
    unresolved = unresolved_uses("genengine_sglang", version)
    assert not unresolved, f"sglang {version}: {unresolved}"
