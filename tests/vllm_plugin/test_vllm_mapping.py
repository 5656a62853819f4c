"""The vllm plugin's mapping of the protocol to vLLM and back (no vLLM needed): sampling keyword arguments, and
outputs shaped like vLLM 0.26's RequestOutput / CompletionOutput / FlatLogprobs, whole and streamed.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from support.vllm_fakes import completion as _completion

from genengine.errors import (
    EngineStateError,
    InvalidArgumentError,
)
from genengine.protocol import SamplingParams
from genengine_vllm.mapping import (
    completion_delta,
    contract_stop_reason,
    convert_request_output,
    int_list,
    sampled_logprobs,
    split_greedy_n,
    vllm_sampling_kwargs,
)


def test_sampling_kwargs() -> None:
    kw = vllm_sampling_kwargs(
        SamplingParams(
            max_new_tokens=9,
            temperature=0.7,
            top_p=0.9,
            top_k=-1,
            stop=("\n\n", "END"),
            stop_token_ids=(5, 6),
            n=3,
            logprobs=True,
            ignore_eos=True,
        ),
        seed=11,
        detokenize=True,
    )
    assert kw == {
        "n": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "max_tokens": 9,
        "stop": ["\n\n", "END"],
        "stop_token_ids": [5, 6],
        "ignore_eos": True,
        "seed": 11,
        "logprobs": 0,
        "flat_logprobs": True,
        "detokenize": True,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
    }
    plain = vllm_sampling_kwargs(SamplingParams(temperature=0, top_k=40), seed=0, detokenize=False, n=1)
    assert plain["top_k"] == 40 and plain["logprobs"] is None and plain["stop"] is None and plain["n"] == 1
    assert plain["stop_token_ids"] is None and plain["detokenize"] is False
    assert split_greedy_n(SamplingParams(temperature=0, n=4)) == 4
    assert split_greedy_n(SamplingParams(temperature=0.5, n=4)) == 1
    assert split_greedy_n(SamplingParams(temperature=0)) == 1


def test_sampling_refusals() -> None:
    with pytest.raises(InvalidArgumentError, match=r"temperature=0.005.*0.01"):
        vllm_sampling_kwargs(SamplingParams(temperature=0.005), seed=0, detokenize=True)
    assert vllm_sampling_kwargs(SamplingParams(temperature=0.01), seed=0, detokenize=True)["temperature"] == 0.01
    with pytest.raises(InvalidArgumentError, match="skip_tokenizer_init"):
        vllm_sampling_kwargs(SamplingParams(stop=("x",)), seed=0, detokenize=False)


# ---- output mapping (objects shaped like vLLM 0.26's RequestOutput / CompletionOutput / FlatLogprobs) ------
@dataclasses.dataclass
class _Flat:
    start_indices: list[int]
    end_indices: list[int]
    token_ids: list[int]
    logprobs: list[float]

    def __len__(self) -> int:
        return len(self.start_indices)


def test_convert_outputs_order_reasons_and_logprobs() -> None:
    flat = _Flat([0, 1, 2], [1, 2, 3], [7, 8, 2], [-0.5, -1.25, -0.125])
    as_dicts = [{4: SimpleNamespace(logprob=-0.25)}, {9: SimpleNamespace(logprob=-2.0), 3: SimpleNamespace(logprob=-1)}]
    ro = SimpleNamespace(
        prompt_token_ids=[1, 2, 3],
        outputs=[
            _completion(1, [4, 9], "ab", "length", None, as_dicts),
            _completion(0, [7, 8, 2], "xy", "stop", "END", flat),
        ],
    )
    result = convert_request_output([ro], SamplingParams(n=2, logprobs=True, stop=("END",)), detokenize=True)
    assert result.prompt_token_ids == [1, 2, 3]
    first, second = result.outputs
    assert (first.token_ids, first.text, first.finish_reason, first.stop_reason) == ([7, 8, 2], "xy", "stop", "END")
    assert first.logprobs == [-0.5, -1.25, -0.125]
    assert (second.token_ids, second.finish_reason, second.stop_reason) == ([4, 9], "length", None)
    assert second.logprobs == [-0.25, -2.0]


def test_convert_stop_token_and_extra_eos() -> None:
    params = SamplingParams(stop_token_ids=(42,))
    ro = SimpleNamespace(prompt_token_ids=[5], outputs=[_completion(0, [3, 42], "t", "stop", 42)])
    out = convert_request_output([ro], params, detokenize=False).outputs[0]
    assert out.stop_reason == 42 and out.text is None and out.logprobs is None and out.token_ids == [3, 42]
    # vLLM reports an EOS id from generation_config.json as a stop token; the contract calls it EOS (None).
    ro = SimpleNamespace(prompt_token_ids=[5], outputs=[_completion(0, [3, 151643], "t", "stop", 151643)])
    assert convert_request_output([ro], params, detokenize=True).outputs[0].stop_reason is None


def test_convert_greedy_n_copies() -> None:
    ros = [SimpleNamespace(prompt_token_ids=[1], outputs=[_completion(0, [2], "a", "length")]) for _ in range(3)]
    result = convert_request_output(ros, SamplingParams(temperature=0, n=3), detokenize=True)
    assert [o.token_ids for o in result.outputs] == [[2], [2], [2]]


def test_convert_refuses_what_it_cannot_map() -> None:
    abort = SimpleNamespace(prompt_token_ids=[1], outputs=[_completion(0, [2], "a", "abort")])
    with pytest.raises(EngineStateError, match="abort"):
        convert_request_output([abort], SamplingParams(), detokenize=True)
    short = SimpleNamespace(prompt_token_ids=[1], outputs=[_completion(0, [2, 3], "a", "length", None, [{2: None}])])
    with pytest.raises(EngineStateError, match="1 logprob positions for 2 tokens"):
        convert_request_output([short], SamplingParams(logprobs=True), detokenize=True)
    with pytest.raises(EngineStateError, match="n=2"):
        convert_request_output([abort], SamplingParams(n=2), detokenize=True)
    with pytest.raises(EngineStateError, match="sampled token 5"):
        sampled_logprobs([5], _Flat([0], [1], [6], [-1.0]))


def test_logprobs_with_more_than_the_sampled_token_per_position_take_the_sampled_ones() -> None:
    # logprobs=k > 0 shape: the top tokens and the sampled one at each position.
    flat = _Flat([0, 2], [2, 3], [9, 7, 8], [-3.0, -0.5, -1.25])
    assert sampled_logprobs([7, 8], flat) == [-0.5, -1.25]
    # As many entries as tokens, but position 0 empty and position 1 holding two: not the one-per-position case.
    with pytest.raises(EngineStateError, match="position 0 do not include the sampled token 7"):
        sampled_logprobs([7, 8], _Flat([0, 0], [0, 2], [7, 8], [-0.5, -1.25]))


def test_int_list_makes_plain_ints_of_any_integer_tokens() -> None:
    np = pytest.importorskip("numpy")
    ids = [3, 4]
    out = int_list(ids)
    assert out == [3, 4] and out is not ids
    mixed = int_list([np.int64(5), True, 6])
    assert mixed == [5, 1, 6] and [type(t) for t in mixed] == [int, int, int]
    assert int_list(None) == [] and int_list(()) == []


# ---- streamed outputs (RequestOutputKind.DELTA) ------------------------------------------------------------
def test_completion_delta_reads_only_the_new_tokens_logprobs() -> None:
    params = SamplingParams(logprobs=True, stop=("END",))
    delta = completion_delta(
        _completion(0, [7, 8], "xy", None, None, _Flat([0, 1], [1, 2], [7, 8], [-0.5, -1.5])), params, detokenize=True
    )
    assert (delta.token_ids, delta.logprobs, delta.text, delta.finish_reason) == ([7, 8], [-0.5, -1.5], "xy", None)
    # A last output with no new token: vLLM's slice logprobs[-0:] is every position; none is taken.
    every = _Flat([0, 1, 2], [1, 2, 3], [7, 8, 9], [-0.5, -1.5, -0.1])
    last = completion_delta(_completion(0, [], "", "stop", "END", every), params, detokenize=True)
    assert (last.token_ids, last.logprobs, last.finish_reason, last.stop_reason) == ([], [], "stop", "END")
    plain = completion_delta(_completion(0, [3], "t", "length"), SamplingParams(), detokenize=False)
    assert (plain.logprobs, plain.text, plain.finish_reason, plain.stop_reason) == (None, "", "length", None)


def test_completion_delta_finish_and_stop_reasons() -> None:
    params = SamplingParams(stop_token_ids=(42,))
    assert completion_delta(_completion(0, [42], "", "stop", 42), params, detokenize=True).stop_reason == 42
    assert completion_delta(_completion(0, [2], "", "stop", 151643), params, detokenize=True).stop_reason is None
    assert completion_delta(_completion(0, [2], "", "abort"), params, detokenize=True).finish_reason == "abort"
    assert contract_stop_reason(151643, params) is None and contract_stop_reason("END", params) == "END"
    with pytest.raises(EngineStateError, match="finish_reason='error'"):
        completion_delta(_completion(0, [], "", "error"), params, detokenize=True)
