"""Property-based fuzzing of the protocol on the embedded engine: only documented errors, never a crash or a hang,
and no weight changed by a rejected call.

Four properties, one shared engine per module (the session's default tiny model):

* ``generate`` over arbitrary sampling parameters and prompts (empty, unicode, control characters, lone
  surrogates, very long, token ids out of the vocabulary, wrong types): either a well-formed result or an
  ``InvalidArgumentError`` naming the problem (the same one ``normalize_requests`` gives); weights unchanged.
  Most cases are pure validation; those that pass it run for real with one or two new tokens.
* ``load_weights`` over arbitrary (name, tensor) streams (unknown names, wrong shapes and dtypes, non-tensors,
  malformed pairs, duplicates, streams that raise part-way, bad ``bucket_bytes``), on the embedded engine and on
  its streaming variant: a valid stream is applied exactly; a rejected one leaves the old weights serving, or
  (streaming, after buckets were written) makes ``generate`` refuse until a complete load.
* The sleep/wake/load/generate state machine against a model of the contract: every greedy output equals the
  reference of the weight set the model says is loaded, every refusal is the documented one.
* Because the cases above take their expected errors from the validation code itself, an independent oracle:
  a hand-written table of boundary cases (``BOUNDARIES``) and a per-field predicate of the contract
  (``CONTRACT``) that ``SamplingParams`` must agree with.

``GENENGINE_FUZZ_SCALE`` multiplies the example counts written at each property. CI runs them derandomized, so a
failure here reproduces, at a quarter (``CI_SCALE``) or, for the properties whose rarer outcomes need more cases, at
half (``CI_SCALE_OUTCOMES``): 2,100 generated cases and 22 state-machine runs of 25 steps;
benchmarks/fuzz_nightly.py runs every property at a large scale (20: 146,000 cases) with a random seed.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
import numpy as np  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test  # noqa: E402

from genengine.backends.transformers.engine import TransformersEngine  # noqa: E402
from genengine.errors import (  # noqa: E402
    EngineSleepingError,
    GenEngineError,
    InvalidArgumentError,
    WeightLoadError,
    WeightsNotLoadedError,
)
from genengine.protocol import TAG_KV_CACHE, TAG_WEIGHTS, GenerationResult, SamplingParams  # noqa: E402
from genengine.requests import normalize_requests  # noqa: E402

CI_SCALE = 0.25
"""A quarter of the written counts in CI: the derandomized cases are the same on every run, so more of them buys
less than the nightly's fresh ones. ``--hypothesis-show-statistics`` shows which outcomes a property reached."""
CI_SCALE_OUTCOMES = 0.5
"""Half, for the cheap properties (a few seconds) whose outcomes a quarter does not all reach: at a quarter the
streaming load_weights property no longer reaches "rejected after writing" (one case of 170 does at half)."""
_ENV_SCALE = os.environ.get("GENENGINE_FUZZ_SCALE")
SCALE = float(_ENV_SCALE) if _ENV_SCALE else CI_SCALE
"""What the written counts are multiplied by: ``GENENGINE_FUZZ_SCALE`` for every property when it is set."""
NIGHTLY = SCALE != CI_SCALE or os.environ.get("GENENGINE_FUZZ_RANDOM") == "1"
PROBE = ["The quick brown fox", "Hello"]
GREEDY2 = {"temperature": 0.0, "max_new_tokens": 2, "logprobs": True}
CHEAP_TOKENS = 4  # a valid request runs for real only when it is this cheap (or is bound to fail the context check)

pytestmark = pytest.mark.timeout(max(300, int(300 * SCALE)))


def _settings(examples: int, *, ci_scale: float = CI_SCALE, **extra: Any) -> settings:
    scale = SCALE if _ENV_SCALE else ci_scale
    return settings(
        max_examples=max(1, int(examples * scale)),
        deadline=None,
        derandomize=not NIGHTLY,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        **extra,
    )


class StreamingTransformersEngine(TransformersEngine):
    """The embedded engine writing each bucket as it is validated, as SGLang and vLLM do."""

    validate_all_weights_first = False


# ---- shared engines and references ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def weights() -> dict[str, dict[str, Any]]:
    from genengine.models.tiny_model import tiny_model_dir
    from genengine.testing.conformance import load_checkpoint

    return {"A": load_checkpoint(tiny_model_dir()), "B": load_checkpoint(tiny_model_dir(seed=1))}


def _engine(cls: type[TransformersEngine]) -> TransformersEngine:
    import torch

    from genengine.models.tiny_model import tiny_model_dir

    torch.set_num_threads(1)  # tiny tensors: one thread, and no OpenMP spinning against a busy core
    return cls(str(tiny_model_dir()), dtype="float32", prefix_cache_bytes=1 << 20)


@pytest.fixture(scope="module")
def engine() -> Iterator[TransformersEngine]:
    import torch

    threads = torch.get_num_threads()
    e = _engine(TransformersEngine)
    try:
        yield e
    finally:
        e.shutdown()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def streaming_engine() -> Iterator[TransformersEngine]:
    e = _engine(StreamingTransformersEngine)
    try:
        yield e
    finally:
        e.shutdown()


@pytest.fixture(scope="module")
def references(engine: TransformersEngine, weights: dict[str, dict[str, Any]]) -> dict[str, list[list[int]]]:
    """Greedy outputs of ``PROBE`` under each weight set (the engine starts with A and is left with A)."""
    refs = {}
    for name in ("B", "A"):
        engine.load_weights(weights[name].items())
        refs[name] = _tokens(engine.generate(PROBE, GREEDY2))
    assert refs["A"] != refs["B"], "the two weight sets must be told apart by the probe"
    return refs


def _tokens(results: list[GenerationResult]) -> list[list[int]]:
    return [o.token_ids for r in results for o in r.outputs]


def _snapshot(engine: TransformersEngine) -> list[Any]:
    return [p.detach().clone() for p in engine.model.parameters()]


def _unchanged(engine: TransformersEngine, snapshot: list[Any]) -> bool:
    import torch

    return all(torch.equal(p, s) for p, s in zip(engine.model.parameters(), snapshot, strict=True))


# ---- strategies ---------------------------------------------------------------------------------------------
ANY: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.binary(max_size=3),
    st.lists(st.integers(-3, 600), max_size=3),
    st.tuples(st.integers(), st.text(max_size=2)),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
TEXT = st.one_of(
    st.text(max_size=24),
    st.text(st.characters(categories=["Cc", "Cf", "Cs", "Co", "Zs", "Zl", "So", "Mn"]), max_size=12),
    st.sampled_from(
        ["", " ", "\x00", "\n\n\t", "\u200b", "🦊🚀", "日本語のテキスト", "a\ud800b", "\ufeffBOM", "é" * 3]
    ),
    st.builds(lambda c, k: c * k, st.sampled_from(["a", "ab ", "🦊", "\x01", "日"]), st.integers(900, 4000)),
)
TOKEN = st.one_of(st.integers(0, 511), st.sampled_from([-1, 512, 513, 10**9, 2**63, 2**70]), ANY)
TOKEN_PROMPT = st.one_of(st.lists(TOKEN, max_size=6), st.builds(lambda k: [7] * k, st.integers(1000, 1500)), ANY)

NUMPY: st.SearchStrategy[Any] = st.sampled_from(
    [
        np.float32(0.5),
        np.float32(1.5),
        np.float32("nan"),
        np.float64(0.0),
        np.int64(3),
        np.int64(0),
        np.int64(-1),
        np.uint8(2),
        np.array(2),
        np.array(0.5),
        np.bool_(True),
        np.array([1, 2]),
        np.array([1.0]),
        np.array([[1]]),
        np.array([-1]),
    ]
)
"""numpy scalars and arrays, which trainers pass (the contract takes numbers and integer arrays of any kind)."""

SAMPLING_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_new_tokens": st.one_of(st.sampled_from([1, 2, 0, -1, 1030, 10**6, 2**63, 2.0, 1.5]), ANY, NUMPY),
    "temperature": st.one_of(
        st.floats(0, 5), st.sampled_from([0, 0.0, 5e-324, 1e-300, 1e-30, 1e30, -0.0, 1]), ANY, NUMPY
    ),
    "top_p": st.one_of(st.floats(-1, 2), st.sampled_from([1e-300, 0.5, 1, 1.0000001]), ANY, NUMPY),
    "top_k": st.one_of(st.none(), st.integers(-3, 600), st.sampled_from([-1, 10**9, 2**70]), ANY, NUMPY),
    "stop": st.one_of(
        st.text(max_size=4),
        st.lists(st.text(max_size=4), max_size=3),
        st.lists(st.text(max_size=4), max_size=3).map(tuple),
        st.sampled_from([set(), {"a"}, {}, {"a": 1}, b"", b"a"]),
        st.lists(st.text(max_size=4), max_size=2).map(iter),
        ANY,
        NUMPY,
    ),
    "stop_token_ids": st.one_of(
        st.lists(st.integers(-2, 2**40), max_size=3),
        st.lists(st.integers(0, 600), max_size=3).map(lambda ids: np.array(ids, dtype=np.int64)),
        st.sampled_from([set(), {3}, {}, {3: 1}, b"", (np.int64(1), np.uint8(2))]),
        st.lists(st.integers(0, 9), max_size=2).map(iter),
        ANY,
        NUMPY,
    ),
    "n": st.sampled_from([1, 2, 0, -1, 2.0, True, "2", None, [1], np.int64(2), np.float32(1)]),  # never a huge n
    "seed": st.one_of(st.none(), st.integers(-(2**80), 2**80), ANY, NUMPY),
    "logprobs": st.one_of(st.booleans(), ANY, NUMPY),
    "ignore_eos": st.one_of(st.booleans(), ANY, NUMPY),
    # no adapter is loaded on the fuzzed engines: every name is refused up front, None is the base model
    "adapter": st.one_of(st.none(), st.text(max_size=6), st.sampled_from(["policy", "policy\n", "", b"a", 1]), ANY),
}
PARAMS_DICT = st.fixed_dictionaries({}, optional=SAMPLING_FIELDS)
PARAMS = st.one_of(
    PARAMS_DICT,
    st.builds(lambda d, k, v: {**d, k: v}, PARAMS_DICT, st.text(min_size=1, max_size=12), ANY),  # unknown key
    st.lists(PARAMS_DICT, max_size=3),  # one per prompt (or the wrong count)
    st.none(),
    ANY,
)


# Mostly valid requests, so that many cases run for real (the strategies above are mostly rejected).
VALID_TEXT = st.one_of(
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=24),
    st.sampled_from(["\x00", " ", "\n", "\u200b", "🦊🚀", "日本語", "\ufeffBOM", "<|endoftext|>", "<|im_start|>user"]),
)
VALID_PARAMS = st.fixed_dictionaries(
    {"max_new_tokens": st.integers(1, 2)},
    optional={
        "temperature": st.one_of(st.just(0.0), st.floats(1e-3, 3), st.sampled_from([5e-324, 1e-300, 1e-38])),
        "top_p": st.floats(1e-6, 1).filter(lambda p: p > 0),
        "top_k": st.one_of(st.none(), st.just(-1), st.integers(1, 600)),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, 2**40), max_size=3),
        "n": st.integers(1, 2),
        "seed": st.one_of(st.none(), st.integers(-(2**80), 2**80)),
        "logprobs": st.booleans(),
        "ignore_eos": st.booleans(),
    },
)


def _check_generate(
    engine: TransformersEngine, snapshot: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str:
    """One fuzz case of ``generate``; returns how it ended (for hypothesis' event statistics)."""
    try:
        return _generate_case(engine, args, kwargs)
    finally:
        assert engine.state.weights_loaded and not engine.is_sleeping
        assert _unchanged(engine, snapshot), f"generate{args, kwargs} changed a weight"


def _generate_case(engine: TransformersEngine, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    vocab = engine.model.config.vocab_size
    try:
        requests = normalize_requests(*args, **kwargs, vocab_size=vocab)
    except InvalidArgumentError as expected:
        with pytest.raises(InvalidArgumentError) as info:
            engine.generate(*args, **kwargs)
        assert str(info.value) == str(expected)
        return "rejected by validation"
    work = max(r.params.max_new_tokens * r.params.n for r in requests)
    if CHEAP_TOKENS < work < 1000:
        return "valid, not run (too long for a fuzz case)"
    try:
        results = engine.generate(*args, **kwargs)
    except InvalidArgumentError as exc:
        assert "exceeds the model's context" in str(exc) or "encodes to no tokens" in str(exc), exc
        return "rejected by the engine"
    except GenEngineError as exc:  # any other documented error would be a state problem: there is none here
        pytest.fail(f"unexpected {type(exc).__name__}: {exc}")
    assert len(results) == len(requests)
    for req, result in zip(requests, results, strict=True):
        assert len(result.outputs) == req.params.n
        assert all(isinstance(t, int) for t in result.prompt_token_ids) and result.prompt_token_ids
        for out in result.outputs:
            assert 1 <= len(out.token_ids) <= req.params.max_new_tokens
            assert all(0 <= t < vocab for t in out.token_ids)
            assert out.finish_reason in ("stop", "length") and isinstance(out.text, str)
            if req.params.logprobs:
                assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
                assert all(math.isfinite(lp) and lp <= 1e-6 for lp in out.logprobs), out.logprobs
            else:
                assert out.logprobs is None
    return "generated"


# ---- generate ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def snapshot(engine: TransformersEngine, references: Any) -> list[Any]:
    """The weights (set A) every generate case must leave as they are."""
    return _snapshot(engine)


@_settings(2000)
@given(prompts=st.one_of(st.lists(TEXT, max_size=3), TEXT, ANY), params=PARAMS)
def test_fuzz_generate_text_prompts(engine: TransformersEngine, snapshot: list[Any], prompts: Any, params: Any) -> None:
    hypothesis.event(_check_generate(engine, snapshot, (prompts, params), {}))


@_settings(1200)
@given(ids=st.one_of(st.lists(TOKEN_PROMPT, max_size=3), TOKEN_PROMPT), params=PARAMS)
def test_fuzz_generate_token_prompts(engine: TransformersEngine, snapshot: list[Any], ids: Any, params: Any) -> None:
    hypothesis.event(_check_generate(engine, snapshot, (), {"prompt_token_ids": ids, "sampling_params": params}))


def test_tiny_temperature_is_the_greedy_limit(engine: TransformersEngine) -> None:
    """Found by this fuzzing: float32 logits / 1e-300 overflowed to NaN (a garbage token, a NaN logprob)."""
    greedy = engine.generate(PROBE, GREEDY2)
    tiny = engine.generate(PROBE, {**GREEDY2, "temperature": 1e-300, "seed": 1})
    assert _tokens(tiny) == _tokens(greedy)
    assert all(lp == pytest.approx(0.0, abs=1e-6) for r in tiny for lp in r.outputs[0].logprobs or [math.nan])


# ---- an oracle independent of the validation code -----------------------------------------------------------
# The cases above take their expected errors from ``normalize_requests``, the function ``generate`` calls, so a
# validation bug would be invisible to them. The table and the predicate below say what the contract
# (docs/contract.md) accepts, written out by hand.
VOCAB = 512  # the tiny model's vocabulary: ids 0..511
CONTEXT = 1024  # its max_position_embeddings: prompt + max_new_tokens must fit
OK = None
_OK_PROMPT: dict[str, Any] = {"prompts": ["Hello"]}


def _gen() -> Any:
    return (s for s in ["x"])


BOUNDARIES: list[tuple[dict[str, Any], dict[str, Any], str | None]] = [
    # (generate's prompt arguments, sampling parameters, None if accepted else a fragment of the error)
    *[(_OK_PROMPT, {"top_p": v}, OK) for v in (5e-324, 1e-300, 1e-6, 0.5, 1, 1.0, np.float32(0.5), np.float64(1))],
    *[
        (_OK_PROMPT, {"top_p": v}, f"top_p={v!r}")
        for v in (0, 0.0, -0.0, -1e-300, 1.0000001, 2, math.nan, math.inf, -math.inf, np.float32(1.5))
    ],
    (_OK_PROMPT, {"top_p": True}, "top_p=True"),
    (_OK_PROMPT, {"top_p": "0.5"}, "top_p='0.5'"),
    (_OK_PROMPT, {"top_p": None}, "top_p=None"),
    *[(_OK_PROMPT, {"temperature": v}, OK) for v in (0, 0.0, -0.0, 5e-324, 1e-300, 0.7, 1, 1e30, np.float32(0.7))],
    *[
        (_OK_PROMPT, {"temperature": v}, f"temperature={v!r}")
        for v in (-1e-300, -0.5, -1, math.nan, math.inf, -math.inf, np.float32("nan"), 10**400)
    ],
    (_OK_PROMPT, {"temperature": True}, "temperature=True"),
    (_OK_PROMPT, {"temperature": "1"}, "temperature='1'"),
    *[(_OK_PROMPT, {"max_new_tokens": v}, OK) for v in (1, 2, np.int64(1), np.uint8(2))],
    *[(_OK_PROMPT, {"max_new_tokens": v}, f"max_new_tokens={v!r}") for v in (0, -1, 1.0, 1.5, True, "1", None)],
    *[(_OK_PROMPT, {"top_k": v}, OK) for v in (None, -1, 1, 2, VOCAB, VOCAB + 1, np.int32(3))],
    *[(_OK_PROMPT, {"top_k": v}, f"top_k={v!r}") for v in (0, -2, 1.0, True, "1")],
    *[(_OK_PROMPT, {"n": v}, OK) for v in (1, 2, np.int64(2))],
    *[(_OK_PROMPT, {"n": v}, f"n={v!r}") for v in (0, -1, 1.0, True, None)],
    *[(_OK_PROMPT, {"seed": v}, OK) for v in (None, 0, -5, 2**80, np.int64(3))],
    *[(_OK_PROMPT, {"seed": v}, f"seed={v!r}") for v in (1.5, "1", True)],
    *[(_OK_PROMPT, {"stop": v}, OK) for v in (None, "x", ["x", "yz"], ("x",), [])],
    *[(_OK_PROMPT, {"stop": v}, f"stop={v!r}") for v in ("", [""], ["x", 1], {"x": 1}, {"x"}, b"x", 5, {}, b"")],
    (_OK_PROMPT, {"stop": _gen()}, "(generator)"),
    *[
        (_OK_PROMPT, {"stop_token_ids": v}, OK)
        for v in (None, [], [0], [VOCAB - 1], [VOCAB], (1, 2), np.array([1, 2]), [np.int64(3)])
    ],
    *[(_OK_PROMPT, {"stop_token_ids": v}, f"stop_token_ids={v!r}") for v in ("12", 12, {1: 2}, {1}, {})],
    *[(_OK_PROMPT, {"stop_token_ids": v}, f"holds {v[0]!r}") for v in ([-1], [1.0], [True])],
    (_OK_PROMPT, {"stop_token_ids": np.array([1.0])}, "dtype float64"),
    (_OK_PROMPT, {"stop_token_ids": _gen()}, "(generator)"),
    *[(_OK_PROMPT, {"logprobs": v, "ignore_eos": v}, OK) for v in (True, False, np.bool_(True))],
    *[(_OK_PROMPT, {"logprobs": v}, f"logprobs={v!r}") for v in (1, 0, None, "true")],
    (_OK_PROMPT, {"ignore_eos": 1}, "ignore_eos=1"),
    (
        _OK_PROMPT,
        {"max_tokens": 1},
        "'max_tokens' is not supported by genengine: it is vLLM's name: use max_new_tokens",
    ),
    (_OK_PROMPT, {"min_tokens": 1}, "'min_tokens' is not supported by genengine"),
    (_OK_PROMPT, {"temprature": 1}, "unknown sampling parameter 'temprature' (did you mean 'temperature'?)"),
    # prompts
    ({"prompts": "Hello"}, {}, OK),
    ({"prompts": [" "]}, {}, OK),
    ({"prompts": ["Hello", "🦊"]}, [{}, {"n": 2}], OK),
    ({"prompts": []}, {}, "prompts is empty"),
    ({"prompts": [""]}, {}, "prompts[0] is an empty string"),
    ({"prompts": ["a", ""]}, {}, "prompts[1] is an empty string"),
    ({"prompts": [None]}, {}, "prompts[0]=None is not a string"),
    ({"prompts": [b"hi"]}, {}, "prompts[0]=b'hi' is not a string"),
    ({"prompts": ["a\ud800"]}, {}, "prompts[0] is not valid Unicode"),
    ({"prompts": ["a", "b"]}, [{}, {}, {}], "3 entries for 2 prompts"),
    ({}, {}, "needs prompts"),
    ({"prompts": ["a"], "prompt_token_ids": [[1]]}, {}, "not both"),
    # token prompts
    *[({"prompt_token_ids": v}, {}, OK) for v in ([[0]], [[VOCAB - 1]], [[1, 2], [3]], np.array([[1, VOCAB - 1]]))],
    ({"prompt_token_ids": [[7] * (CONTEXT - 1)]}, {"max_new_tokens": 1}, OK),  # exactly fills the context
    ({"prompt_token_ids": [[7] * CONTEXT]}, {"max_new_tokens": 1}, "exceeds the model's context of 1024 tokens"),
    ({"prompt_token_ids": [[7] * (CONTEXT - 1)]}, {"max_new_tokens": 2}, "with max_new_tokens=2 it exceeds"),
    ({"prompt_token_ids": [[1, VOCAB]]}, {}, f"prompt_token_ids[0] holds {VOCAB}, outside the vocabulary [0, {VOCAB})"),
    ({"prompt_token_ids": [[2**63]]}, {}, "outside the vocabulary"),
    ({"prompt_token_ids": [[-1]]}, {}, "prompt_token_ids[0] holds -1"),
    ({"prompt_token_ids": [[1.0]]}, {}, "prompt_token_ids[0] holds 1.0"),
    ({"prompt_token_ids": [[True]]}, {}, "prompt_token_ids[0] holds True"),
    ({"prompt_token_ids": []}, {}, "prompt_token_ids is empty"),
    ({"prompt_token_ids": [[]]}, {}, "prompt_token_ids[0] is empty"),
    ({"prompt_token_ids": [1, 2]}, {}, "wrap a single prompt"),
    ({"prompt_token_ids": np.array([[1.0, 2.0]])}, {}, "array of dtype float64"),
]


def _case_id(i: int, case: tuple[dict[str, Any], Any, str | None]) -> str:
    prompt, params, error = case
    keys = list(params) if isinstance(params, dict) and params else list(prompt) or ["no prompt"]
    return f"{i}-{'+'.join(keys)}-{'ok' if error is None else 'refused'}"


@pytest.mark.parametrize(
    ("prompt", "params", "error"), BOUNDARIES, ids=[_case_id(i, c) for i, c in enumerate(BOUNDARIES)]
)
def test_boundaries_against_the_contract(
    engine: TransformersEngine, snapshot: list[Any], prompt: dict[str, Any], params: Any, error: str | None
) -> None:
    assert engine.model.config.vocab_size == VOCAB and engine.model.config.max_position_embeddings == CONTEXT
    if isinstance(params, dict) and not any(k.endswith("_tokens") for k in params):
        params = {**params, "max_new_tokens": 1}  # keep accepted cases cheap
    kwargs = dict(prompt)
    args = (kwargs.pop("prompts"),) if "prompts" in kwargs else ()
    try:
        if error is None:
            results = engine.generate(*args, sampling_params=params, **kwargs)
            assert results and all(r.outputs for r in results)
            assert all(0 <= t < VOCAB for r in results for o in r.outputs for t in o.token_ids)
        else:
            with pytest.raises(InvalidArgumentError) as info:
                engine.generate(*args, sampling_params=params, **kwargs)
            assert error in str(info.value)
    finally:
        assert _unchanged(engine, snapshot) and not engine.is_sleeping


def _int(v: Any) -> bool:
    return (isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))) or (
        isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "iu"
    )


def _real(v: Any) -> bool:
    number = (
        _int(v)
        or isinstance(v, (float, np.floating))
        or (isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind == "f")
    )
    return number and math.isfinite(float(v))


CONTRACT: dict[str, Any] = {
    "max_new_tokens": lambda v: _int(v) and v >= 1,
    "temperature": lambda v: _real(v) and v >= 0,
    "top_p": lambda v: _real(v) and 0 < v <= 1,
    "top_k": lambda v: v is None or (_int(v) and (v == -1 or v >= 1)),
    "stop": lambda v: (
        v is None
        or (isinstance(v, str) and v != "")
        or (isinstance(v, (list, tuple)) and all(isinstance(s, str) and s != "" for s in v))
    ),
    "stop_token_ids": lambda v: (
        v is None
        or (isinstance(v, (list, tuple)) and all(_int(t) and t >= 0 for t in v))
        or (isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "iu" and bool((v >= 0).all()))
    ),
    "n": lambda v: _int(v) and v >= 1,
    "seed": lambda v: v is None or _int(v),
    "logprobs": lambda v: isinstance(v, (bool, np.bool_)),
    "ignore_eos": lambda v: isinstance(v, (bool, np.bool_)),
    "adapter": lambda v: v is None or (isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.@:\-]{0,127}", v)),
}
"""Per field, what the contract accepts: numbers (numpy's too) in range, strings or lists of them, bools."""


@_settings(3000)
@given(params=PARAMS_DICT)
def test_fuzz_sampling_params_against_the_contract(params: dict[str, Any]) -> None:
    bad = sorted(k for k, v in params.items() if not CONTRACT[k](v))
    try:
        SamplingParams.coerce(params)
    except InvalidArgumentError as exc:
        assert bad, f"{params!r} is valid by the contract but was refused: {exc}"
        assert any(str(exc).startswith(k) or f"{k}=" in str(exc) or f"{k} " in str(exc) for k in bad), exc
        return
    assert not bad, f"{params!r} was accepted, but the contract refuses {bad}"


@_settings(500, ci_scale=CI_SCALE_OUTCOMES)
@given(
    prompts=st.one_of(
        st.lists(VALID_TEXT, min_size=1, max_size=3).map(lambda p: ("text", p)),
        st.lists(st.lists(st.integers(0, 511), min_size=1, max_size=8), min_size=1, max_size=3).map(
            lambda p: ("ids", p)
        ),
    ),
    params=st.one_of(VALID_PARAMS, st.lists(VALID_PARAMS, min_size=1, max_size=3)),
)
def test_fuzz_generate_valid_requests(
    engine: TransformersEngine, snapshot: list[Any], prompts: tuple[str, Any], params: Any
) -> None:
    kind, value = prompts
    if isinstance(params, list):  # one per prompt: make the count match most of the time
        params = (params * len(value))[: len(value)] if len(params) != len(value) and len(value) % 2 else params
    args, kwargs = (
        ((value, params), {}) if kind == "text" else ((), {"prompt_token_ids": value, "sampling_params": params})
    )
    hypothesis.event(_check_generate(engine, snapshot, args, kwargs))


# ---- load_weights -------------------------------------------------------------------------------------------------
def _entry_strategy(weights: dict[str, dict[str, Any]]) -> st.SearchStrategy[Any]:
    import torch

    names = sorted(weights["A"])

    def valid(name: str, which: str) -> Any:
        return (name, weights[which][name])

    def bad_shape(name: str) -> Any:
        t = weights["A"][name]
        return (name, torch.zeros((*t.shape[:-1], t.shape[-1] + 1)))

    def bad_dtype(name: str) -> Any:
        return (name, torch.zeros(weights["A"][name].shape, dtype=torch.int32))

    name = st.sampled_from(names)
    return st.one_of(
        st.builds(valid, name, st.sampled_from(["A", "B"])),
        st.builds(valid, name, st.sampled_from(["A", "B"])),  # valid entries twice as likely
        st.builds(bad_shape, name),
        st.builds(bad_dtype, name),
        st.builds(lambda n, v: (n, v), name, ANY),  # not a tensor
        st.builds(lambda n, t: (n, t), st.text(max_size=20), st.just(weights["A"][names[0]])),  # unknown name
        st.builds(lambda n: [n, weights["A"][n]], name),  # a list, not a pair
        st.builds(lambda n: (n,), name),
        ANY,
    )


def _classify(stream: list[Any], weights: dict[str, dict[str, Any]], raise_at: int | None) -> bool:
    """Whether the stream is valid (every entry a known name with a tensor of its shape, no name twice)."""
    import torch

    seen = set()
    for i, item in enumerate(stream):
        if raise_at is not None and i == raise_at:
            return False
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            return False
        name, tensor = item
        if name not in weights["A"] or name in seen or not isinstance(tensor, torch.Tensor):
            return False
        if not tensor.is_floating_point() or tensor.shape != weights["A"][name].shape:
            return False
        seen.add(name)
    return not (raise_at is not None and raise_at == len(stream))


class _Broken(Exception):
    pass


def _check_load(engine: TransformersEngine, weights: dict[str, dict[str, Any]], data: Any) -> str:
    import torch

    names = sorted(weights["A"])
    good = data.draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names)), label="names")
    stream: list[Any] = [(n, weights[data.draw(st.sampled_from(["A", "B"]))][n]) for n in good]
    if data.draw(st.integers(0, 3), label="bad entries") == 0:  # a quarter of the streams are valid
        stream = data.draw(st.lists(_entry_strategy(weights), max_size=8), label="stream")
    elif data.draw(st.booleans(), label="one bad entry"):
        at = data.draw(st.integers(0, len(stream)), label="bad at")
        stream.insert(at, data.draw(_entry_strategy(weights), label="bad entry"))
    raise_at = data.draw(st.one_of(st.none(), st.none(), st.integers(0, len(stream))), label="raise_at")
    plain = st.sampled_from([1, 1, 4096, None])  # small buckets: a streaming engine writes before a late failure
    bucket = data.draw(plain if data.draw(st.integers(0, 4)) else ANY, label="bucket_bytes")
    valid_bucket = bucket is None or (isinstance(bucket, int) and not isinstance(bucket, bool) and bucket >= 1)

    def source() -> Iterator[Any]:
        for i, item in enumerate(stream):
            if i == raise_at:
                raise _Broken("the trainer's stream broke")
            yield item
        if raise_at == len(stream):
            raise _Broken("the trainer's stream broke at its end")

    snapshot = _snapshot(engine)
    try:
        report = engine.load_weights(source(), bucket_bytes=bucket)
    except (WeightLoadError, InvalidArgumentError, _Broken) as exc:
        assert not (valid_bucket and _classify(stream, weights, raise_at)), f"a valid stream was rejected: {exc}"
        if engine.state.weights_loaded:
            assert _unchanged(engine, snapshot), f"rejected ({exc}) but weights changed"
            outcome = "rejected, nothing written"
        else:
            assert type(engine) is StreamingTransformersEngine, "only a streaming engine writes before failing"
            with pytest.raises(WeightsNotLoadedError):
                engine.generate(PROBE, GREEDY2)
            outcome = "rejected after writing: refused until a full load"
        engine.load_weights(weights["A"].items())
        assert engine.state.weights_loaded
        return outcome
    assert valid_bucket and _classify(stream, weights, raise_at), "an invalid stream was accepted"
    assert report.num_tensors == len(stream)
    params = dict(engine.model.named_parameters(remove_duplicate=False))
    for name, tensor in stream:
        assert torch.equal(params[name].detach(), tensor.to(params[name].dtype)), name
    engine.load_weights(weights["A"].items())
    return "applied"


@_settings(300, ci_scale=CI_SCALE_OUTCOMES)
@given(data=st.data())
def test_fuzz_load_weights(engine: TransformersEngine, weights: dict[str, dict[str, Any]], data: Any) -> None:
    hypothesis.event(_check_load(engine, weights, data))


@_settings(300, ci_scale=CI_SCALE_OUTCOMES)
@given(data=st.data())
def test_fuzz_load_weights_streaming(
    streaming_engine: TransformersEngine, weights: dict[str, dict[str, Any]], data: Any
) -> None:
    hypothesis.event(_check_load(streaming_engine, weights, data))


# ---- the state machine -------------------------------------------------------------------------------------------
class ContractModel(RuleBasedStateMachine):
    """The engine against a model of the contract; each run starts awake on weight set A."""

    engine: TransformersEngine
    weights: dict[str, dict[str, Any]]
    refs: dict[str, list[list[int]]]

    def __init__(self) -> None:
        super().__init__()
        self.released: set[str] = set()
        self.level: int | None = None
        self.loaded: str | None = "A"  # the complete weight set serving, or None when incomplete

    @initialize()
    def reset(self) -> None:
        e = self.engine
        if e.is_sleeping:
            e.wake()
        e.load_weights(self.weights["A"].items())

    @rule(level=st.sampled_from([1, 2, 1, 2, 0, 3, -1, True, "2", None]))
    def sleep(self, level: Any) -> None:
        if level not in (1, 2) or isinstance(level, bool):
            with pytest.raises(InvalidArgumentError):
                self.engine.sleep(level)
            return
        self.engine.sleep(level)
        if not self.released:
            self.released = {TAG_WEIGHTS, TAG_KV_CACHE}
            self.level = level
            if level == 2:
                self.loaded = None

    @rule(tags=st.one_of(st.none(), st.lists(st.sampled_from([TAG_WEIGHTS, TAG_KV_CACHE, "cuda_graph", "x"]))))
    def wake(self, tags: list[str] | None) -> None:
        if tags is not None and not set(tags) <= {TAG_WEIGHTS, TAG_KV_CACHE}:  # wake([]) is a no-op
            with pytest.raises(InvalidArgumentError):
                self.engine.wake(tags)
            return
        self.engine.wake(tags)
        self.released -= set(tags) if tags is not None else self.released
        if not self.released:
            self.level = None

    def _refused_while_asleep(self, items: list[Any]) -> bool:
        if TAG_WEIGHTS not in self.released:
            return False
        with pytest.raises(EngineSleepingError):
            self.engine.load_weights(items)
        return True

    @rule(which=st.sampled_from(["A", "B"]))
    def load_all(self, which: str) -> None:
        items = list(self.weights[which].items())
        if not self._refused_while_asleep(items):
            self.engine.load_weights(iter(items), bucket_bytes=4096)
            self.loaded = which

    @rule()
    def load_half(self) -> None:
        """Half of the set serving (no change), or of A when the weights are incomplete (still incomplete)."""
        items = list(self.weights[self.loaded or "A"].items())
        if not self._refused_while_asleep(items):
            self.engine.load_weights(items[: len(items) // 2])

    @rule(which=st.sampled_from(["A", "B"]), how=st.sampled_from(["raises", "bad entry"]))
    def load_broken(self, which: str, how: str) -> None:
        items = list(self.weights[which].items())
        if self._refused_while_asleep(items):
            return

        def broken() -> Iterator[Any]:
            yield from items[: len(items) // 2]
            if how == "bad entry":
                yield ("model.not_a_weight", items[0][1])
            raise _Broken("stream broke")

        with pytest.raises((_Broken, WeightLoadError)):
            self.engine.load_weights(broken(), bucket_bytes=1)
        if type(self.engine) is StreamingTransformersEngine:
            self.loaded = None  # buckets were written before the failure

    @rule()
    def flush(self) -> None:
        self.engine.flush_cache()

    @rule()
    def generate(self) -> None:
        if self.released:
            with pytest.raises(EngineSleepingError):
                self.engine.generate(PROBE, GREEDY2)
        elif self.loaded is None:
            with pytest.raises(WeightsNotLoadedError):
                self.engine.generate(PROBE, GREEDY2)
        else:
            assert _tokens(self.engine.generate(PROBE, GREEDY2)) == self.refs[self.loaded]

    @invariant()
    def state_matches(self) -> None:
        state = self.engine.state
        assert set(state.released_tags) == self.released
        assert state.sleep_level == self.level
        assert state.weights_loaded == (self.loaded is not None)


def _run_machine(engine: TransformersEngine, weights: Any, refs: Any, examples: int) -> None:
    class Machine(ContractModel):
        pass

    Machine.engine, Machine.weights, Machine.refs = engine, weights, refs
    run_state_machine_as_test(Machine, settings=_settings(examples, stateful_step_count=25))


def test_fuzz_state_machine(engine: TransformersEngine, weights: Any, references: Any) -> None:
    _run_machine(engine, weights, references, 50)


def test_fuzz_state_machine_streaming(streaming_engine: TransformersEngine, weights: Any, references: Any) -> None:
    _run_machine(streaming_engine, weights, references, 40)


def test_sampling_params_round_trip() -> None:
    """Every field of SamplingParams is fuzzed above (a new field must be added to the strategies)."""
    from dataclasses import fields

    assert {f.name for f in fields(SamplingParams)} == set(SAMPLING_FIELDS)
