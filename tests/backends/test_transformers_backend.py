"""What the embedded backend adds beyond the contract: options, batching, sampling, prefix cache, memory."""

from __future__ import annotations

import math
import os
import weakref
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from genengine import EngineConfig, SamplingParams, available_backends, create_engine
from genengine.backends.transformers.engine import TransformersEngine, hf_generate_tokens_per_second
from genengine.errors import ConfigError, InvalidArgumentError
from genengine.models.tiny_model import build_tiny_model, tiny_model_dir
from genengine.testing.conformance import PROMPTS, EngineConformance, load_checkpoint, reference_logprobs


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(tiny_model_dir())


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Iterator[TransformersEngine]:
    with TransformersEngine(model_dir, dtype="float32") as eng:
        yield eng


@pytest.fixture(scope="module")
def hf_model(model_dir: str) -> Any:
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _tokens(results: Any) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in results]


# ---- construction ------------------------------------------------------------------------------------------
def test_registered_and_built_through_the_registry(model_dir: str) -> None:
    info = {b.name: b for b in available_backends()}["transformers"]
    assert info.loadable
    with create_engine(backend="transformers", model=model_dir, dtype="auto") as eng:
        assert isinstance(eng, TransformersEngine)
        assert str(eng.dtype) == "torch.bfloat16", "dtype 'auto' is the checkpoint's"
    with create_engine({"backend": "transformers", "model": model_dir, "dtype": "float32", "options": {}}) as eng:
        assert str(eng.dtype) == "torch.float32"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"options": {"devcie": "cpu"}}, "did you mean 'device'"),
        ({"options": {"device": "gpu"}}, "device='gpu'"),
        ({"options": {"device": "cuda:7"}}, "cuda"),
        ({"options": {"max_batch_size": 0}}, "max_batch_size=0"),
        ({"options": {"bucket_bytes": -1}}, "bucket_bytes"),
        ({"options": {"attn_implementation": "magic"}}, "attn_implementation='magic'"),
        ({"options": {"prefix_cache_bytes": -5}}, "prefix_cache_bytes"),
        ({"options": {"keep_prefix_cache_on_sleep": "yes"}}, "keep_prefix_cache_on_sleep='yes'"),
        ({"tp_size": 2}, "tp_size=2"),
        ({"model": "/nonexistent/model"}, "not a model directory"),
    ],
)
def test_bad_options_fail_before_loading(model_dir: str, changes: dict[str, Any], message: str) -> None:
    config = EngineConfig(backend="transformers", model=model_dir).replace(**changes)
    with pytest.raises((ConfigError, InvalidArgumentError)) as info:
        TransformersEngine.from_config(config)
    assert message in str(info.value)


def test_weight_spec_comes_from_the_state_dict(tmp_path: Path) -> None:
    tied = build_tiny_model(tmp_path / "tied", tie_word_embeddings=True, hidden_size=64, num_heads=2, num_kv_heads=1)
    with TransformersEngine(tied, dtype="float32") as eng:
        spec = eng._weight_spec()
        assert set(spec) == set(eng.model.state_dict())
        assert spec["lm_head.weight"].required is False, "a tied lm_head is an alias"
        assert spec["model.embed_tokens.weight"].required is True
        assert spec["model.norm.weight"].shape == (64,) and spec["model.norm.weight"].dtype == "float32"
        # Loading the checkpoint (which has no lm_head) after a level-2 sleep is a complete load.
        eng.sleep(2)
        eng.wake()
        eng.load_weights(load_checkpoint(tied).items())
        assert eng.state.weights_loaded and eng.generate(["hi"], {"max_new_tokens": 2})[0].outputs


def test_max_new_tokens_beyond_the_context_is_rejected(engine: TransformersEngine) -> None:
    with pytest.raises(InvalidArgumentError, match="context of 1024"):
        engine.generate(["hi"], {"max_new_tokens": 1024})
    assert engine.generate(["hi"], {"max_new_tokens": 2, "temperature": 0})[0].outputs


# ---- batching and sampling ---------------------------------------------------------------------------------
def test_small_batches_give_the_same_outputs(model_dir: str, engine: TransformersEngine) -> None:
    prompts = [*PROMPTS, "a b c d e f g h i j k l m n o p"]
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=9),
        SamplingParams(temperature=0.9, top_k=30, max_new_tokens=9, seed=1, n=3),
        SamplingParams(temperature=1.0, top_p=0.7, max_new_tokens=5, seed=2, n=2),
        SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True),
        SamplingParams(temperature=1.2, max_new_tokens=9, seed=3),
    ]
    big = engine.generate(prompts, params)
    with TransformersEngine(model_dir, dtype="float32", max_batch_size=2, prefix_cache_bytes=0) as small:
        assert _tokens(small.generate(prompts, params)) == _tokens(big)
    assert [len(r.outputs) for r in big] == [1, 3, 2, 1, 1]


def test_eager_attention_gives_the_same_outputs(model_dir: str, engine: TransformersEngine) -> None:
    """The decode loop hands the kernel a ready 4-D mask in its own format: check the eager one too."""
    params = {"temperature": 0, "max_new_tokens": 10, "logprobs": True, "ignore_eos": True}
    want = engine.generate(PROMPTS, params)
    with TransformersEngine(model_dir, dtype="float32", attn_implementation="eager") as eager:
        got = eager.generate(PROMPTS, params)
    assert _tokens(got) == _tokens(want)
    for a, b in zip(got, want, strict=True):
        diffs = [abs(x - y) for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True)]
        assert max(diffs) < 1e-4


def test_sleep_disabled_is_a_state_error(model_dir: str) -> None:
    from genengine.errors import EngineStateError

    with create_engine(backend="transformers", model=model_dir, dtype="float32", enable_sleep=False) as eng:
        with pytest.raises(EngineStateError, match="enable_sleep"):
            eng.sleep(1)
        assert eng.generate(["hi"], {"max_new_tokens": 2})[0].outputs


def test_sampling_follows_the_processed_distribution(engine: TransformersEngine, hf_model: Any) -> None:
    """400 one-token samples: frequencies match transformers' processed probabilities (total variation)."""
    import torch

    params = SamplingParams(temperature=0.8, top_k=6, max_new_tokens=1, n=400, seed=7, logprobs=True)
    (result,) = engine.generate([PROMPTS[1]], params)
    counts = Counter(o.token_ids[0] for o in result.outputs)
    with torch.no_grad():
        logits = hf_model(torch.tensor([result.prompt_token_ids])).logits[0, -1].float() / 0.8
    top = torch.topk(logits, 6)
    probs = dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist(), strict=True))
    assert set(counts) <= set(probs), "a token outside the top 6 was sampled"
    tv = 0.5 * sum(abs(counts.get(t, 0) / 400 - p) for t, p in probs.items())
    assert tv < 0.1, f"total variation {tv:.3f} between samples and the processed distribution"
    for out in result.outputs:
        assert out.logprobs is not None
        assert abs(math.exp(out.logprobs[0]) - probs[out.token_ids[0]]) < 1e-4


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-31])
def test_tiny_temperatures_are_the_greedy_limit(engine: TransformersEngine, temperature: float) -> None:
    """float32 logits / T would overflow (T = 1e-300 even rounds to 0): the sampler uses the T → 0 limit."""
    greedy = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    tiny = engine.generate(
        PROMPTS, {"temperature": temperature, "max_new_tokens": 6, "ignore_eos": True, "logprobs": True, "seed": 1}
    )
    assert _tokens(tiny) == _tokens(greedy)
    assert all(lp == 0.0 for r in tiny for lp in r.outputs[0].logprobs or [math.nan])


def test_unseeded_sampling_is_reproducible_per_engine_seed(model_dir: str) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 6, "n": 2}
    runs = []
    for seed in (5, 5, 6):
        with TransformersEngine(model_dir, dtype="float32", seed=seed) as eng:
            runs.append((_tokens(eng.generate(PROMPTS, params)), _tokens(eng.generate(PROMPTS, params))))
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1], "two unseeded calls should sample differently"
    assert runs[0] != runs[2]


def test_stop_string_completed_across_tokens(engine: TransformersEngine) -> None:
    """A stop string that spans two tokens ends the output at the second; the text is cut before it."""
    tok = engine.tokenizer
    full = engine.generate([PROMPTS[2]], {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    tokens = full[0].outputs[0].token_ids
    for k in range(1, len(tokens) - 1):
        a = tok.decode(tokens[:k], skip_special_tokens=True)
        b = tok.decode(tokens[: k + 1], skip_special_tokens=True)
        if "\ufffd" in b or len(b) - len(a) < 1 or len(a) < 1 or not a[-1].strip():
            continue
        stop = a[-1] + b[len(a)]  # last char of token k-1's text + first char of token k's
        if stop in a:
            continue
        out = engine.generate([PROMPTS[2]], {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True, "stop": stop})
        o = out[0].outputs[0]
        assert o.token_ids == tokens[: k + 1] and o.stop_reason == stop and o.text == b[: b.index(stop)]
        return
    pytest.skip("no clean token boundary in this output")


# ---- prefix cache ------------------------------------------------------------------------------------------
def _prefilled_rows(eng: TransformersEngine) -> list[int]:
    """Prompts run through the model's prefill so far (a forward hook: seen on the real model, not our counter)."""
    rows: list[int] = []

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if "logits_to_keep" in kwargs:  # the prefill's forward; decode steps keep every position's logits
            rows.append(int(kwargs["input_ids"].shape[0]))

    eng.model.register_forward_pre_hook(hook, with_kwargs=True)
    return rows


def test_prefix_cache_hits_and_is_dropped(model_dir: str) -> None:
    """A repeated prompt skips its prefill (counted in ``prefix_cache_hits``) with the same outputs; after a flush,
    a sleep (unless ``keep_prefix_cache_on_sleep``, then after a level-2 one) or with no cache, it does not."""
    params = {"temperature": 0, "max_new_tokens": 4, "logprobs": True}
    n = len(PROMPTS)
    eng = TransformersEngine(model_dir, dtype="float32")
    with eng:
        rows = _prefilled_rows(eng)
        first = eng.generate(PROMPTS, params)
        assert (sum(rows), eng.prefix_cache_hits) == (n, 0)
        again = eng.generate(PROMPTS, params)
        assert (sum(rows), eng.prefix_cache_hits) == (n, n), "the repeat should be served from the cache"
        assert [r.outputs[0].logprobs for r in again] == [r.outputs[0].logprobs for r in first]
        eng.flush_cache()
        eng.generate(PROMPTS, params)
        assert (sum(rows), eng.prefix_cache_hits) == (2 * n, n), "flush_cache should empty the cache"
        eng.sleep(1)
        eng.wake()
        assert _tokens(eng.generate(PROMPTS, params)) == _tokens(first)
        assert (sum(rows), eng.prefix_cache_hits) == (3 * n, n), "sleep drops the KV cache"
    eng = TransformersEngine(model_dir, dtype="float32", keep_prefix_cache_on_sleep=True)
    with eng:
        rows = _prefilled_rows(eng)
        eng.generate(PROMPTS, params)
        eng.sleep(1)
        eng.wake()
        assert _tokens(eng.generate(PROMPTS, params)) == _tokens(first)
        assert (sum(rows), eng.prefix_cache_hits) == (n, n), "a level-1 sleep keeps the cache with this option"
        eng.sleep(2)
        eng.wake()
        eng.load_weights(load_checkpoint(model_dir).items())
        assert _tokens(eng.generate(PROMPTS, params)) == _tokens(first)
        assert (sum(rows), eng.prefix_cache_hits) == (2 * n, n), "a level-2 sleep drops it all the same"
    eng = TransformersEngine(model_dir, dtype="float32", prefix_cache_bytes=0)
    with eng:
        rows = _prefilled_rows(eng)
        eng.generate(PROMPTS, params)
        eng.generate(PROMPTS, params)
        assert (sum(rows), eng.prefix_cache_hits) == (2 * n, 0)


# ---- memory ------------------------------------------------------------------------------------------------
def _rss() -> int:
    """Resident bytes, file-backed included: float32 weights may be mapped straight from the safetensors file."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_level_2_sleep_gives_the_weights_memory_back(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m", num_params=30_000_000, dtype="float32")
    weights = load_checkpoint(path)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    with TransformersEngine(path, dtype="float32") as eng:
        before = eng.generate(PROMPTS[:2], {"temperature": 0, "max_new_tokens": 3})
        awake = _rss()
        eng.sleep(2)
        asleep = _rss()
        assert awake - asleep > 0.8 * nbytes, f"freed {(awake - asleep) / 2**20:.0f} MiB of {nbytes / 2**20:.0f} MiB"
        eng.wake(["weights"])
        eng.load_weights(weights.items())
        eng.wake(["kv_cache"])
        assert _tokens(eng.generate(PROMPTS[:2], {"temperature": 0, "max_new_tokens": 3})) == _tokens(before)


def test_shutdown_frees_the_model(model_dir: str) -> None:
    """A trainer may keep the engine object after shutdown: the model, its weights and cached KV must still go."""
    eng = TransformersEngine(model_dir, dtype="float32")
    eng.generate(PROMPTS, {"max_new_tokens": 3})
    alive = {
        "the model": weakref.ref(eng.model),
        "a weight": weakref.ref(next(eng.model.parameters())),
        "a cached prefix": weakref.ref(next(iter(eng._prefixes.values())).keys[0]),
    }
    assert all(ref() is not None for ref in alive.values())
    eng.shutdown()
    assert eng.state.closed and eng.model is None
    assert [name for name, ref in alive.items() if ref() is not None] == [], "still alive after shutdown"


# ---- raw runner --------------------------------------------------------------------------------------------
def test_hf_generate_tokens_per_second(model_dir: str) -> None:
    config = EngineConfig(backend="transformers", model=model_dir, dtype="float32")
    rate = hf_generate_tokens_per_second(config, [[1, 2, 3], [4, 5]], 8)
    assert rate > 0 and math.isfinite(rate)


def test_logprobs_of_bfloat16_engine_are_close(model_dir: str, hf_model: Any) -> None:
    """The checkpoint dtype on the CPU: not exact, but close to the float32 reference."""
    with TransformersEngine(model_dir, dtype="bfloat16") as eng:
        results = eng.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 8, "logprobs": True})
    diffs = []
    for r in results:
        ref = reference_logprobs(hf_model, r.prompt_token_ids, r.outputs[0].token_ids, SamplingParams(temperature=0))
        diffs += [abs(a - b) for a, b in zip(r.outputs[0].logprobs or [], ref, strict=True)]
    assert sum(diffs) / len(diffs) < 0.1


# ---- the GPU: the same contract on one CUDA device in bfloat16 -----------------------------------------------
def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
class TestTransformersConformanceCuda(EngineConformance):
    greedy_matches_hf = False
    compute_dtype = "bfloat16"
    logprob_tolerance = 0.05
    seeded_batch_invariant = False

    def make_engine(self, model_dir: str, **options: Any) -> Any:
        return create_engine(backend="transformers", model=model_dir, dtype="bfloat16", device="cuda", **options)


def test_shutdown_ends_every_stream_and_lets_go_of_the_requests(model_dir: str) -> None:
    """Running, held and queued streams all end "abort" at shutdown (none hangs), and the engine kept afterwards
    refers to no request: a refused request's error (its traceback reaches the engine) is not kept either."""
    import asyncio
    import gc
    import weakref

    from genengine.errors import EngineClosedError, InvalidArgumentError
    from genengine.protocol import SamplingParams

    long = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    eng = TransformersEngine.from_config(EngineConfig(backend="transformers", model=model_dir))

    async def main() -> tuple[list[str], list[int], Any]:
        running = eng.stream("a", long)
        await running.__anext__()
        with pytest.raises(InvalidArgumentError, match="max_new_tokens"):  # refused by the backend's own check
            eng.stream("d", SamplingParams(max_new_tokens=10**6))
        assert list(eng._async_state().live) == [running.request_id]
        await eng.pause_generation("keep")
        queued = eng.stream("b", long)
        refs = [weakref.ref(running._request), weakref.ref(queued._request)]
        eng.shutdown()
        results = [await s.collect() for s in (running, queued)]
        with pytest.raises(EngineClosedError):
            eng.stream("c", long)
        return [r.outputs[0].finish_reason for r in results], [len(r.outputs[0].token_ids) for r in results], refs

    reasons, lengths, refs = asyncio.run(main())
    assert reasons == ["abort", "abort"] and lengths[0] >= 1 and lengths[1] == 0
    assert eng.in_flight == 0 and eng.paused is None
    gc.collect()
    assert [r() for r in refs] == [None, None]  # the engine, still referenced here, holds neither request
