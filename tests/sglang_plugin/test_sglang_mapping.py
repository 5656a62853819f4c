"""The sglang plugin's mapping of the protocol to SGLang and back (no SGLang needed): sampling parameters,
outputs, streamed chunks, finish reasons, and the logit filter that makes SGLang's logprobs the processed ones.
"""

from __future__ import annotations

from typing import Any

import pytest

from genengine.errors import InvalidArgumentError
from genengine.protocol import SamplingParams
from genengine.requests import normalize_requests
from genengine_sglang.errors import SGLangEngineError
from genengine_sglang.mapping import (
    SEEDED_TOP_K,
    build_entries,
    finish_from_sglang,
    output_from_sglang,
    results_from_sglang,
    sampling_to_sglang,
    stream_delta,
)


# ---- sampling parameters and outputs ----------------------------------------------------------------------------
def test_sampling_mapping() -> None:
    greedy, filt = sampling_to_sglang(SamplingParams(temperature=0.0, max_new_tokens=5), deterministic=False)
    assert greedy == {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": False, "n": 1} and not filt
    plain, filt = sampling_to_sglang(
        SamplingParams(temperature=0.7, stop=("a", "bc"), stop_token_ids=(3,)), deterministic=False
    )
    assert plain["stop"] == ["a", "bc"] and plain["stop_token_ids"] == [3] and not filt
    assert "top_k" not in plain and "top_p" not in plain and "custom_params" not in plain
    top, filt = sampling_to_sglang(SamplingParams(temperature=1.3, top_k=20, top_p=0.9), deterministic=False)
    assert filt and top["custom_params"] == {"genengine_filter": {"t": 1.3, "k": 20, "p": 0.9}}
    assert "top_k" not in top and "top_p" not in top  # SGLang's own filter stays off: ours replaces it
    off, filt = sampling_to_sglang(SamplingParams(temperature=1.0, top_k=-1, top_p=1.0), deterministic=False)
    assert not filt and "custom_params" not in off
    _, filt = sampling_to_sglang(SamplingParams(temperature=0.0, top_k=5), deterministic=False)
    assert not filt  # greedy ignores top-k/top-p
    seeded = SamplingParams(temperature=1.0, seed=11)
    assert "sampling_seed" not in sampling_to_sglang(seeded, deterministic=False)[0]
    assert sampling_to_sglang(seeded, deterministic=True, sample=2)[0]["sampling_seed"] == 13


def test_seeded_rows_take_sglangs_sorted_path_in_every_batch() -> None:
    """SGLang picks a seeded row's token on the top-k/top-p path whenever any row of the batch needs it (a greedy
    row is top_k=1), and the same seed gives another token there: every seeded sampled row asks for that path
    with a top-k that masks nothing, so its samples do not depend on its batch (seen on the H200)."""
    seeded, _ = sampling_to_sglang(SamplingParams(temperature=1.0, seed=11), deterministic=True)
    assert seeded["top_k"] == SEEDED_TOP_K
    assert 10**7 < SEEDED_TOP_K < 1 << 30  # above any vocabulary, below SGLang's TOP_K_ALL marker
    filtered, filt = sampling_to_sglang(SamplingParams(temperature=1.0, top_p=0.9, seed=11), deterministic=True)
    assert filt and filtered["top_k"] == SEEDED_TOP_K  # our filter still applies top-p
    for params, deterministic in ((SamplingParams(temperature=0.0, seed=11), True), (SamplingParams(seed=11), False)):
        assert "top_k" not in sampling_to_sglang(params, deterministic=deterministic)[0]


def test_entries_expand_n_and_check_tokenizer_needs() -> None:
    requests = normalize_requests(["a", "b"], [{"n": 3, "temperature": 1.0}, {"max_new_tokens": 2}])
    entries = build_entries(requests, deterministic=False, has_tokenizer=True)
    assert [(e.request, e.sample) for e in entries] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    with pytest.raises(InvalidArgumentError, match="skip_tokenizer_init"):
        build_entries(requests, deterministic=False, has_tokenizer=False)
    ids = normalize_requests(None, {"stop": ["x"]}, prompt_token_ids=[[1, 2]])
    with pytest.raises(InvalidArgumentError, match="stop_token_ids"):
        build_entries(ids, deterministic=False, has_tokenizer=False)


def test_unseeded_sampled_requests_get_a_drawn_seed_each_in_deterministic_mode() -> None:
    """SGLang's deterministic mode gives every unseeded row seed 42: a GRPO group (one prompt repeated, one
    unseeded params) would sample one completion 4 times (seen on the H200). Each request draws its own."""
    draws = iter([1000, 2000, 3000, 4000, 5000])
    group = normalize_requests(["q"] * 4, {"temperature": 1.0, "max_new_tokens": 4})
    entries = build_entries(group, deterministic=True, has_tokenizer=True, draw_seed=lambda: next(draws))
    assert [e.params["sampling_seed"] for e in entries] == [1000, 2000, 3000, 4000]
    assert [e.drawn_seed for e in entries] == [1000, 2000, 3000, 4000]
    assert all("top_k" not in e.params for e in entries)  # SGLang's usual path: only a caller's seed moves it
    n3 = build_entries(
        normalize_requests(["q"], {"temperature": 1.0, "n": 3}),
        deterministic=True,
        has_tokenizer=True,
        draw_seed=lambda: next(draws),
    )
    assert [e.params["sampling_seed"] for e in n3] == [5000, 5001, 5002]  # sample j: seed + j, as when seeded
    # Nothing drawn for greedy or seeded requests, nor outside deterministic mode (SGLang drops seeds there).
    mixed = normalize_requests(["a", "b"], [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}])
    kept = build_entries(mixed, deterministic=True, has_tokenizer=True, draw_seed=lambda: next(draws))
    assert "sampling_seed" not in kept[0].params and kept[1].params["sampling_seed"] == 7
    assert [e.drawn_seed for e in kept] == [None, None]
    plain = build_entries(group, deterministic=False, has_tokenizer=True, draw_seed=lambda: next(draws))
    assert all("sampling_seed" not in e.params and e.drawn_seed is None for e in plain)
    # A continuation (the async layer's rest of a paused sample) keeps the drawn seed.
    rest, _ = sampling_to_sglang(SamplingParams(temperature=1.0), deterministic=True, sample=1, drawn_seed=1000)
    assert rest["sampling_seed"] == 1001


def _out(ids: list[int], reason: dict[str, Any], logprobs: bool = True, text: str | None = "t") -> dict[str, Any]:
    meta: dict[str, Any] = {"finish_reason": reason}
    if logprobs:
        meta["output_token_logprobs"] = [(-0.25 * (i + 1), t, None) for i, t in enumerate(ids)]
    return {"text": text, "output_ids": ids, "meta_info": meta, "prompt_token_ids": [9, 9]}


def test_outputs_mapping() -> None:
    p = SamplingParams(logprobs=True, stop_token_ids=(7,))
    out = output_from_sglang(_out([1, 2], {"type": "length", "length": 2}), p)
    assert out.finish_reason == "length" and out.stop_reason is None and out.logprobs == [-0.25, -0.5]
    assert output_from_sglang(_out([1, 7], {"type": "stop", "matched": 7}), p).stop_reason == 7
    eos = output_from_sglang(_out([1, 0], {"type": "stop", "matched": 0}), p)
    assert eos.finish_reason == "stop" and eos.stop_reason is None and eos.token_ids == [1, 0]
    assert output_from_sglang(_out([1, 2], {"type": "stop", "matched": "ab"}), p).stop_reason == "ab"
    assert output_from_sglang(_out([1], {"type": "length"}, logprobs=False), SamplingParams()).logprobs is None
    with pytest.raises(SGLangEngineError, match="too long"):
        output_from_sglang(_out([], {"type": "abort", "message": "prompt too long"}), p)
    broken = _out([1, 2], {"type": "length"})
    broken["meta_info"]["output_token_logprobs"] = broken["meta_info"]["output_token_logprobs"][:1]
    with pytest.raises(SGLangEngineError, match="1 logprobs for 2 tokens"):
        output_from_sglang(broken, p)
    with pytest.raises(SGLangEngineError):
        output_from_sglang({"output_ids": [1], "meta_info": {}}, p)


def test_stop_ids_still_apply_with_ignore_eos() -> None:
    """SGLang's ignore_eos also disables stop_token_ids; the contract keeps them, so we cut the output."""
    params = {"temperature": 0.0, "ignore_eos": True, "stop_token_ids": [7], "logprobs": True}
    requests = normalize_requests(None, params, prompt_token_ids=[[5]])
    entries = build_entries(requests, deterministic=False, has_tokenizer=True)
    assert "stop_token_ids" not in entries[0].params and entries[0].params["ignore_eos"] is True
    outs = [_out([3, 0, 7, 4, 7], {"type": "length", "length": 5}, text="full")]
    (result,) = results_from_sglang(requests, entries, outs, decode=lambda ids: "-".join(map(str, ids)))
    (out,) = result.outputs
    assert out.token_ids == [3, 0, 7] and out.finish_reason == "stop" and out.stop_reason == 7
    assert out.text == "3-0" and out.logprobs == [-0.25, -0.5, -0.75]
    nothing = [_out([3, 4], {"type": "length", "length": 2})]
    assert results_from_sglang(requests, entries, nothing)[0].outputs[0].token_ids == [3, 4]


def test_results_group_samples_in_prompt_order() -> None:
    requests = normalize_requests(None, [{"n": 2, "temperature": 1.0}, {}], prompt_token_ids=[[5], [6, 6]])
    entries = build_entries(requests, deterministic=False, has_tokenizer=True)
    outs = [
        _out([1], {"type": "length"}, False),
        _out([2], {"type": "length"}, False),
        _out([3], {"type": "length"}, False),
    ]
    outs[2]["prompt_token_ids"] = [6, 6]
    results = results_from_sglang(requests, entries, outs)
    assert [[o.token_ids for o in r.outputs] for r in results] == [[[1], [2]], [[3]]]
    assert results[1].prompt_token_ids == [6, 6]
    with pytest.raises(SGLangEngineError, match="2 outputs for 3"):
        results_from_sglang(requests, entries, outs[:2])


# ---- async: streamed chunks and SGLang's event loop ----------------------------------------------------------------
def _chunk(ids: list[int], total: int | None, lps: list[float] | None = None, reason: Any = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"finish_reason": reason}
    if total is not None:
        meta["completion_tokens"] = total
    if lps is not None:
        meta["output_token_logprobs"] = [(lp, tok, None) for lp, tok in zip(lps, ids, strict=False)]
    return {"output_ids": ids, "meta_info": meta}


def test_stream_delta_reads_every_chunk_shape() -> None:
    # Cumulative (SGLang's default): read by position up to the chunk's own count, even when the referenced list
    # has grown meanwhile.
    grown = _chunk([1, 2, 3, 4, 5], 3, [-0.1, -0.2, -0.3, -0.4, -0.5])
    assert stream_delta(grown, 1, logprobs=True) == ([2, 3], [-0.2, -0.3], 3)
    # Incremental (incremental_streaming_output): a delta, or several coalesced ones.
    assert stream_delta(_chunk([4, 5], 5, [-0.4, -0.5]), 3, logprobs=True) == ([4, 5], [-0.4, -0.5], 5)
    assert stream_delta(_chunk([4, 5], 5), 3, logprobs=False) == ([4, 5], None, 5)
    # The echo of an abort in the waiting queue: only the last token, nothing new.
    assert stream_delta(_chunk([5], 5, [-0.5]), 5, logprobs=True) == ([], [], 5)
    assert stream_delta(_chunk([5], 5), 5, logprobs=False) == ([], None, 5)
    # ... with tokens never sent: from the full logprob list when there is one, else none (nobody saw them).
    echo = {"output_ids": [9], "meta_info": {"completion_tokens": 3, "output_token_logprobs": [(-1.0, 7, None)] * 3}}
    echo["meta_info"]["output_token_logprobs"][2] = (-2.0, 9, None)
    assert stream_delta(echo, 1, logprobs=True) == ([7, 9], [-1.0, -2.0], 3)
    assert stream_delta(_chunk([9], 3), 1, logprobs=False) == ([], None, 3)
    # No count (an older SGLang): the ids are taken as new.
    assert stream_delta({"output_ids": [1, 2]}, 0, logprobs=False) == ([1, 2], None, 2)


def test_stream_delta_checks_logprobs_against_tokens() -> None:
    bad = _chunk([1, 2], 2, [-0.1, -0.2])
    bad["meta_info"]["output_token_logprobs"][1] = (-0.2, 8, None)
    with pytest.raises(SGLangEngineError, match="token 8 where the output has 2"):
        stream_delta(bad, 0, logprobs=True)
    with pytest.raises(SGLangEngineError, match="0 logprobs for 2 tokens"):
        stream_delta(_chunk([1, 2], 2), 0, logprobs=True)


def test_finish_reasons() -> None:
    p = SamplingParams(stop_token_ids=(7,))
    assert finish_from_sglang({"type": "length", "length": 3}, p) == ("length", None)
    assert finish_from_sglang({"type": "stop", "matched": 7}, p) == ("stop", 7)
    assert finish_from_sglang({"type": "stop", "matched": 0}, p) == ("stop", None)  # EOS
    assert finish_from_sglang({"type": "stop", "matched": "###"}, p) == ("stop", "###")
    with pytest.raises(SGLangEngineError, match="too long"):
        finish_from_sglang({"type": "abort", "message": "too long"}, p)
    with pytest.raises(SGLangEngineError, match="unknown finish reason"):
        finish_from_sglang({"type": "odd"}, p)


# ---- the logit filter makes SGLang's logprobs the processed ones ------------------------------------------------
@pytest.mark.parametrize(
    ("temp", "top_k", "top_p"), [(1.0, 8, 1.0), (0.7, None, 0.8), (1.3, 20, 0.9), (1.0, 1, 1.0), (2.0, None, 1e-6)]
)
def test_filter_equals_transformers_warpers(temp: float, top_k: int | None, top_p: float) -> None:
    """log_softmax(masked / T) is what SGLang computes after our filter: it must equal transformers'
    temperature → top-k → top-p processed distribution, with the same tokens removed."""
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from genengine_sglang._filter import mask_top_k_top_p

    torch.manual_seed(0)
    vocab = 300
    logits = torch.randn(6, vocab) * 3
    masked = mask_top_k_top_p(
        logits.clone(),
        torch.full((6,), temp),
        torch.full((6,), top_k or vocab),
        torch.full((6,), top_p),
    )
    got = torch.log_softmax(masked / temp, dim=-1)
    dummy = torch.zeros((6, 1), dtype=torch.long)
    ref = TemperatureLogitsWarper(temp)(dummy, logits.clone())
    if top_k is not None:
        ref = TopKLogitsWarper(top_k)(dummy, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(dummy, ref)
    want = torch.log_softmax(ref, dim=-1)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    kept = ~torch.isinf(want)
    assert torch.allclose(got[kept], want[kept], atol=1e-5)
    assert torch.equal(masked[kept], logits[kept])  # kept logits untouched: SGLang applies the temperature
