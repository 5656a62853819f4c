"""SamplingParams and request validation: the bad-input list of the contract, without any engine."""

from __future__ import annotations

import math

import pytest

from genengine.errors import InvalidArgumentError
from genengine.protocol import SamplingParams
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
        ({"stop_token_ids": [-1]}, "stop_token_ids=(-1,)"),
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
