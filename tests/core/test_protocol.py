"""SamplingParams and request validation (the bad-input list of the contract) and the protocols' shape, without
any engine."""

from __future__ import annotations

import inspect
import math

import pytest

from genengine.errors import InvalidArgumentError
from genengine.protocol import AsyncGenerationEngine, GenerationEngine, SamplingParams, is_async_engine
from genengine.requests import normalize_requests


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"max_new_tokens": -3}, "max_new_tokens=-3"),
        ({"max_new_tokens": 2.5}, "max_new_tokens=2.5"),
        ({"temperature": -0.1}, "temperature=-0.1"),
        ({"temperature": math.nan}, "temperature=nan"),
        ({"temperature": math.inf}, "temperature=inf"),
        ({"top_p": 0}, "top_p=0"),
        ({"top_p": 1.01}, "top_p=1.01"),
        ({"top_p": math.nan}, "top_p=nan"),
        ({"top_k": 0}, "top_k=0"),
        ({"top_k": -2}, "top_k=-2"),
        ({"top_k": 1.5}, "top_k=1.5"),
        ({"n": 0}, "n=0"),
        ({"stop": 5}, "stop=5"),
        ({"stop": [""]}, "stop=['']"),
        ({"stop": ["a", 1]}, "stop=['a', 1]"),
        ({"stop_token_ids": "12"}, "stop_token_ids='12'"),
        ({"stop_token_ids": [-1]}, "stop_token_ids holds -1"),
        ({"seed": "x"}, "seed='x'"),
        ({"logprobs": 1}, "logprobs=1"),
    ],
)
def test_bad_sampling_params(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_good_sampling_params_normalised() -> None:
    p = SamplingParams(stop="###", top_k=-1, stop_token_ids=[3, 4])
    assert p.stop == ("###",) and p.top_k_or_none is None and p.stop_token_ids == (3, 4)
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams.coerce({"temperature": 0.5}).temperature == 0.5
    with pytest.raises(InvalidArgumentError, match="did you mean 'max_new_tokens'"):
        SamplingParams.coerce({"max_new_token": 3})
    with pytest.raises(InvalidArgumentError, match="must be a SamplingParams"):
        SamplingParams.coerce(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "kwargs", "fragment"),
    [
        ((), {}, "needs prompts"),
        (([],), {}, "prompts is empty"),
        ((["a", ""],), {}, "prompts[1] is an empty string"),
        ((["a", 3],), {}, "prompts[1]=3 is not a string"),
        ((["a"],), {"prompt_token_ids": [[1]]}, "not both"),
        ((), {"prompt_token_ids": []}, "prompt_token_ids is empty"),
        ((), {"prompt_token_ids": [[]]}, "prompt_token_ids[0] is empty"),
        ((), {"prompt_token_ids": [1, 2]}, "wrap a single prompt"),
        ((), {"prompt_token_ids": [[1, -1]]}, "holds -1"),
        ((), {"prompt_token_ids": [[1, 99]], "vocab_size": 50}, "outside the vocabulary [0, 50)"),
        ((["a", "b"], [SamplingParams()] * 3), {}, "3 entries for 2 prompts"),
        ((["a"],), {"image_data": ["img"]}, "does not take image_data"),
    ],
)
def test_bad_requests(args: tuple[object, ...], kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        normalize_requests(*args, **kwargs)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_requests_keep_order_and_per_prompt_params() -> None:
    reqs = normalize_requests(["x", "y"], [{"n": 2}, {"n": 3}])
    assert [(r.index, r.prompt, r.params.n) for r in reqs] == [(0, "x", 2), (1, "y", 3)]
    assert [r.prompt for r in normalize_requests("solo")] == ["solo"]
    reqs = normalize_requests(prompt_token_ids=[[1, 2], [3]], sampling_params=SamplingParams(seed=1))
    assert [r.prompt_token_ids for r in reqs] == [(1, 2), (3,)] and all(r.params.seed == 1 for r in reqs)


def test_plain_int_token_ids_skip_the_per_token_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 41 (P1): a batch of plain-int lists is checked in C, not token by token (~9 ms for 64 x 128 ids
    before, ~1 % of a 7B generate); the errors still name the first bad token, and bools still go the long way."""
    import genengine.protocol as protocol

    greedy = SamplingParams(temperature=0.0)  # its own checks are not the tokens'
    calls = []
    real = protocol.plain_scalar
    monkeypatch.setattr(protocol, "plain_scalar", lambda v: (calls.append(v), real(v))[1])
    rows = [[5, 0, 6, 1], (2, 3)]
    reqs = normalize_requests(prompt_token_ids=rows, sampling_params=greedy, vocab_size=7)
    assert [r.prompt_token_ids for r in reqs] == [(5, 0, 6, 1), (2, 3)] and calls == []
    with pytest.raises(InvalidArgumentError, match=r"prompt_token_ids\[0\] holds 9, outside the vocabulary \[0, 7\)"):
        normalize_requests(prompt_token_ids=[[1, 9, 8]], vocab_size=7)
    with pytest.raises(InvalidArgumentError, match=r"prompt_token_ids\[1\] holds -2: token ids are ints >= 0"):
        normalize_requests(prompt_token_ids=[[1], [3, -2, -1]])
    with pytest.raises(InvalidArgumentError, match="holds True"):
        normalize_requests(prompt_token_ids=[[1, True]])


# ---- issue 15 item 6: sequences, numpy/torch values, other engines' parameter names ---------------------------
def _generator() -> object:
    return (s for s in ["a"])


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [
        ("stop", _generator(), "generator"),  # was silently ()
        ("stop", {"###": 1}, "dict"),  # was its keys
        ("stop", {"###"}, "set"),
        ("stop_token_ids", (i for i in [3]), "generator"),
        ("stop_token_ids", {3: "x"}, "dict"),
        ("stop_token_ids", {3}, "set"),
    ],
)
def test_sequence_fields_take_only_sequences(field: str, value: object, kind: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    msg = str(info.value)
    assert msg.startswith(f"{field}=") and f"({kind})" in msg
    assert "list/tuple of non-empty strings" in msg if field == "stop" else "a list of token ids (ints >= 0)" in msg


def test_numpy_and_torch_numbers_are_taken_as_python_numbers() -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    p = SamplingParams(
        max_new_tokens=np.int64(8),
        temperature=np.float32(0.5),
        top_p=np.float32(0.25),
        top_k=np.int32(5),
        n=torch.tensor(2),
        seed=np.uint16(7),
        logprobs=np.bool_(True),
    )
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.n, p.seed, p.logprobs) == (8, 0.5, 0.25, 5, 2, 7, True)
    assert [type(v) for v in (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.n, p.seed, p.logprobs)] == [
        int,
        float,
        float,
        int,
        int,
        int,
        bool,
    ]
    with pytest.raises(InvalidArgumentError, match=r"top_p=np\.float32\(2\.0\) must be in \(0, 1\]"):
        SamplingParams(top_p=np.float32(2.0))
    with pytest.raises(InvalidArgumentError, match=r"max_new_tokens=np\.float64\(8\.0\) is not an integer; allowed"):
        SamplingParams(max_new_tokens=np.float64(8.0))
    with pytest.raises(InvalidArgumentError, match=r"temperature=np\.float32\(nan\) must be finite; allowed: a number"):
        SamplingParams(temperature=np.float32("nan"))


def test_numpy_and_torch_token_ids_are_taken_as_ints() -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    want = [(1, 2, 3), (4, 5, 6)]
    for ids in (
        np.array([[1, 2, 3], [4, 5, 6]]),
        torch.tensor([[1, 2, 3], [4, 5, 6]]),
        [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6], dtype=torch.int32)],
        [np.array([1, 2, 3], dtype=np.int16), [np.int64(4), np.uint8(5), torch.tensor(6)]],
        [list(torch.tensor([1, 2, 3])), (4, 5, 6)],  # 0-d tensors, as list(tensor) gives them
    ):
        reqs = normalize_requests(prompt_token_ids=ids, vocab_size=7)
        assert [r.prompt_token_ids for r in reqs] == want
        assert all(type(t) is int for r in reqs for t in r.prompt_token_ids or ())
    for stops in (np.array([3, 4]), torch.tensor([3, 4]), [np.int64(3), torch.tensor(4)]):
        p = SamplingParams(stop_token_ids=stops)
        assert p.stop_token_ids == (3, 4) and all(type(t) is int for t in p.stop_token_ids)


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (
            lambda np, torch: {"prompt_token_ids": np.array([[1.0, 2.0]])},
            "prompt_token_ids is an array of dtype float64",
        ),
        (
            lambda np, torch: {"prompt_token_ids": [torch.tensor([1.0, 2.0])]},
            "prompt_token_ids[0] is an array of dtype",
        ),
        (lambda np, torch: {"prompt_token_ids": torch.tensor([[True]])}, "prompt_token_ids is an array of dtype"),
        (lambda np, torch: {"prompt_token_ids": np.array([1, 2])}, "wrap a single prompt as [[...]]"),
        (
            lambda np, torch: {"prompt_token_ids": [np.float32(1.0)]},
            "[0]=np.float32(1.0) is a single value, not a list",
        ),
        (lambda np, torch: {"sampling_params": {"stop_token_ids": np.array([1.5])}}, "stop_token_ids is an array"),
        (lambda np, torch: {"sampling_params": {"stop_token_ids": np.array([[1]])}}, "shape (1, 1)"),
    ],
)
def test_float_and_misshapen_token_arrays_are_refused_clearly(make: object, fragment: str) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    kwargs = make(np, torch)  # type: ignore[operator]
    kwargs.setdefault("prompt_token_ids", [[1]])
    with pytest.raises(InvalidArgumentError) as info:
        normalize_requests(**kwargs)
    assert fragment in str(info.value)
    assert "integer" in str(info.value) or "wrap" in str(info.value)


@pytest.mark.parametrize(
    ("name", "advice", "wrong_hint"),
    [
        ("min_tokens", "no minimum length", "max_new_tokens"),
        ("logit_bias", "logits cannot be changed", "logprobs"),
        ("best_of", "sample n completions", "stop"),
        ("skip_special_tokens", "special tokens skipped", "stop_token_ids"),
        ("max_tokens", "use max_new_tokens", None),
        ("sampling_seed", "use seed", None),
        ("min_new_tokens", "no minimum length", "max_new_tokens"),
    ],
)
def test_vllm_and_sglang_names_are_named_unsupported(name: str, advice: str, wrong_hint: str | None) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        SamplingParams.coerce({name: 1})
    msg = str(info.value)
    assert f"sampling parameter {name!r} is not supported by genengine" in msg and advice in msg
    assert "did you mean" not in msg
    assert "allowed: max_new_tokens, temperature" in msg


def test_unsupported_table_advice_names_real_fields() -> None:
    import re
    from dataclasses import fields

    from genengine.protocol import UNSUPPORTED_SAMPLING_PARAMS

    names = {f.name for f in fields(SamplingParams)}
    assert not names & set(UNSUPPORTED_SAMPLING_PARAMS)
    for advice in UNSUPPORTED_SAMPLING_PARAMS.values():
        for field in re.findall(r"use (\w+)", advice):
            assert field in names, advice


# ---- is_async_engine: the declaration, asked in one place --------------------------------------------------
class _Declares:
    supports_async = True


class _DeclaresNot:
    supports_async = False


class _Forwards:
    """A wrapper that forwards attributes (as the transport tests' engine wrappers do)."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


class _SyncWithAStream:
    """A synchronous engine with a ``stream`` of its own: no async declaration, so not async."""

    def stream(self) -> None: ...


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        (_Declares(), True),
        (_Forwards(_Declares()), True),
        (_DeclaresNot(), False),
        (_Forwards(_DeclaresNot()), False),
        (_SyncWithAStream(), False),
        (object(), False),
    ],
)
def test_is_async_engine_reads_the_declaration(engine: object, expected: bool) -> None:
    assert is_async_engine(engine) is expected


def test_the_async_protocol_extends_the_sync_one_whose_load_weights_takes_a_version() -> None:
    """Transports call ``load_weights(bucket, version=...)`` on any engine: the protocol must say it takes it."""
    assert GenerationEngine in AsyncGenerationEngine.__mro__
    version = inspect.signature(GenerationEngine.load_weights).parameters["version"]
    assert version.kind is inspect.Parameter.KEYWORD_ONLY and version.default is None
