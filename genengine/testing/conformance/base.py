"""What every part of the conformance suite stands on: prompts, reference helpers, flags and fixtures.

``ConformanceBase`` holds the capability flags, ``make_engine`` and the class-scoped fixtures (one
engine per class, a fresh one on other weights for the references); the test mixins subclass it.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest

from genengine.models.tiny_model import tiny_model_dir
from genengine.protocol import GenerationEngine, GenerationResult, SamplingParams
from genengine.testing.parity import parity_bound

__all__ = [
    "GREEDY",
    "PROMPTS",
    "ConformanceBase",
    "ConformanceWarning",
    "EngineSlot",
    "load_checkpoint",
    "reference_logprobs",
]

PROMPTS = ["The quick brown fox", "Once upon a time", "In a distant galaxy far away", "Hello"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, logprobs=True)


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


def token_ids_of(results: list[GenerationResult]) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in results]


def engine_prefix_hits(engine: GenerationEngine) -> int | None:
    """The engine's optional ``prefix_cache_hits`` (grows whenever a generate reuses a cached prefix), or None.

    An engine that offers it promises a prefix cache that repeated prompts hit: the flush tests count on it.
    """
    hits = getattr(engine, "prefix_cache_hits", None)
    return hits if isinstance(hits, int) else None


def expect_raises(exc_type: type[BaseException], call: Callable[[], Any]) -> BaseException:
    with pytest.raises(exc_type) as info:
        call()
    return info.value


def smallest_bucket(weights: dict[str, Any]) -> int:
    """A bucket size that puts every tensor in a bucket of its own, so a stream is written in many steps."""
    return min(t.numel() * t.element_size() for t in weights.values())


def breaking_stream(items: list[tuple[str, Any]], count: int, error: BaseException) -> Iterator[tuple[str, Any]]:
    """The first ``count`` pairs, then ``error``: a trainer whose weight stream dies part-way."""
    yield from items[:count]
    raise error


class ConformanceWarning(UserWarning):
    """What the suite did about a failed test's engine (replaced it, or skips the rest of the class)."""


class EngineSlot:
    """The engine a conformance class shares; ``broken`` (a reason) once none could be made usable again."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine
        self.broken: str | None = None


def _restore(engine: GenerationEngine, weights: dict[str, Any] | None, baseline: list[GenerationResult]) -> str | None:
    """Bring an engine a failed test left behind back to the suite's starting state (loading ``weights``, the
    original ones, unless None: a fresh engine serves its checkpoint); None once it serves the baseline
    again, else what is wrong."""
    import asyncio

    from genengine.protocol import is_async_engine

    if engine.state.closed:
        return "it was shut down"
    step = "aborting an open load session"
    try:
        session = getattr(engine, "_EngineBase__session", None)
        if session is not None:
            session.abort()
        if is_async_engine(engine):
            step = "aborting its requests"
            asyncio.run(asyncio.wait_for(engine.abort(), 60))
        step = "waking it"
        if engine.is_sleeping:
            engine.wake()
        if weights is not None:
            step = "loading the original weights"
            engine.load_weights(weights.items())
        if is_async_engine(engine) and engine.paused is not None:
            step = "resuming generation"
            asyncio.run(asyncio.wait_for(engine.resume_generation(), 60))
        step = "generating the baseline"
        got = token_ids_of(engine.generate(PROMPTS, GREEDY))
    except Exception as exc:
        return f"{step} raised {exc!r}"
    want = token_ids_of(baseline)
    if got != want:
        i = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        return f"its greedy tokens for PROMPTS[{i}] are {got[i]}, the baseline's {want[i]}"
    return None


class ConformanceBase:
    """Flags, ``make_engine``, fixtures and assertions shared by the test mixins of ``EngineConformance``."""

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
    reads_tensors_before_writing: ClassVar[bool] = False
    """The engine reads every tensor of a ``load_weights`` call before it writes any (an ``EnginePool`` puts
    each in Ray's object store first): a tensor that fails on read fails the call with nothing changed."""
    prefix_cache_survives_sleep: ClassVar[bool] = False
    """The engine keeps its prefix cache over a level-1 sleep (as SGLang) and offers ``prefix_cache_hits``, an
    int that grows whenever a ``generate`` reuses a cached prefix (read by ``engine_prefix_hits``). Then the
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
    def engine_slot(cls, model_dir: str, other_record: dict[str, Any]) -> Iterator[EngineSlot]:
        """The class's shared engine (built after ``other_record``'s is shut down), in a slot: a test that fails
        and leaves it broken gets it replaced by a fresh one, so that one bug does not fail every later test."""
        slot = EngineSlot(cls().make_engine(model_dir))
        try:
            yield slot
        finally:
            slot.engine.shutdown()

    @pytest.fixture
    def engine(self, engine_slot: EngineSlot) -> GenerationEngine:
        """The class's shared engine (the same object from test to test unless a failed test broke it)."""
        if engine_slot.broken is not None:
            pytest.skip(engine_slot.broken)
        return engine_slot.engine

    @pytest.fixture(scope="class")
    @classmethod
    def baseline(cls, engine_slot: EngineSlot) -> list[GenerationResult]:
        """Greedy outputs of the class engine on ``PROMPTS`` with its original weights."""
        return engine_slot.engine.generate(PROMPTS, GREEDY)

    @pytest.fixture(autouse=True)
    def _leave_engine_awake(self, request: pytest.FixtureRequest, engine_slot: EngineSlot) -> Iterator[None]:
        """After a test: awake; after a failed one, restored (or replaced) so later tests do not fail with it."""
        failed = request.session.testsfailed
        yield
        if request.session.testsfailed > failed:
            self._recover(request, engine_slot)
            return
        engine = engine_slot.engine
        if not engine.state.closed and engine.is_sleeping:
            engine.wake()

    # ---- after a failed test -----------------------------------------------------------------------------
    def _recover(self, request: pytest.FixtureRequest, slot: EngineSlot) -> None:
        """Put the shared engine back as every test expects it (awake, unpaused, idle, the original weights,
        the baseline's outputs); if it cannot be, shut it down and build a fresh one. Said in a warning."""
        if slot.broken is not None:
            return
        try:
            baseline = request.getfixturevalue("baseline")
            weights = request.getfixturevalue("original_weights")
        except Exception:  # the references themselves failed: each later test reports that on its own
            return
        test = request.node.name
        why = _restore(slot.engine, weights, baseline)
        if why is None:
            return
        message = f"{test} failed and left the shared engine unusable ({why})"
        with contextlib.suppress(Exception):
            slot.engine.shutdown()
        try:
            slot.engine = self.make_engine(request.getfixturevalue("model_dir"))
        except Exception as exc:
            slot.broken = f"{message}; a fresh engine could not be built ({exc!r}): not run"
            warnings.warn(ConformanceWarning(slot.broken), stacklevel=1)
            return
        again = _restore(slot.engine, None, baseline)
        if again is not None:
            slot.broken = f"{message}; a fresh engine is not usable either ({again}): not run"
            warnings.warn(ConformanceWarning(slot.broken), stacklevel=1)
            return
        warnings.warn(ConformanceWarning(f"{message}: later tests run on a fresh engine"), stacklevel=1)

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
        assert token_ids_of(engine.generate(PROMPTS, GREEDY)) == token_ids_of(baseline)

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
        assert token_ids_of(results) == token_ids_of(reference)
        diffs = [
            abs(a - b)
            for got, want in zip(results, reference, strict=True)
            for a, b in zip(got.outputs[0].logprobs or [], want.outputs[0].logprobs or [], strict=True)
        ]
        assert sum(diffs) / len(diffs) <= self.logprob_tolerance, f"mean |Δlogprob| {sum(diffs) / len(diffs):.2e}"
