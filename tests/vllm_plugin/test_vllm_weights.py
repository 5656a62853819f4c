"""The vllm plugin's weight load and cache flush around vLLM's model (issue 41 P2/P3b), with vLLM faked at
``apply_model``.
"""

from __future__ import annotations

import random
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from support.vllm_fakes import HAS_VLLM

from genengine_vllm.engine import VLLMEngine


# ---- the weight load and cache flush around vLLM's model (issue 41 P2/P3b): vLLM faked at apply_model ------------
class _LoadRecorder:
    """What ``VLLMEngine`` calls on ``vllm.LLM`` for a load, a sleep, a wake and a flush, recorded; the
    model's ``load_weights`` takes the names it is given (vLLM's copies into parameters are not ours)."""

    def __init__(self) -> None:
        self.loads: list[list[str]] = []
        self.calls: list[str] = []
        model = SimpleNamespace(load_weights=lambda items: self.loads.append([name for name, _ in items]))
        self.apply_model = lambda fn: [fn(model)]
        self.llm_engine = SimpleNamespace(
            reset_encoder_cache=lambda: self.calls.append("reset_encoder_cache"),
            has_unfinished_requests=lambda: False,
        )

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(f"wake_up({tags})")

    def collective_rpc(self, fn: Any) -> None:
        self.calls.append(fn.__name__)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("generate")
        raise RuntimeError("the fake runs no model")


_WEIGHTS = [(f"w{i}", (4, 4)) for i in range(6)]


@pytest.fixture
def bare_engine(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A ``VLLMEngine`` around ``_LoadRecorder`` (nothing started); its "GPU" is the CPU, and torch.cuda's
    synchronize and empty_cache are no-ops."""
    import torch

    from genengine.engine.aio import AsyncEngineBase, DriverLock
    from genengine.weights import WeightInfo

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    engine = VLLMEngine.__new__(VLLMEngine)
    AsyncEngineBase.__init__(engine, sleep_enabled=True, bucket_bytes=64)  # 64 bytes: one 4x4 fp32 per bucket
    engine.settings = SimpleNamespace(
        weight_sync_mode="bucketed",
        tp_size=1,
        skip_tokenizer_init=True,
        model="fake",
        model_config={"vocab_size": 64},
        llm_options={},  # no enable_lora: the names load as given
    )
    if not HAS_VLLM:  # generate builds vllm.SamplingParams before it reaches the (fake) LLM.generate
        monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw)))
    engine._group, engine._driver, engine._cuda, engine._lock = None, None, None, DriverLock()
    engine._llm, engine._multimodal, engine._max_model_len = _LoadRecorder(), False, 64
    engine._spec = {name: WeightInfo(shape, "float32") for name, shape in _WEIGHTS}
    engine._seed_rng = random.Random(0)
    engine._load_device = torch.device("cpu")
    return engine


def _weights() -> list[tuple[str, Any]]:
    import torch

    return [(name, torch.ones(shape)) for name, shape in _WEIGHTS]


def test_a_list_of_dense_tensors_on_the_engine_device_is_one_vllm_call(bare_engine: Any) -> None:
    """vLLM's loader reads each tensor in place: a source that holds its tensors goes in one ``apply_model``
    call whatever ``bucket_bytes`` says; a generator's tensors (maybe fresh copies) stay bucketed."""
    import torch

    llm = bare_engine._llm
    report = bare_engine.load_weights(_weights())
    assert llm.loads == [[name for name, _ in _WEIGHTS]] and report.num_buckets == 1
    llm.loads.clear()
    bare_engine.load_weights(dict(_weights()))
    assert len(llm.loads) == 1
    llm.loads.clear()
    bare_engine.load_weights(iter(_weights()))
    assert len(llm.loads) == len(_WEIGHTS)  # 64-byte buckets: one tensor each
    llm.loads.clear()
    views = [(name, torch.ones(4, 8)[:, :4]) for name, _ in _WEIGHTS]  # made contiguous: copies, counted
    bare_engine.load_weights(views)
    assert len(llm.loads) == len(_WEIGHTS)
    llm.loads.clear()
    bare_engine._load_device = torch.device("meta")  # tensors elsewhere than the engine's GPU: counted
    bare_engine.load_weights(_weights())
    assert len(llm.loads) == len(_WEIGHTS)


def test_the_flush_a_wake_owes_is_skipped_after_vllms_own_sleep_reset(bare_engine: Any) -> None:
    """sleep(2) → wake(weights) → load → wake(kv_cache): vLLM's sleep emptied its caches and nothing ran
    since, so the wake runs no reset (at 7B a walk over ~76k KV blocks); once a generate ran, a load flushes."""
    llm = bare_engine._llm
    bare_engine.sleep(2)
    bare_engine.wake(["weights"])
    bare_engine.load_weights(_weights())
    bare_engine.wake(["kv_cache"])
    assert "reset_prefix_cache" not in llm.calls, llm.calls
    with pytest.raises(RuntimeError, match="runs no model"):
        bare_engine.generate(prompt_token_ids=[[1, 2]], sampling_params={"max_new_tokens": 1})
    bare_engine.load_weights(_weights())
    assert llm.calls.count("reset_prefix_cache") == 1, llm.calls


def test_flush_skips_what_vllm_does_not_cache(bare_engine: Any) -> None:
    """Prefix caching off: no block is ever cached, so no walk; a text model has no encoder cache."""
    llm = bare_engine._llm
    bare_engine.flush_cache()
    assert llm.calls == ["reset_prefix_cache"]
    bare_engine._prefix_caching = False
    bare_engine.flush_cache()
    assert llm.calls == ["reset_prefix_cache"]
    bare_engine._multimodal = True
    bare_engine.flush_cache()
    assert llm.calls == ["reset_prefix_cache", "reset_encoder_cache"]


def test_a_load_under_a_clearing_pause_runs_no_second_reset(bare_engine: Any) -> None:
    """pause(keep, clear_cache=True) already ran vLLM's reset (``EngineCore._reset_caches``) and the driver has
    stepped nothing since: the load's flush would walk every KV block again. Under pause(keep) without it the
    held requests keep their blocks and the driver evicts the cached ones; with no pause, vLLM's reset."""
    llm = bare_engine._llm
    evictions: list[int] = []
    bare_engine._driver = SimpleNamespace(
        held=True, kept_kv=False, sync=False, settle=lambda: None, evict_prefix_cache=lambda: evictions.append(1)
    )
    bare_engine.load_weights(_weights())
    assert "reset_prefix_cache" not in llm.calls and not evictions, llm.calls
    bare_engine._driver.kept_kv = True
    bare_engine.load_weights(_weights())
    assert evictions == [1] and "reset_prefix_cache" not in llm.calls, llm.calls
    bare_engine._driver.held = bare_engine._driver.kept_kv = False
    bare_engine.load_weights(_weights())
    assert llm.calls.count("reset_prefix_cache") == 1 and evictions == [1], llm.calls
