"""The contract as a pytest suite: every backend subclasses ``EngineConformance`` and must pass it.

Usage, in a test module::

    class TestMyEngine(EngineConformance):
        greedy_matches_hf = False            # flags: what the engine can promise
        logprob_tolerance = 0.1

        def make_engine(self, model_dir, **options):
            return create_engine(backend="mine", model=model_dir, **options)

One engine serves a whole class (class-scoped fixtures); every test leaves it awake with the original
weights. Besides it, one fresh engine is built on a second model (other random weights, same tokenizer)
and shut down *before* the class engine starts, so at most one engine is alive at a time; its outputs are
the reference for ``load_weights`` and its shutdown is what the shutdown tests check. The reference for
logprobs and greedy decoding is transformers itself, run on the CPU in float32 from the model directory.

Importable without a GPU; imports torch and transformers only inside fixtures and tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest

from genengine.base import EngineBase
from genengine.errors import (
    EngineClosedError,
    EngineSleepingError,
    InvalidArgumentError,
    WeightLoadError,
    WeightsNotLoadedError,
)
from genengine.protocol import (
    TAG_KV_CACHE,
    TAG_WEIGHTS,
    GenerationEngine,
    GenerationResult,
    SamplingParams,
)
from genengine.testing.parity import parity_bound
from genengine.testing.tiny_model import tiny_model_dir

__all__ = ["GREEDY", "PROMPTS", "EngineConformance", "load_checkpoint", "reference_logprobs"]

PROMPTS = ["The quick brown fox", "Once upon a time", "In a distant galaxy far away", "Hello"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, logprobs=True)
_EXTRA_PROMPTS = [
    "the answer is",
    "write a story about",
    "one two three",
    "where did the old man go",
    "people say that",
    "my name is",
    "a little water",
    "every day we",
]


# ---- helpers (public: plugin suites use them for their own extra tests) ------------------------------------
def load_checkpoint(model_dir: str | Path) -> dict[str, Any]:
    """Every tensor of an HF checkpoint directory, by HF name (what a trainer's state_dict holds)."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def reference_logprobs(
    hf_model: Any, prompt_ids: list[int], token_ids: list[int], params: SamplingParams
) -> list[float]:
    """Processed logprobs of ``token_ids`` after ``prompt_ids`` by transformers' own warpers (teacher forcing).

    Temperature, then top-k, then top-p, as ``generate`` applies them; temperature 0 is the unscaled
    distribution. A token the processing removed gets ``-inf``.
    """
    import torch
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    if not token_ids:
        return []
    with torch.no_grad():
        x = torch.tensor([list(prompt_ids) + list(token_ids)])
        scores = hf_model(x).logits[0, len(prompt_ids) - 1 : -1].float()
    if not params.greedy:
        dummy = torch.zeros((scores.shape[0], 1), dtype=torch.long)
        scores = TemperatureLogitsWarper(params.temperature)(dummy, scores)
        if params.top_k_or_none is not None:
            scores = TopKLogitsWarper(params.top_k_or_none)(dummy, scores)
        if params.top_p < 1:
            scores = TopPLogitsWarper(params.top_p)(dummy, scores)
    logp = torch.log_softmax(scores, dim=-1)
    return [float(v) for v in logp.gather(1, torch.tensor(token_ids)[:, None])[:, 0]]


def _tokens(results: list[GenerationResult]) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in results]


def _prefix_cache_hits(engine: GenerationEngine) -> int | None:
    """The engine's optional ``prefix_cache_hits`` (grows whenever a generate reuses a cached prefix), or None.

    An engine that offers it promises a prefix cache that repeated prompts hit: the flush tests count on it.
    """
    hits = getattr(engine, "prefix_cache_hits", None)
    return hits if isinstance(hits, int) else None


def _expect_raises(exc_type: type[BaseException], call: Callable[[], Any]) -> BaseException:
    with pytest.raises(exc_type) as info:
        call()
    return info.value


def _smallest_bucket(weights: dict[str, Any]) -> int:
    """A bucket size that puts every tensor in a bucket of its own, so a stream is written in many steps."""
    return min(t.numel() * t.element_size() for t in weights.values())


def _breaking_stream(items: list[tuple[str, Any]], count: int, error: BaseException) -> Iterator[tuple[str, Any]]:
    """The first ``count`` pairs, then ``error``: a trainer whose weight stream dies part-way."""
    yield from items[:count]
    raise error


# ---- trainer tensors (issues 15 and 20): helpers of the section "trainer tensors" in EngineConformance -------
_UNREADABLE: Any = None


def _unreadable_like(tensor: Any) -> Any:
    """A tensor with ``tensor``'s metadata whose data cannot be read: every operation but ``detach`` raises.

    It stands for a trainer tensor that passes every check (a kind with data, floating, the right shape) and
    fails only when the engine copies it, inside ``_apply_weights``: a lazily loaded tensor whose file went
    away, or a FakeTensor that escaped its FakeTensorMode (copying one raises). Any read fails, so it fails on
    every backend: ``copy_`` into a parameter, ``.to(device)``, pickling for another process.
    """
    import torch

    global _UNREADABLE
    if _UNREADABLE is None:

        class Unreadable(torch.Tensor):
            __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

            @staticmethod
            def __new__(cls, like: Any) -> Any:
                return torch.Tensor._make_wrapper_subclass(
                    cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device
                )

            @classmethod
            def __torch_dispatch__(  # type: ignore[override]
                cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                if func is torch.ops.aten.detach.default:
                    return cls(args[0])
                raise OSError(f"reading the weight's data failed ({func})")

            def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
                return f"Unreadable(shape={tuple(self.shape)}, dtype={self.dtype})"

        _UNREADABLE = Unreadable
    return _UNREADABLE(tensor)


def _bucket_count(sizes: list[int], limit: int) -> int:
    """Buckets of at most ``limit`` bytes over tensors of ``sizes``, in order (a larger tensor alone): fewest."""
    buckets = size = 0
    for n in sizes:
        if buckets and size + n <= limit:
            size += n
        else:
            buckets, size = buckets + 1, n
    return buckets


# Bad generate() input: (id, args, kwargs). Each must raise InvalidArgumentError and change nothing.
_BAD_GENERATE: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("empty-prompt-list", ([],), {}),
    ("empty-prompt", ([""],), {}),
    ("empty-token-ids", (), {"prompt_token_ids": [[]]}),
    ("empty-token-id-list", (), {"prompt_token_ids": []}),
    ("flat-token-ids", (), {"prompt_token_ids": [1, 2, 3]}),
    ("negative-token-id", (), {"prompt_token_ids": [[1, -1]]}),
    ("token-id-outside-vocab", (), {"prompt_token_ids": [[1, 10**9]]}),
    ("text-and-ids", (["hi"],), {"prompt_token_ids": [[1, 2]]}),
    ("no-prompt", (), {}),
    ("prompt-not-a-string", ([5],), {}),
    ("prompts-not-a-list", (5,), {}),
    ("max-new-tokens-0", (["hi"], {"max_new_tokens": 0}), {}),
    ("max-new-tokens-negative", (["hi"], {"max_new_tokens": -3}), {}),
    ("max-new-tokens-float", (["hi"], {"max_new_tokens": 2.5}), {}),
    ("temperature-negative", (["hi"], {"temperature": -0.1}), {}),
    ("temperature-nan", (["hi"], {"temperature": math.nan}), {}),
    ("temperature-inf", (["hi"], {"temperature": math.inf}), {}),
    ("top-p-0", (["hi"], {"top_p": 0.0}), {}),
    ("top-p-above-1", (["hi"], {"top_p": 1.5}), {}),
    ("top-p-nan", (["hi"], {"top_p": math.nan}), {}),
    ("top-p-inf", (["hi"], {"top_p": math.inf}), {}),
    ("top-k-0", (["hi"], {"top_k": 0}), {}),
    ("top-k-minus-2", (["hi"], {"top_k": -2}), {}),
    ("top-k-float", (["hi"], {"top_k": 2.5}), {}),
    ("n-0", (["hi"], {"n": 0}), {}),
    ("stop-int", (["hi"], {"stop": 123}), {}),
    ("stop-list-of-ints", (["hi"], {"stop": [1, 2]}), {}),
    ("stop-empty-string", (["hi"], {"stop": [""]}), {}),
    ("stop-token-ids-string", (["hi"], {"stop_token_ids": "abc"}), {}),
    ("stop-token-ids-negative", (["hi"], {"stop_token_ids": [-1]}), {}),
    ("seed-string", (["hi"], {"seed": "x"}), {}),
    ("unknown-sampling-key", (["hi"], {"temprature": 0.5}), {}),
    ("params-list-wrong-length", (["hi", "ho"], [{"max_new_tokens": 2}] * 3), {}),
    ("params-wrong-type", (["hi"], 42), {}),
]


class EngineConformance:
    """The conformance suite. Subclass it, override ``make_engine`` and the capability flags."""

    supports_sleep_level_2: ClassVar[bool] = True
    supports_seed: ClassVar[bool] = True
    """Seeded sampling is reproducible across calls."""
    seeded_batch_invariant: ClassVar[bool] = True
    """A seeded request's samples do not depend on the other requests in its batch (needs ``supports_seed``)."""
    supports_images: ClassVar[bool] = False
    logprob_tolerance: ClassVar[float] = 1e-4
    """Mean absolute difference allowed between the engine's logprobs and transformers' on the same tokens."""
    greedy_matches_hf: ClassVar[bool] = True
    """Greedy output equals transformers ``generate`` token for token (fp32 CPU yes, bf16 GPU no)."""
    compute_dtype: ClassVar[str] = "float32"
    """What the engine computes in. For ``"bfloat16"`` the logprob bound is at least 1.25x transformers' own
    bf16-vs-float32 gap on the same tokens: no bf16 engine can beat that floor (``genengine.testing.parity``)."""
    model_kwargs: ClassVar[dict[str, Any]] = {}
    """Arguments for ``build_tiny_model``."""
    prefix_cache_survives_sleep: ClassVar[bool] = False
    """The engine keeps its prefix cache over a level-1 sleep (as SGLang) and offers ``prefix_cache_hits``, an
    int that grows whenever a ``generate`` reuses a cached prefix (read by ``_prefix_cache_hits``). Then the
    flush a load owes while the KV cache sleeps is seen to happen at wake, by counting hits."""

    def make_engine(self, model_dir: str, **options: Any) -> GenerationEngine:
        raise NotImplementedError("subclasses return an engine serving model_dir")

    # ---- fixtures --------------------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls) -> str:
        return str(tiny_model_dir(**cls.model_kwargs))

    @pytest.fixture(scope="class")
    @classmethod
    def other_model_dir(cls) -> str:
        """Same shapes and tokenizer, other random weights."""
        kwargs = dict(cls.model_kwargs)
        kwargs["seed"] = int(kwargs.get("seed", 0)) + 1
        return str(tiny_model_dir(**kwargs))

    @pytest.fixture(scope="class")
    @classmethod
    def original_weights(cls, model_dir: str) -> dict[str, Any]:
        return load_checkpoint(model_dir)

    @pytest.fixture(scope="class")
    @classmethod
    def other_weights(cls, other_model_dir: str) -> dict[str, Any]:
        return load_checkpoint(other_model_dir)

    @pytest.fixture(scope="class")
    @classmethod
    def hf_model(cls, model_dir: str) -> Any:
        import torch
        import transformers

        transformers.utils.logging.disable_progress_bar()
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return model.eval()

    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls, model_dir: str) -> Any:
        import transformers

        return transformers.AutoTokenizer.from_pretrained(model_dir)

    @pytest.fixture(scope="class")
    @classmethod
    def other_record(cls, other_model_dir: str) -> dict[str, Any]:
        """A fresh engine on the other weights, used in a ``with`` block: its outputs and its shutdown.

        Runs before the class engine exists, so backends that allow one engine per process (or per GPU)
        need not hold two at once.
        """
        record: dict[str, Any] = {}
        engine = cls().make_engine(other_model_dir)
        with engine as entered:
            record["enter_returns_self"] = entered is engine
            record["results"] = engine.generate(PROMPTS, GREEDY)
        record["closed"] = engine.state.closed
        calls: dict[str, Callable[[], Any]] = {
            "generate": lambda: engine.generate(PROMPTS[:1], GREEDY),
            "sleep": lambda: engine.sleep(1),
            "wake": lambda: engine.wake(),
            "load_weights": lambda: engine.load_weights([]),
            "flush_cache": lambda: engine.flush_cache(),
        }
        errors: dict[str, BaseException | None] = {}
        for name, call in calls.items():
            try:
                call()
                errors[name] = None
            except Exception as exc:
                errors[name] = exc
        record["errors_after_shutdown"] = errors
        try:
            engine.shutdown()
            record["second_shutdown"] = None
        except Exception as exc:
            record["second_shutdown"] = exc
        return record

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, model_dir: str, other_record: dict[str, Any]) -> Iterator[GenerationEngine]:
        engine = cls().make_engine(model_dir)
        try:
            yield engine
        finally:
            engine.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def baseline(cls, engine: GenerationEngine) -> list[GenerationResult]:
        """Greedy outputs of the class engine on ``PROMPTS`` with its original weights."""
        return engine.generate(PROMPTS, GREEDY)

    @pytest.fixture(autouse=True)
    def _leave_engine_awake(self, engine: GenerationEngine) -> Iterator[None]:
        yield
        if not engine.state.closed and engine.is_sleeping:
            engine.wake()

    @contextmanager
    def restoring(self, engine: GenerationEngine, weights: dict[str, Any]) -> Iterator[None]:
        """Run a block that changes the engine's weights or sleeps it; afterwards it is awake with ``weights``."""
        try:
            yield
        finally:
            if engine.is_sleeping:
                engine.wake()
            engine.load_weights(weights.items())

    def assert_baseline(self, engine: GenerationEngine, baseline: list[GenerationResult]) -> None:
        assert _tokens(engine.generate(PROMPTS, GREEDY)) == _tokens(baseline)

    # ---- the protocol object ---------------------------------------------------------------------------
    def test_is_a_generation_engine(self, engine: GenerationEngine) -> None:
        assert isinstance(engine, GenerationEngine)
        tags = tuple(engine.supported_tags)
        assert TAG_WEIGHTS in tags and TAG_KV_CACHE in tags
        assert tags.index(TAG_WEIGHTS) < tags.index(TAG_KV_CACHE), "weights must come back before the KV cache"
        state = engine.state
        assert not state.is_sleeping and state.weights_loaded and not state.closed and state.sleep_level is None

    # ---- generate --------------------------------------------------------------------------------------
    def test_results_come_back_in_prompt_order(self, engine: GenerationEngine, tokenizer: Any) -> None:
        # Distinct lengths identify each prompt's result whatever the engine's numerics.
        params = [{"temperature": 0.0, "max_new_tokens": 3 + i, "ignore_eos": True} for i in range(len(PROMPTS))]
        for order in (list(range(len(PROMPTS))), list(reversed(range(len(PROMPTS))))):
            results = engine.generate([PROMPTS[i] for i in order], [params[i] for i in order])
            assert len(results) == len(order)
            for i, result in zip(order, results, strict=True):
                assert result.prompt_token_ids == tokenizer.encode(PROMPTS[i])
                assert len(result.outputs) == 1
                assert len(result.outputs[0].token_ids) == 3 + i
                assert result.outputs[0].finish_reason == "length"

    def test_token_id_prompts_equal_text_prompts(
        self, engine: GenerationEngine, tokenizer: Any, baseline: list[GenerationResult]
    ) -> None:
        ids = [tokenizer.encode(p) for p in PROMPTS]
        results = engine.generate(prompt_token_ids=ids, sampling_params=GREEDY)
        assert [r.prompt_token_ids for r in results] == ids
        assert _tokens(results) == _tokens(baseline)

    def test_output_fields(self, engine: GenerationEngine, tokenizer: Any, baseline: list[GenerationResult]) -> None:
        for result in baseline:
            (out,) = result.outputs
            assert 1 <= len(out.token_ids) <= GREEDY.max_new_tokens
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
            assert all(lp <= 1e-6 and math.isfinite(lp) for lp in out.logprobs)
            if out.finish_reason == "length":
                assert len(out.token_ids) == GREEDY.max_new_tokens and out.stop_reason is None
                assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
            else:  # EOS: kept in token_ids, not in the text
                assert out.finish_reason == "stop" and out.stop_reason is None
                assert out.token_ids[-1] == tokenizer.eos_token_id
                assert out.text == tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)
        plain = engine.generate(PROMPTS[:1], {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True})
        (out,) = plain[0].outputs
        assert out.logprobs is None and len(out.token_ids) == 5 and out.finish_reason == "length"

    def test_greedy_matches_hf_generate(self, hf_model: Any, tokenizer: Any, baseline: list[GenerationResult]) -> None:
        if not self.greedy_matches_hf:
            pytest.skip("this engine's numerics differ from float32 transformers (greedy_matches_hf = False)")
        import torch

        for prompt, result in zip(PROMPTS, baseline, strict=True):
            ids = torch.tensor([tokenizer.encode(prompt)])
            with torch.no_grad():
                out = hf_model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=GREEDY.max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                )
            assert result.outputs[0].token_ids == out[0, ids.shape[1] :].tolist(), prompt

    def logprob_bound(self, hf_model: Any, results: list[GenerationResult], params: SamplingParams) -> float:
        """``logprob_tolerance``, or for a bf16 engine 1.25x transformers' bf16 gap on these tokens if larger."""
        return self.logprob_bound_rows(hf_model, [(result, params) for result in results])

    def logprob_bound_rows(self, hf_model: Any, rows: list[tuple[GenerationResult, SamplingParams]]) -> float:
        """``logprob_bound`` over results sampled with different parameters: one bound for their mean gap (a
        single row's mean over a few tokens is noisier than the bf16 floor it is held to)."""
        if self.compute_dtype == "float32":
            return self.logprob_tolerance
        import copy

        import torch

        low = copy.deepcopy(hf_model).to(getattr(torch, self.compute_dtype))
        gaps = []
        for result, params in rows:
            for out in result.outputs:
                ref = reference_logprobs(hf_model, result.prompt_token_ids, out.token_ids, params)
                got = reference_logprobs(low, result.prompt_token_ids, out.token_ids, params)
                gaps += [abs(a - b) for a, b in zip(got, ref, strict=True) if math.isfinite(a) and math.isfinite(b)]
        return parity_bound(sum(gaps) / len(gaps), floor_goal=self.logprob_tolerance)

    def assert_same_outputs(self, results: list[GenerationResult], reference: list[GenerationResult]) -> None:
        """Greedy outputs of this engine equal ``reference`` (a fresh engine's): same tokens, logprobs within
        ``logprob_tolerance`` on average. A weight load must be as good as a restart on those weights."""
        assert _tokens(results) == _tokens(reference)
        diffs = [
            abs(a - b)
            for got, want in zip(results, reference, strict=True)
            for a, b in zip(got.outputs[0].logprobs or [], want.outputs[0].logprobs or [], strict=True)
        ]
        assert sum(diffs) / len(diffs) <= self.logprob_tolerance, f"mean |Δlogprob| {sum(diffs) / len(diffs):.2e}"

    def test_greedy_logprobs_match_hf_forward(self, hf_model: Any, baseline: list[GenerationResult]) -> None:
        diffs = []
        for result in baseline:
            out = result.outputs[0]
            ref = reference_logprobs(hf_model, result.prompt_token_ids, out.token_ids, GREEDY)
            assert out.logprobs is not None
            diffs += [abs(a - b) for a, b in zip(out.logprobs, ref, strict=True)]
        mean = sum(diffs) / len(diffs)
        bound = self.logprob_bound(hf_model, baseline, GREEDY)
        assert mean <= bound, f"mean |Δlogprob| {mean:.2e} > {bound:.2e} (max {max(diffs):.2e})"

    def test_sampled_logprobs_are_processed(self, engine: GenerationEngine, hf_model: Any) -> None:
        """After temperature, top-k and top-p, as the trainer needs them; not the raw distribution."""
        cases = [
            SamplingParams(temperature=0.7, max_new_tokens=10, logprobs=True, seed=11, n=2),
            SamplingParams(temperature=1.0, top_k=8, max_new_tokens=10, logprobs=True, seed=12, n=2),
            SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=10, logprobs=True, seed=13, n=2),
            SamplingParams(temperature=1.3, top_k=20, top_p=0.9, max_new_tokens=10, logprobs=True, seed=14, n=2),
        ]
        results = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(cases))], cases)
        raw_params = SamplingParams(temperature=0.0)
        for params, result in zip(cases, results, strict=True):
            assert len(result.outputs) == params.n
            diffs, raw_diffs, removed = [], [], 0
            for out in result.outputs:
                assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
                ref = reference_logprobs(hf_model, result.prompt_token_ids, out.token_ids, params)
                raw = reference_logprobs(hf_model, result.prompt_token_ids, out.token_ids, raw_params)
                for got, want, unprocessed in zip(out.logprobs, ref, raw, strict=True):
                    if math.isinf(want):
                        removed += 1  # sampled a token the reference filtered out
                        continue
                    diffs.append(abs(got - want))
                    raw_diffs.append(abs(got - unprocessed))
            total = removed + len(diffs)
            allowed = 0 if self.greedy_matches_hf else max(1, total // 20)
            assert removed <= allowed, f"{params}: {removed} of {total} sampled tokens are outside top-k/top-p"
            mean = sum(diffs) / len(diffs)
            bound = self.logprob_bound(hf_model, [result], params)
            assert mean <= bound, f"{params}: mean |Δlogprob| {mean:.2e} > {bound:.2e}"
            raw_mean = sum(raw_diffs) / len(raw_diffs)
            assert raw_mean > max(2 * mean, 1e-3), f"{params}: the logprobs look unprocessed (raw)"

    def test_mixed_greedy_and_sampled_batch_keeps_each_rows_logprobs(
        self, engine: GenerationEngine, hf_model: Any
    ) -> None:
        """Greedy and sampled requests in one batch: each row's logprobs are its own processed ones.

        Held to the request run alone and to transformers' processed logprobs on the same tokens: a sampled
        row that kept the greedy (unprocessed) logprob, or got another row's, fails here. A greedy and a
        sampled row share a prompt, so that taking the neighbour's value cannot pass by chance. The cache is
        flushed before each call, so that every run takes the same (uncached) path.
        """
        common: dict[str, Any] = {"max_new_tokens": 10, "logprobs": True, "ignore_eos": True}
        cases = [
            SamplingParams(temperature=0.0, **common),
            SamplingParams(temperature=0.7, seed=31, **common),
            SamplingParams(temperature=1.0, top_p=0.8, seed=32, **common),
            SamplingParams(temperature=0.0, **common),
            SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=33, **common),
        ]
        prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]]
        alone = []
        for prompt, params in zip(prompts, cases, strict=True):
            engine.flush_cache()
            alone.append(engine.generate([prompt], [params])[0].outputs[0])
        engine.flush_cache()
        mixed = engine.generate(prompts, cases)
        raw_params = SamplingParams(temperature=0.0)
        # bf16: batch shapes change the last bits, so gaps are held to one bound over all rows together.
        bound = self.logprob_bound_rows(hf_model, list(zip(mixed, cases, strict=True)))
        alone_gaps: list[float] = []
        ref_gaps: list[float] = []
        for i, (params, own, result) in enumerate(zip(cases, alone, mixed, strict=True)):
            (out,) = result.outputs
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids), i
            if self.greedy_matches_hf if params.greedy else self.seeded_batch_invariant:
                assert out.token_ids == own.token_ids, f"row {i} ({params}): other tokens than alone"
                alone_gaps += [abs(a - b) for a, b in zip(out.logprobs, own.logprobs or [], strict=True)]
            ref = reference_logprobs(hf_model, result.prompt_token_ids, out.token_ids, params)
            kept = [(got, want) for got, want in zip(out.logprobs, ref, strict=True) if math.isfinite(want)]
            allowed = 0 if self.greedy_matches_hf else max(1, len(ref) // 20)
            assert len(ref) - len(kept) <= allowed, f"row {i} ({params}): tokens outside top-k/top-p were sampled"
            gaps = [abs(got - want) for got, want in kept]
            ref_gaps += gaps
            mean = sum(gaps) / len(gaps)
            if not params.greedy:
                # Per row: the processed logprobs must be much nearer than the unprocessed ones.
                raw = reference_logprobs(hf_model, result.prompt_token_ids, out.token_ids, raw_params)
                raw_mean = sum(abs(a - b) for a, b in zip(out.logprobs, raw, strict=True)) / len(raw)
                assert raw_mean > max(2 * mean, 1e-3), f"row {i} ({params}): the logprobs look unprocessed"
        if alone_gaps:
            mean_alone = sum(alone_gaps) / len(alone_gaps)
            assert mean_alone <= bound, f"logprobs in the batch differ from alone: mean {mean_alone:.2e} > {bound:.2e}"
        mean_ref = sum(ref_gaps) / len(ref_gaps)
        assert mean_ref <= bound, f"mean |Δlogprob| {mean_ref:.2e} vs processed > {bound:.2e} over all rows"

    def test_top_k_1_and_tiny_top_p_sample_greedily(
        self, engine: GenerationEngine, baseline: list[GenerationResult]
    ) -> None:
        for extra in ({"top_k": 1}, {"top_p": 1e-6}):
            params = {"temperature": 1.0, "max_new_tokens": GREEDY.max_new_tokens, "logprobs": True, "seed": 5, **extra}
            results = engine.generate(PROMPTS, params)
            assert _tokens(results) == _tokens(baseline), extra
            for result in results:
                logprobs = result.outputs[0].logprobs
                assert logprobs is not None
                assert all(abs(lp) <= max(self.logprob_tolerance, 1e-5) for lp in logprobs), (extra, logprobs)

    def test_n_samples(self, engine: GenerationEngine) -> None:
        params = {"temperature": 1.0, "max_new_tokens": 8, "n": 4, "seed": 0, "logprobs": True}
        results = engine.generate(PROMPTS[:2], params)
        assert len(results) == 2
        for result in results:
            assert len(result.outputs) == 4
            samples = {tuple(o.token_ids) for o in result.outputs}
            assert len(samples) > 1, "n samples of a temperature-1 request are all identical"
            for out in result.outputs:
                assert 1 <= len(out.token_ids) <= 8
                assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)

    def test_seeded_sampling_is_reproducible(self, engine: GenerationEngine) -> None:
        if not self.supports_seed:
            pytest.skip("the engine does not promise reproducible seeded sampling (supports_seed = False)")
        params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10, seed=1234, n=2)
        first = _tokens(engine.generate(PROMPTS[1:2], params))
        assert _tokens(engine.generate(PROMPTS[1:2], params)) == first
        other = SamplingParams(temperature=1.0, max_new_tokens=10, seed=99)
        different = _tokens(engine.generate(PROMPTS[1:2], SamplingParams(**{**_fields(params), "seed": 4321})))
        assert different != first, "two seeds gave the same samples"
        if self.seeded_batch_invariant:
            batch = engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [other, params, GREEDY])
            assert _tokens(batch)[1] == first[0], "a seeded request's samples changed with its batch"

    def test_max_new_tokens_and_ignore_eos(self, engine: GenerationEngine) -> None:
        params = [
            {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True},
            {"temperature": 1.0, "max_new_tokens": 7, "ignore_eos": True, "seed": 3},
        ]
        results = engine.generate(PROMPTS[:2], params)
        for want, result in zip((1, 7), results, strict=True):
            (out,) = result.outputs
            assert len(out.token_ids) == want
            assert out.finish_reason == "length" and out.stop_reason is None

    def test_stop_token_ids(self, engine: GenerationEngine, tokenizer: Any) -> None:
        """The stop token is kept in ``token_ids`` with its logprob: the one it has in the run without the stop."""
        greedy = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True, "logprobs": True}
        engine.flush_cache()  # both runs uncached: a cache hit may take another kernel (other last bits)
        (whole,) = engine.generate(PROMPTS[0], greedy)[0].outputs
        tokens = whole.token_ids
        stop = next((t for t in tokens[3:] if t != tokenizer.eos_token_id), None)
        assert stop is not None and whole.logprobs is not None
        k = tokens.index(stop)
        engine.flush_cache()
        (out,) = engine.generate(PROMPTS[0], {**greedy, "stop_token_ids": [stop]})[0].outputs
        assert out.token_ids == tokens[: k + 1], "the stop token is kept in token_ids"
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == tokenizer.decode(tokens[:k], skip_special_tokens=True), "the stop token is not in the text"
        assert out.logprobs is not None and len(out.logprobs) == k + 1, "every kept token, the stop token too, has one"
        gaps = [abs(a - b) for a, b in zip(out.logprobs, whole.logprobs[: k + 1], strict=True)]
        assert gaps[-1] <= max(self.logprob_tolerance, 1e-6), (
            f"the stop token's logprob {out.logprobs[-1]} vs {whole.logprobs[k]} in the run without the stop"
        )
        assert sum(gaps) / len(gaps) <= self.logprob_tolerance, gaps

    def test_stop_strings(self, engine: GenerationEngine, tokenizer: Any) -> None:
        prompts = PROMPTS + _EXTRA_PROMPTS
        full = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True})
        found = None
        for prompt, result in zip(prompts, full, strict=True):
            tokens = result.outputs[0].token_ids
            for k in range(1, len(tokens)):
                before = tokenizer.decode(tokens[:k], skip_special_tokens=True)
                upto = tokenizer.decode(tokens[: k + 1], skip_special_tokens=True)
                stop = upto[-2:]
                if "\ufffd" in upto or len(stop) < 2 or not stop.strip() or stop in before:
                    continue
                found = (prompt, tokens, k, stop, upto)
                break
            if found:
                break
        if found is None:
            pytest.fail("no clean two-character stop string in the greedy outputs; change the prompts")
        prompt, tokens, k, stop, upto = found
        params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True, "stop": ["\x00never\x00", stop]}
        (out,) = engine.generate(prompt, params)[0].outputs
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.token_ids == tokens[: k + 1], "the token that completed the stop string stays in token_ids"
        assert out.text == upto[: upto.index(stop)], "the text is cut before the stop string"

    def test_eos_ends_generation_unless_ignored(
        self, engine: GenerationEngine, tokenizer: Any, original_weights: dict[str, Any]
    ) -> None:
        """With the final norm zeroed every logit is 0, so greedy picks token 0: our tiny models' EOS."""
        import torch

        eos = tokenizer.eos_token_id
        if eos != 0 or "model.norm.weight" not in original_weights:
            pytest.skip("needs a model whose EOS id is 0 and whose final norm is model.norm.weight")
        zeros = torch.zeros_like(original_weights["model.norm.weight"])
        with self.restoring(engine, original_weights):
            engine.load_weights([("model.norm.weight", zeros)])
            (out,) = engine.generate(PROMPTS[0], {"temperature": 0.0, "max_new_tokens": 6, "logprobs": True})[0].outputs
            assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None
            assert out.text == ""
            assert out.logprobs is not None
            uniform = -math.log(_vocab_size(original_weights))
            assert abs(out.logprobs[0] - uniform) <= max(self.logprob_tolerance, 1e-3)
            params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
            (out,) = engine.generate(PROMPTS[0], params)[0].outputs
            assert out.token_ids == [eos] * 6 and out.finish_reason == "length" and out.text == ""
            (out,) = engine.generate(PROMPTS[0], {**params, "stop_token_ids": [eos]})[0].outputs
            assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason == eos

    # ---- bad input -------------------------------------------------------------------------------------
    @pytest.mark.parametrize(("case", "args", "kwargs"), _BAD_GENERATE, ids=[c[0] for c in _BAD_GENERATE])
    def test_bad_generate_input_is_rejected(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        case: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        _expect_raises(InvalidArgumentError, lambda: engine.generate(*args, **kwargs))
        assert not engine.is_sleeping and engine.state.weights_loaded
        out = engine.generate(PROMPTS[:1], {"temperature": 0.0, "max_new_tokens": 2})
        assert out[0].outputs[0].token_ids == baseline[0].outputs[0].token_ids[:2]

    def test_images_rejected_when_unsupported(self, engine: GenerationEngine) -> None:
        if self.supports_images:
            pytest.skip("the engine takes images")
        _expect_raises(InvalidArgumentError, lambda: engine.generate(["hi"], image_data=[b"not an image"]))

    # ---- sleep / wake ----------------------------------------------------------------------------------
    def test_wake_while_awake_is_a_no_op(self, engine: GenerationEngine, baseline: list[GenerationResult]) -> None:
        engine.wake()
        engine.wake(["kv_cache"])
        engine.wake([])
        assert not engine.is_sleeping
        self.assert_baseline(engine, baseline)

    def test_sleep_level_1_cycle(
        self, engine: GenerationEngine, baseline: list[GenerationResult], original_weights: dict[str, Any]
    ) -> None:
        engine.sleep(1)
        state = engine.state
        assert engine.is_sleeping and state.sleep_level == 1
        assert state.released_tags == frozenset(engine.supported_tags)
        _expect_raises(EngineSleepingError, lambda: engine.generate(PROMPTS, GREEDY))
        _expect_raises(EngineSleepingError, lambda: engine.generate(prompt_token_ids=[[1, 2]]))
        _expect_raises(EngineSleepingError, lambda: engine.load_weights(original_weights.items()))
        engine.sleep(1)  # double sleep: no-op
        engine.sleep(2)  # any sleep while asleep: no-op, the level stays
        assert engine.state.sleep_level == 1
        engine.flush_cache()  # nothing cached while asleep: allowed, a no-op
        engine.wake()
        assert not engine.is_sleeping and engine.state.sleep_level is None
        engine.wake()
        self.assert_baseline(engine, baseline)  # level 1 keeps the weights

    def test_staged_wake_after_level_1(self, engine: GenerationEngine, baseline: list[GenerationResult]) -> None:
        engine.sleep(1)
        engine.wake([TAG_WEIGHTS])
        assert engine.is_sleeping and engine.state.released_tags == frozenset({TAG_KV_CACHE})
        _expect_raises(EngineSleepingError, lambda: engine.generate(PROMPTS, GREEDY))
        engine.wake([TAG_KV_CACHE])
        assert not engine.is_sleeping
        self.assert_baseline(engine, baseline)

    def test_bad_sleep_and_wake_arguments(self, engine: GenerationEngine, baseline: list[GenerationResult]) -> None:
        for level in (0, 3, -1, True, "1", None, 1.0, 2.5):
            with pytest.raises(InvalidArgumentError):
                engine.sleep(level)  # type: ignore[arg-type]
        for tags in (["bogus"], ["weights", "nope"]):
            with pytest.raises(InvalidArgumentError):
                engine.wake(tags)
        assert not engine.is_sleeping
        self.assert_baseline(engine, baseline)

    def test_level_2_needs_weights_before_generate(
        self, engine: GenerationEngine, baseline: list[GenerationResult], original_weights: dict[str, Any]
    ) -> None:
        if not self.supports_sleep_level_2:
            pytest.skip("no level-2 sleep")
        with self.restoring(engine, original_weights):
            engine.sleep(2)
            assert engine.state.sleep_level == 2 and not engine.state.weights_loaded
            engine.wake()
            assert not engine.is_sleeping and not engine.state.weights_loaded
            _expect_raises(WeightsNotLoadedError, lambda: engine.generate(PROMPTS, GREEDY))
            first = next(iter(original_weights))
            engine.load_weights([(first, original_weights[first])])  # one tensor is not all of them
            _expect_raises(WeightsNotLoadedError, lambda: engine.generate(PROMPTS, GREEDY))
            engine.load_weights(original_weights.items())
            assert engine.state.weights_loaded
            self.assert_baseline(engine, baseline)

    def test_staged_wake_after_level_2(
        self, engine: GenerationEngine, baseline: list[GenerationResult], original_weights: dict[str, Any]
    ) -> None:
        if not self.supports_sleep_level_2:
            pytest.skip("no level-2 sleep")
        with self.restoring(engine, original_weights):
            engine.sleep(2)
            engine.wake([TAG_WEIGHTS])
            engine.load_weights(original_weights.items())
            assert engine.state.released_tags == frozenset({TAG_KV_CACHE})
            _expect_raises(EngineSleepingError, lambda: engine.generate(PROMPTS, GREEDY))
            engine.wake([TAG_KV_CACHE])
            assert not engine.is_sleeping and engine.state.weights_loaded
            self.assert_baseline(engine, baseline)

    def test_wake_takes_the_weights_back_before_the_kv_cache(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """One ``wake`` naming the KV cache first still takes the weights back first (no OOM from the KV pool).

        Seen on the real engine: its ``_resume`` is wrapped to record what it receives, and then runs as always.
        """
        if not isinstance(engine, EngineBase):
            pytest.skip("not an EngineBase: its resume step cannot be observed")
        received: list[tuple[str, ...]] = []
        resume = engine._resume

        def recording(tags: tuple[str, ...]) -> None:
            received.append(tuple(tags))
            resume(tags)

        monkeypatch.setattr(engine, "_resume", recording)
        for level in (1, 2) if self.supports_sleep_level_2 else (1,):
            with self.restoring(engine, original_weights):
                received.clear()
                engine.sleep(level)
                engine.wake([TAG_KV_CACHE, TAG_WEIGHTS])
                # An engine may wake a tag of its own with the KV cache (SGLang's "cuda_graph"): what it
                # resumes is in supported_tags order, in one call, weights first.
                assert len(received) == 1, f"level {level}: _resume received {received}"
                (tags,) = received
                assert tags[:1] == (TAG_WEIGHTS,) and TAG_KV_CACHE in tags, f"level {level}: _resume received {tags}"
                assert list(tags) == [t for t in engine.supported_tags if t in tags], f"level {level}: {tags}"
                assert not {TAG_WEIGHTS, TAG_KV_CACHE} & engine.state.released_tags
        self.assert_baseline(engine, baseline)

    # ---- load_weights ----------------------------------------------------------------------------------
    def test_load_weights_equals_a_fresh_engine(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        other_record: dict[str, Any],
    ) -> None:
        """Also the stale-cache check: the same prompts just ran, so a cache that survived would show."""
        reference = other_record["results"]
        assert _tokens(reference) != _tokens(baseline), "the two random models should not agree"
        with self.restoring(engine, original_weights):
            self.assert_baseline(engine, baseline)
            report = engine.load_weights(other_weights.items())
            assert report.num_tensors == len(other_weights)
            assert report.num_bytes == sum(t.numel() * t.element_size() for t in other_weights.values())
            assert report.num_buckets >= 1 and report.seconds >= 0
            self.assert_same_outputs(engine.generate(PROMPTS, GREEDY), reference)
        self.assert_baseline(engine, baseline)

    def test_load_weights_in_small_buckets(
        self, engine: GenerationEngine, baseline: list[GenerationResult], original_weights: dict[str, Any]
    ) -> None:
        largest = max(t.numel() * t.element_size() for t in original_weights.values())
        with self.restoring(engine, original_weights):
            report = engine.load_weights(original_weights.items(), bucket_bytes=largest)
            assert report.num_buckets > 1 and report.num_tensors == len(original_weights)
            self.assert_baseline(engine, baseline)

    @pytest.mark.parametrize("bad", ["unknown-name", "wrong-shape", "wrong-dtype", "not-a-tensor", "name-twice"])
    def test_failed_load_weights_changes_nothing(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        hf_model: Any,
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        bad: str,
    ) -> None:
        """The good tensors come first (other weights), the bad entry last: nothing may be written."""
        import torch

        name, tensor = next(iter(other_weights.items()))
        entry: tuple[str, Any] = {
            "unknown-name": ("model.layers.99.not_a_weight", tensor),
            "wrong-shape": (name, tensor.flatten()[:-1].clone()),
            "wrong-dtype": (name, torch.zeros(tensor.shape, dtype=torch.int64)),
            "not-a-tensor": (name, tensor.tolist()),
            "name-twice": (name, tensor),
        }[bad]
        stream = [(n, t) for n, t in other_weights.items() if bad == "name-twice" or n != name] + [entry]
        with self.restoring(engine, original_weights):
            error = _expect_raises(WeightLoadError, lambda: engine.load_weights(stream))
            assert entry[0] in str(error), f"the error should name {entry[0]!r}: {error}"
            assert engine.state.weights_loaded and not engine.is_sleeping
            results = engine.generate(PROMPTS, GREEDY)
            assert _tokens(results) == _tokens(baseline)
            # The weights serving these outputs are the original checkpoint's, by transformers' own forward
            # (held to the same bound as the baseline's parity test: bf16 engines have bf16's floor).
            diffs = []
            for result in results:
                out = result.outputs[0]
                ref = reference_logprobs(hf_model, result.prompt_token_ids, out.token_ids, GREEDY)
                diffs += [abs(a - b) for a, b in zip(out.logprobs or [], ref, strict=True)]
            mean, bound = sum(diffs) / len(diffs), self.logprob_bound(hf_model, results, GREEDY)
            assert mean <= bound, f"{bad}: mean |Δlogprob| {mean:.4f} vs the checkpoint > {bound:.4f}"

    def test_load_weights_bad_arguments(self, engine: GenerationEngine, baseline: list[GenerationResult]) -> None:
        bad_streams: list[Any] = [5, "model.norm.weight", None, [("x", 1, 2)], [object()]]
        for value in bad_streams:
            with pytest.raises(InvalidArgumentError):
                engine.load_weights(value)
        for bucket in (0, -1, 1.5, True):
            with pytest.raises(InvalidArgumentError):
                engine.load_weights([], bucket_bytes=bucket)  # type: ignore[arg-type]
        self.assert_baseline(engine, baseline)

    def test_stream_failing_midway_never_serves_mixed_weights(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
    ) -> None:
        items = list(other_weights.items())
        stream = _breaking_stream(items, len(items) // 2, RuntimeError("trainer died half-way through the weights"))
        with self.restoring(engine, original_weights):
            _expect_raises(
                RuntimeError, lambda: engine.load_weights(stream, bucket_bytes=_smallest_bucket(other_weights))
            )
            self.assert_old_weights_or_refused(engine, baseline)
        self.assert_baseline(engine, baseline)

    # ---- load_weights that fails half-way (docs/failure-modes.md) ------------------------------------------
    def assert_old_weights_or_refused(self, engine: GenerationEngine, baseline: list[GenerationResult]) -> None:
        """After a failed load: the old weights serve unchanged, or every generate is refused. Never a mix."""
        if engine.state.weights_loaded:  # all-or-nothing engines: nothing was written
            self.assert_baseline(engine, baseline)
            return
        for call in (
            lambda: engine.generate(PROMPTS, GREEDY),
            lambda: engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 1}),
        ):
            error = _expect_raises(WeightsNotLoadedError, call)
            assert "incomplete weights" in str(error) and "failed" in str(error), error
        engine.sleep(1)  # a sleep/wake cycle does not make half-written weights servable
        engine.wake()
        _expect_raises(WeightsNotLoadedError, lambda: engine.generate(PROMPTS, GREEDY))

    def _streams_buckets(self, engine: GenerationEngine) -> bool:
        """True for engines that write each bucket as it comes (so a late failure leaves some written)."""
        return isinstance(engine, EngineBase) and not engine.validate_all_weights_first

    @pytest.mark.parametrize("bad", ["unknown-name", "wrong-shape", "not-a-tensor", "not-a-pair"])
    def test_bad_entry_after_buckets_were_written_never_serves_mixed_weights(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        bad: str,
    ) -> None:
        """Small buckets, the bad entry two thirds in: a streaming engine has written buckets when it sees it."""
        items = list(other_weights.items())
        cut = max(2, 2 * len(items) // 3)
        name, tensor = items[cut]
        entry: Any = {
            "unknown-name": ("model.layers.0.mlp.not_a_weight", tensor),
            "wrong-shape": (name, tensor.flatten()[:-1].clone()),
            "not-a-tensor": (name, "not a tensor"),
            "not-a-pair": (name,),
        }[bad]
        smallest = _smallest_bucket(other_weights)
        pulled: list[str] = []

        def stream() -> Iterator[Any]:
            for item in [*items[:cut], entry, *items[cut + 1 :]]:
                pulled.append(str(item[0]))
                yield item

        with self.restoring(engine, original_weights):
            error = _expect_raises(WeightLoadError, lambda: engine.load_weights(stream(), bucket_bytes=smallest))
            assert (entry[0] if bad != "not-a-pair" else f"entry {cut}") in str(error), error
            assert len(pulled) > cut, "the stream was not read up to the bad entry"
            if self._streams_buckets(engine):
                assert not engine.state.weights_loaded, "buckets before the bad entry should have been written"
            self.assert_old_weights_or_refused(engine, baseline)
        self.assert_baseline(engine, baseline)

    def test_failed_load_during_staged_wake_never_serves_mixed_weights(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
    ) -> None:
        """The RL step's order: sleep, wake weights, load (fails half-way), wake KV cache, generate."""
        items = list(other_weights.items())
        stream = _breaking_stream(items, 3 * len(items) // 4, ConnectionError("the trainer's weight stream broke"))
        with self.restoring(engine, original_weights):
            engine.sleep(1)
            engine.wake([TAG_WEIGHTS])
            _expect_raises(
                ConnectionError, lambda: engine.load_weights(stream, bucket_bytes=_smallest_bucket(other_weights))
            )
            engine.wake([TAG_KV_CACHE])
            assert not engine.is_sleeping
            if self._streams_buckets(engine):
                assert not engine.state.weights_loaded
            self.assert_old_weights_or_refused(engine, baseline)
        self.assert_baseline(engine, baseline)

    def test_full_load_after_a_failed_one_equals_a_fresh_engine(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        other_record: dict[str, Any],
    ) -> None:
        """Recovery: once a load covers every weight again, outputs are exactly the new weights' own."""
        items = list(other_weights.items())
        half = len(items) // 2
        failing = _breaking_stream(items, half, RuntimeError("trainer died half-way through the weights"))
        smallest = _smallest_bucket(other_weights)
        reference = other_record["results"]
        with self.restoring(engine, original_weights):
            _expect_raises(RuntimeError, lambda: engine.load_weights(failing, bucket_bytes=smallest))
            if not engine.state.weights_loaded:
                # The weights the failed call had written do not count: a load of the rest is not enough.
                engine.load_weights(items[half:], bucket_bytes=smallest)
                _expect_raises(WeightsNotLoadedError, lambda: engine.generate(PROMPTS, GREEDY))
            report = engine.load_weights(iter(items), bucket_bytes=smallest)
            assert report.num_tensors == len(items) and report.num_buckets > 1
            assert engine.state.weights_loaded
            self.assert_same_outputs(engine.generate(PROMPTS, GREEDY), reference)
        self.assert_baseline(engine, baseline)

    def test_flush_cache(self, engine: GenerationEngine, baseline: list[GenerationResult]) -> None:
        """Outputs unchanged by flushes; where the engine counts cache hits, a flushed cache is really empty."""
        engine.flush_cache()
        self.assert_baseline(engine, baseline)
        hits = _prefix_cache_hits(engine)
        if hits is not None:
            self.assert_baseline(engine, baseline)
            assert (_prefix_cache_hits(engine) or 0) > hits, "the repeated prompts should hit the prefix cache"
            engine.flush_cache()
            hits = _prefix_cache_hits(engine)
            self.assert_baseline(engine, baseline)
            assert _prefix_cache_hits(engine) == hits, "a prefix cached before flush_cache was reused"
        engine.flush_cache()
        engine.flush_cache()
        self.assert_baseline(engine, baseline)

    def test_load_while_the_kv_cache_sleeps_flushes_the_cache_at_wake(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        other_record: dict[str, Any],
    ) -> None:
        """The RL step after a generate filled the cache: the flush the load owes is done at wake(kv_cache).

        With ``prefix_cache_survives_sleep`` the same steps without a load are seen to hit the cache, so a
        missing flush would show as a hit (and as the old weights' outputs).
        """
        counted = self.prefix_cache_survives_sleep
        if counted:
            assert _prefix_cache_hits(engine) is not None, "prefix_cache_survives_sleep needs prefix_cache_hits"
            engine.generate(PROMPTS, GREEDY)
            engine.sleep(1)
            engine.wake([TAG_WEIGHTS])
            engine.wake([TAG_KV_CACHE])
            before = _prefix_cache_hits(engine) or 0
            self.assert_baseline(engine, baseline)
            assert (_prefix_cache_hits(engine) or 0) > before, "without a load the kept cache should be hit"
        with self.restoring(engine, original_weights):
            engine.generate(PROMPTS, GREEDY)  # the cache now holds the original weights' prefixes
            engine.sleep(1)
            engine.wake([TAG_WEIGHTS])
            engine.load_weights(other_weights.items())
            engine.wake([TAG_KV_CACHE])
            hits = _prefix_cache_hits(engine)
            results = engine.generate(PROMPTS, GREEDY)
            if counted:
                assert _prefix_cache_hits(engine) == hits, "the cache of the old weights was reused after the load"
            self.assert_same_outputs(results, other_record["results"])
        self.assert_baseline(engine, baseline)

    # ---- trainer tensors: kinds, values, buckets, failures inside a bucket (issues 15 and 20) ---------------
    def _record_applied(self, engine: GenerationEngine, monkeypatch: pytest.MonkeyPatch) -> list[list[Any]] | None:
        """Wrap the real engine's ``_apply_weights`` to note each bucket it receives (then it writes as always):
        per tensor its name, bytes, whether it is a plain ``torch.Tensor`` and contiguous. None if not EngineBase."""
        if not isinstance(engine, EngineBase):
            return None
        import torch

        received: list[list[Any]] = []
        apply = engine._apply_weights

        def recording(bucket: list[tuple[str, Any]]) -> None:
            received.append(
                [(n, t.numel() * t.element_size(), type(t) is torch.Tensor, t.is_contiguous()) for n, t in bucket]
            )
            apply(bucket)

        monkeypatch.setattr(engine, "_apply_weights", recording)
        return received

    @pytest.mark.parametrize("where", ["first", "middle", "last"])
    def test_failure_inside_a_bucket_refuses_until_a_full_load(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        where: str,
    ) -> None:
        """One bucket holds the whole call, and one of its tensors fails while the engine copies it.

        The tensor passes every check and fails on read (``_unreadable_like``), so the error comes from inside
        the write of the first bucket, with the tensors before it (none when first) already written: the engine
        must refuse, whatever part of the bucket landed, and a full load must bring the old model back exactly.
        """
        items = list(other_weights.items())
        at = {"first": 0, "middle": len(items) // 2, "last": len(items) - 1}[where]
        name, tensor = items[at]
        items[at] = (name, _unreadable_like(tensor))
        whole = sum(t.numel() * t.element_size() for t in other_weights.values())
        with self.restoring(engine, original_weights):
            _expect_raises(Exception, lambda: engine.load_weights(items, bucket_bytes=whole))
            assert not engine.state.weights_loaded, "a bucket was being written: its old weights are not whole"
            error = _expect_raises(WeightsNotLoadedError, lambda: engine.generate(PROMPTS, GREEDY))
            assert "incomplete weights" in str(error) and "failed" in str(error), error
            engine.sleep(1)  # a sleep/wake cycle does not make the half-written bucket servable
            engine.wake()
            _expect_raises(WeightsNotLoadedError, lambda: engine.generate(PROMPTS, GREEDY))
            report = engine.load_weights(original_weights.items())
            assert report.num_tensors == len(original_weights) and engine.state.weights_loaded
            self.assert_same_outputs(engine.generate(PROMPTS, GREEDY), baseline)

    @pytest.mark.parametrize("kind", ["meta", "sparse", "freed"])
    def test_tensors_without_usable_data_are_rejected_before_any_write(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        kind: str,
    ) -> None:
        """Meta, sparse, and freed (storage resized to 0, as FSDP frees unsharded parameters) tensors, last in a
        list sent in one bucket per tensor: the whole list is checked before the first bucket is written."""
        import torch

        items = list(other_weights.items())
        name, tensor = items[-1]
        if kind == "meta":
            bad = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        elif kind == "sparse":
            bad = tensor.to_sparse()
        else:
            bad = tensor.clone()
            bad.untyped_storage().resize_(0)
        stream = [*items[:-1], (name, bad)]
        with self.restoring(engine, original_weights):
            error = _expect_raises(
                WeightLoadError, lambda: engine.load_weights(stream, bucket_bytes=_smallest_bucket(other_weights))
            )
            assert name in str(error) and "allowed are" in str(error), error
            assert engine.state.weights_loaded, "nothing may have been written"
            self.assert_baseline(engine, baseline)

    @pytest.mark.parametrize("value", [math.nan, math.inf])
    def test_check_finite_refuses_nan_and_inf_before_any_write(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        value: float,
    ) -> None:
        items = list(other_weights.items())
        name, tensor = items[-1]
        bad = tensor.clone()
        bad.view(-1)[bad.numel() // 2] = value
        stream = [*items[:-1], (name, bad)]
        smallest = _smallest_bucket(other_weights)
        with self.restoring(engine, original_weights):
            error = _expect_raises(
                WeightLoadError, lambda: engine.load_weights(stream, bucket_bytes=smallest, check_finite=True)
            )
            assert name in str(error) and "NaN or infinite" in str(error), error
            assert engine.state.weights_loaded, "nothing may have been written"
            self.assert_baseline(engine, baseline)
            assert engine.load_weights(items, check_finite=True).num_tensors == len(items)  # finite ones pass

    def test_buckets_are_at_most_bucket_bytes(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """The fewest buckets of at most ``bucket_bytes`` (the engine's default for None), seen in the report
        and, on an ``EngineBase``, in the buckets ``_apply_weights`` really receives."""
        items = list(original_weights.items())
        sizes = [t.numel() * t.element_size() for _, t in items]
        total, largest, smallest = sum(sizes), max(sizes), min(sizes)
        received = self._record_applied(engine, monkeypatch)
        limits: list[int | None] = [smallest, largest, largest + smallest, total // 3, total // 2, total, None]
        for limit in limits:
            applied = len(received) if received is not None else 0
            report = engine.load_weights(items, bucket_bytes=limit)
            assert report.num_tensors == len(items) and report.num_bytes == total
            if limit is None:
                if not isinstance(engine, EngineBase):
                    continue
                limit = engine.default_bucket_bytes
            want = _bucket_count(sizes, limit)
            assert report.num_buckets == want, f"bucket_bytes={limit}: {report.num_buckets} buckets, want {want}"
            if received is not None:
                buckets = received[applied:]
                assert [n for b in buckets for n, *_ in b] == [n for n, _ in items], "every tensor once, in order"
                for bucket in buckets:
                    size = sum(nbytes for _, nbytes, *_ in bucket)
                    assert size <= limit or len(bucket) == 1, f"a bucket of {size} bytes > bucket_bytes={limit}"
                assert len(buckets) == want
        self.assert_baseline(engine, baseline)

    def test_views_and_bf16_copies_load_like_plain_tensors(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        other_record: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Non-contiguous views (as ``named_parameters`` of a transposed or strided layout give) load as the
        same values, reaching the backend contiguous; a bf16 copy loads as its values in float32 do."""
        import torch

        def strided(t: Any) -> Any:  # the same values, not contiguous
            return t.t().contiguous().t() if t.dim() == 2 else torch.stack([t, t], dim=-1)[..., 0]

        views = [(n, strided(t)) for n, t in other_weights.items()]
        assert not any(v.is_contiguous() for _, v in views if v.numel() > 1)
        received = self._record_applied(engine, monkeypatch)
        with self.restoring(engine, original_weights):
            engine.load_weights(views)
            self.assert_same_outputs(engine.generate(PROMPTS, GREEDY), other_record["results"])
            if received is not None:
                odd = [n for b in received for n, _, plain, contiguous in b if not (plain and contiguous)]
                assert not odd, f"_apply_weights received non-contiguous or non-plain tensors: {odd[:3]}"
            halves = [(n, t.to(torch.bfloat16)) for n, t in other_weights.items()]
            engine.load_weights(halves)
            from_bf16 = engine.generate(PROMPTS, GREEDY)
            engine.load_weights([(n, t.float()) for n, t in halves])  # the same values, in float32
            self.assert_same_outputs(from_bf16, engine.generate(PROMPTS, GREEDY))
        self.assert_baseline(engine, baseline)

    # ---- shutdown --------------------------------------------------------------------------------------
    def test_context_manager_and_shutdown(self, other_record: dict[str, Any]) -> None:
        """Recorded on the fresh engine of ``other_record``: ``with`` returns it and shuts it down."""
        assert other_record["enter_returns_self"]
        assert other_record["closed"]
        assert other_record["second_shutdown"] is None, "shutdown must be idempotent"
        for call, error in other_record["errors_after_shutdown"].items():
            assert isinstance(error, EngineClosedError), f"{call} after shutdown raised {error!r}"


def _fields(params: SamplingParams) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(params)


def _vocab_size(weights: dict[str, Any]) -> int:
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        if name in weights:
            return int(weights[name].shape[0])
    raise KeyError("no lm_head.weight or model.embed_tokens.weight in the checkpoint")
