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

``GENENGINE_FUZZ_SCALE`` multiplies the example counts (benchmarks/fuzz_nightly.py runs with a large scale and a
random seed; CI runs derandomized, so a failure here reproduces).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test  # noqa: E402

from genengine.backends.transformers import TransformersEngine  # noqa: E402
from genengine.errors import (  # noqa: E402
    EngineSleepingError,
    GenEngineError,
    InvalidArgumentError,
    WeightLoadError,
    WeightsNotLoadedError,
)
from genengine.protocol import TAG_KV_CACHE, TAG_WEIGHTS, GenerationResult, SamplingParams  # noqa: E402
from genengine.requests import normalize_requests  # noqa: E402

SCALE = float(os.environ.get("GENENGINE_FUZZ_SCALE", "1"))
NIGHTLY = SCALE != 1 or os.environ.get("GENENGINE_FUZZ_RANDOM") == "1"
PROBE = ["The quick brown fox", "Hello"]
GREEDY2 = {"temperature": 0.0, "max_new_tokens": 2, "logprobs": True}
CHEAP_TOKENS = 4  # a valid request runs for real only when it is this cheap (or is bound to fail the context check)

pytestmark = pytest.mark.timeout(max(300, int(300 * SCALE)))


def _settings(examples: int, **extra: Any) -> settings:
    return settings(
        max_examples=max(1, int(examples * SCALE)),
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
    from genengine.testing.conformance import load_checkpoint
    from genengine.testing.tiny_model import tiny_model_dir

    return {"A": load_checkpoint(tiny_model_dir()), "B": load_checkpoint(tiny_model_dir(seed=1))}


def _engine(cls: type[TransformersEngine]) -> TransformersEngine:
    import torch

    from genengine.testing.tiny_model import tiny_model_dir

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

SAMPLING_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_new_tokens": st.one_of(st.sampled_from([1, 2, 0, -1, 1030, 10**6, 2**63, 2.0, 1.5]), ANY),
    "temperature": st.one_of(st.floats(0, 5), st.sampled_from([0, 0.0, 5e-324, 1e-300, 1e-30, 1e30, -0.0, 1]), ANY),
    "top_p": st.one_of(st.floats(-1, 2), st.sampled_from([1e-300, 0.5, 1, 1.0000001]), ANY),
    "top_k": st.one_of(st.none(), st.integers(-3, 600), st.sampled_from([-1, 10**9, 2**70]), ANY),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), ANY),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, 2**40), max_size=3), ANY),
    "n": st.sampled_from([1, 2, 0, -1, 2.0, True, "2", None, [1]]),  # never a huge valid n: that is a big job
    "seed": st.one_of(st.none(), st.integers(-(2**80), 2**80), ANY),
    "logprobs": st.one_of(st.booleans(), ANY),
    "ignore_eos": st.one_of(st.booleans(), ANY),
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


@_settings(500)
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


@_settings(300)
@given(data=st.data())
def test_fuzz_load_weights(engine: TransformersEngine, weights: dict[str, dict[str, Any]], data: Any) -> None:
    hypothesis.event(_check_load(engine, weights, data))


@_settings(300)
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
        if tags is not None and (not tags or not set(tags) <= {TAG_WEIGHTS, TAG_KV_CACHE}):
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
