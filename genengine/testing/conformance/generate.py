"""The conformance tests of ``generate``: the protocol object, outputs, sampling, stops, bad input."""

from __future__ import annotations

import math
from typing import Any

import pytest

from genengine.errors import InvalidArgumentError
from genengine.protocol import TAG_KV_CACHE, TAG_WEIGHTS, GenerationEngine, GenerationResult, SamplingParams
from genengine.testing.conformance.base import (
    GREEDY,
    PROMPTS,
    ConformanceBase,
    expect_raises,
    reference_logprobs,
    token_ids_of,
)

__all__ = ["GenerateTests"]

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


class GenerateTests(ConformanceBase):
    """``generate`` as the contract states it, against transformers on the same model."""

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
        assert token_ids_of(results) == token_ids_of(baseline)

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
            assert token_ids_of(results) == token_ids_of(baseline), extra
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

    def test_repeated_prompts_sample_independently(self, engine: GenerationEngine) -> None:
        """GRPO's group: one prompt repeated, one unseeded ``SamplingParams`` shared by all. Each copy draws its
        own seed; a backend that built one engine request and copied it per prompt must not copy the seed."""
        params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
        samples = token_ids_of(engine.generate([PROMPTS[0]] * 4, params))
        assert len({tuple(s[0]) for s in samples}) > 1, f"4 copies of one prompt sampled the same tokens: {samples}"

    def test_seeded_sampling_is_reproducible(self, engine: GenerationEngine) -> None:
        if not self.supports_seed:
            pytest.skip("the engine does not promise reproducible seeded sampling (supports_seed = False)")
        params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10, seed=1234, n=2)
        first = token_ids_of(engine.generate(PROMPTS[1:2], params))
        assert token_ids_of(engine.generate(PROMPTS[1:2], params)) == first
        other = SamplingParams(temperature=1.0, max_new_tokens=10, seed=99)
        different = token_ids_of(engine.generate(PROMPTS[1:2], SamplingParams(**{**_fields(params), "seed": 4321})))
        assert different != first, "two seeds gave the same samples"
        if self.seeded_batch_invariant:
            batch = engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [other, params, GREEDY])
            assert token_ids_of(batch)[1] == first[0], "a seeded request's samples changed with its batch"

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
        expect_raises(InvalidArgumentError, lambda: engine.generate(*args, **kwargs))
        assert not engine.is_sleeping and engine.state.weights_loaded
        out = engine.generate(PROMPTS[:1], {"temperature": 0.0, "max_new_tokens": 2})
        assert out[0].outputs[0].token_ids == baseline[0].outputs[0].token_ids[:2]

    def test_images_rejected_when_unsupported(self, engine: GenerationEngine) -> None:
        if self.supports_images:
            pytest.skip("the engine takes images")
        expect_raises(InvalidArgumentError, lambda: engine.generate(["hi"], image_data=[b"not an image"]))


def _fields(params: SamplingParams) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(params)


def _vocab_size(weights: dict[str, Any]) -> int:
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        if name in weights:
            return int(weights[name].shape[0])
    raise KeyError("no lm_head.weight or model.embed_tokens.weight in the checkpoint")
