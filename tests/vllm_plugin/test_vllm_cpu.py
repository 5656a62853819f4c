"""The vllm backend on a CPU machine without vLLM: validation, argument mapping, weight spec, distributed guards.

Everything here runs without vLLM installed. Where a process group is needed it is a real one: two
spawned processes over gloo. The parts that need a GPU and vLLM are in tests/gpu/test_vllm_gpu.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import math
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from support.ports import free_port
from support.start import worker_context

from genengine.config import EngineConfig
from genengine.errors import (
    BackendImportError,
    ConfigError,
    DistributedSetupError,
    EngineStateError,
    InconsistentInputsError,
    InvalidArgumentError,
)
from genengine.models.tiny_model import tiny_model_dir
from genengine.protocol import EngineState, SamplingParams
from genengine_vllm import _process as vprocess
from genengine_vllm import settings as vsettings
from genengine_vllm.engine import VLLMEngine, generate_check_value
from genengine_vllm.lightrft import get_vllm_engine
from genengine_vllm.mapping import (
    completion_delta,
    contract_stop_reason,
    convert_request_output,
    sampled_logprobs,
    split_greedy_n,
    vllm_sampling_kwargs,
)
from genengine_vllm.settings import LOGPROBS_MODE, build_llm_kwargs, resolve_settings

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_no_vllm = pytest.mark.skipif(HAS_VLLM, reason="checks the error raised when vLLM is missing")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture
def fresh_slot() -> Any:
    """No sleep-mode engine registered before or after the test."""
    vprocess.PROCESS_STATE.sleep_owner = None
    yield
    vprocess.PROCESS_STATE.sleep_owner = None


# ---- import hygiene ------------------------------------------------------------------------------------------
def test_package_import_is_light() -> None:
    code = (
        "import genengine_vllm, genengine_vllm.plugin, genengine_vllm.engine, genengine_vllm.raw\n"
        "import genengine_vllm.settings, genengine_vllm.mapping, genengine_vllm.lightrft\n"
        "import sys\n"
        "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_lazy_exports() -> None:
    import genengine_vllm

    assert genengine_vllm.get_vllm_engine is get_vllm_engine
    assert genengine_vllm.VLLMEngine is VLLMEngine
    assert {"VLLMEngine", "get_vllm_engine"} <= set(dir(genengine_vllm))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = genengine_vllm.nope  # type: ignore[attr-defined]


def test_registry_factory_and_raw_runner_resolve() -> None:
    from genengine.plugins.registry import available_backends, resolve_ref

    info = next(b for b in available_backends() if b.name == "vllm")
    assert resolve_ref(info.factory) == VLLMEngine.from_config
    from genengine_vllm.raw import RawVLLMEngine, raw_tokens_per_second

    assert resolve_ref(info.raw_runner) is raw_tokens_per_second
    assert resolve_ref(info.raw_engine) is RawVLLMEngine  # genengine bench's paired P1


# ---- bad input, before vLLM is imported or memory taken ------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "needles"),
    [
        ({"engine_mem_util": 0}, InvalidArgumentError, ["engine_mem_util=0", "(0, 1]"]),
        ({"engine_mem_util": 1.5}, InvalidArgumentError, ["engine_mem_util=1.5"]),
        ({"engine_mem_util": -0.2}, InvalidArgumentError, ["engine_mem_util=-0.2"]),
        ({"engine_mem_util": math.nan}, InvalidArgumentError, ["engine_mem_util=nan"]),
        ({"engine_mem_util": True}, InvalidArgumentError, ["engine_mem_util=True"]),
        ({"engine_mem_util": "0.5"}, InvalidArgumentError, ["engine_mem_util='0.5'"]),
        ({"tp_size": 0}, InvalidArgumentError, ["tp_size=0", ">= 1"]),
        ({"tp_size": -2}, InvalidArgumentError, ["tp_size=-2"]),
        ({"tp_size": 1.0}, InvalidArgumentError, ["tp_size=1.0"]),
        ({"tp_size": True}, InvalidArgumentError, ["tp_size=True"]),
        ({"dtype": "float32"}, InvalidArgumentError, ["dtype='float32'", "'bfloat16' and 'float16'"]),
        ({"dtype": "auto"}, InvalidArgumentError, ["dtype='auto'"]),
        ({"disable_cuda_graph": "yes"}, InvalidArgumentError, ["disable_cuda_graph='yes'", "True or False"]),
        ({"disable_cuda_graph": 1}, InvalidArgumentError, ["disable_cuda_graph=1"]),
        ({"skip_tokenizer_init": None}, InvalidArgumentError, ["skip_tokenizer_init=None"]),
        ({"enable_engine_sleep": "true"}, InvalidArgumentError, ["enable_engine_sleep='true'"]),
        ({"seed": 1.5}, InvalidArgumentError, ["seed=1.5"]),
        ({"max_model_length": 512}, ConfigError, ["'max_model_length'", "did you mean 'max_model_len'"]),
        ({"tensor_parallel_size": 2}, ConfigError, ["'tensor_parallel_size'", "use tp_size"]),
        ({"gpu_memory_utilization": 0.5}, ConfigError, ["engine_mem_util"]),
        ({"enforce_eager": True}, ConfigError, ["disable_cuda_graph"]),
        ({"logprobs_mode": "raw_logprobs"}, ConfigError, ["processed_logprobs"]),
        ({"distributed_executor_backend": "mp"}, ConfigError, ["external_launcher"]),
        ({"weight_sync_mode": "fast"}, ConfigError, ["weight_sync_mode='fast'", "bucketed, per_param"]),
        ({"bucket_bytes": 0}, ConfigError, ["bucket_bytes=0"]),
        # Everything valid, but the reference's function needs the trainer's torch.distributed.
        ({}, DistributedSetupError, ["torch.distributed is not initialised", "init_process_group"]),
        ({"tp_size": 2}, DistributedSetupError, ["torch.distributed is not initialised"]),
    ],
)
def test_bad_arguments_fail_first(model_dir: Path, kwargs: dict[str, Any], error: type, needles: list[str]) -> None:
    args: dict[str, Any] = {"model_name_or_path": str(model_dir), "engine_mem_util": 0.3, **kwargs}
    with pytest.raises(error) as info:
        get_vllm_engine(**args)
    for needle in needles:
        assert needle in str(info.value)
    assert isinstance(info.value, (ValueError, AssertionError))
    assert "vllm" not in sys.modules or HAS_VLLM


@pytest.mark.parametrize(
    ("fields", "options", "error", "needles"),
    [
        ({"dtype": "float32"}, {}, ConfigError, ["dtype='float32'", "bfloat16, float16"]),
        ({"mem_util": 0}, {}, ConfigError, ["mem_util=0"]),
        ({}, {"disable_cuda_graph": "no"}, ConfigError, ["disable_cuda_graph='no'"]),
        ({}, {"enable_prefix_cache": False}, ConfigError, ["did you mean 'enable_prefix_caching'"]),
        ({}, {"seed": 3}, ConfigError, ["EngineConfig.seed"]),
        ({"tp_size": 2}, {}, DistributedSetupError, ["tp_size=2 needs torch.distributed", "tp_size=1"]),
    ],
)
def test_bad_config_fails_first(
    model_dir: Path, fields: dict[str, Any], options: dict[str, Any], error: type, needles: list[str]
) -> None:
    with pytest.raises(error) as info:
        config = EngineConfig(backend="vllm", model=str(model_dir), options=options, **{"mem_util": 0.3, **fields})
        VLLMEngine.from_config(config)
    for needle in needles:
        assert needle in str(info.value)


def test_distributed_errors_are_assertion_errors(model_dir: Path) -> None:
    with pytest.raises(AssertionError):
        get_vllm_engine(str(model_dir), 0.3, tp_size=4)
    with pytest.raises(AssertionError):
        VLLMEngine.from_config(EngineConfig(backend="vllm", model=str(model_dir), tp_size=4))


@pytest.mark.parametrize("where", ["missing", "file", "no_config", "bad_config", "hub_id"])
def test_bad_model_path(tmp_path: Path, where: str) -> None:
    target = tmp_path / "model"
    if where == "file":
        target.write_text("x")
    elif where == "no_config":
        target.mkdir()
    elif where == "bad_config":
        target.mkdir()
        (target / "config.json").write_text("{not json")
    name = "no-such-org/no-such-model" if where == "hub_id" else str(target)
    error = ConfigError if where == "bad_config" else InvalidArgumentError
    with pytest.raises(error) as info:
        get_vllm_engine(name, 0.5)
    assert name in str(info.value)
    with pytest.raises(ConfigError) as info:
        VLLMEngine.from_config(EngineConfig(backend="vllm", model=name))
    assert name in str(info.value)


def test_model_must_be_given(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="model=None"):
        VLLMEngine.from_config(EngineConfig(backend="vllm", mem_util=0.3))


@needs_no_vllm
def test_valid_arguments_reach_the_import(model_dir: Path, fresh_slot: Any) -> None:
    from genengine.plugins.registry import create_engine

    with pytest.raises(BackendImportError, match=r"genengine\[vllm\]"):  # tp_size 1 needs no torch.distributed
        create_engine(backend=VLLMEngine, model=str(model_dir), max_model_len=512, weight_sync_mode="per_param")


def _from_config(model_dir: Path, **fields: Any) -> Any:
    return VLLMEngine.from_config(EngineConfig(backend="vllm", model=str(model_dir), mem_util=0.3, **fields))


@needs_no_vllm
def test_second_sleep_engine_is_refused_before_anything(model_dir: Path, fresh_slot: Any) -> None:
    class Holder:
        closed = False

        def __repr__(self) -> str:
            return "HolderEngine"

    holder = Holder()
    vprocess.claim_sleep_slot(holder, "test")
    vprocess.claim_sleep_slot(holder, "test")  # the owner may claim again
    with pytest.raises(EngineStateError) as info:
        _from_config(model_dir)
    assert "HolderEngine" in str(info.value) and "one engine per process" in str(info.value)
    assert "enable_engine_sleep=False" in str(info.value)
    with pytest.raises(EngineStateError):
        vprocess.claim_sleep_slot(object(), "another")
    # An engine without sleep does not need the allocator: it gets as far as importing vLLM.
    with pytest.raises(BackendImportError):
        _from_config(model_dir, enable_sleep=False)
    holder.closed = True  # a shut-down engine no longer holds the slot
    with pytest.raises(BackendImportError):
        _from_config(model_dir)
    holder.closed = False
    vprocess.release_sleep_slot(holder)
    with pytest.raises(BackendImportError):
        _from_config(model_dir)


def test_sleep_slot_frees_with_its_owner(fresh_slot: Any) -> None:
    class Owner:
        pass

    owner = Owner()
    vprocess.claim_sleep_slot(owner, "test")
    del owner
    import gc

    gc.collect()
    vprocess.claim_sleep_slot(Owner(), "test")  # the dead owner's claim does not block


# ---- argument mapping -------------------------------------------------------------------------------------
def _settings(model_dir: Path, **options: Any) -> Any:
    fields = {k: options.pop(k) for k in ("tp_size", "mem_util", "dtype", "enable_sleep", "seed") if k in options}
    return resolve_settings(EngineConfig(backend="vllm", model=str(model_dir), options=options, **fields))


def test_llm_kwargs_mapping(model_dir: Path) -> None:
    s = _settings(
        model_dir,
        mem_util=0.35,
        dtype="float16",
        enable_sleep=False,
        seed=7,
        disable_cuda_graph=True,
        skip_tokenizer_init=True,
        max_model_len=512,
        enable_prefix_caching=False,
    )
    kw = build_llm_kwargs(s, external_launcher=False, group_seed=9)
    assert kw == {
        "model": str(model_dir.resolve()),
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.35,
        "dtype": "float16",
        "enable_sleep_mode": False,
        "enforce_eager": True,
        "skip_tokenizer_init": True,
        "seed": 9,
        "logprobs_mode": "processed_logprobs",
        "max_model_len": 512,
        "enable_prefix_caching": False,
    }
    assert s.weight_sync_mode == "bucketed" and s.bucket_bytes == 512 << 20
    kw = build_llm_kwargs(_settings(model_dir), external_launcher=True, group_seed=3)
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert kw["enable_sleep_mode"] is True and kw["enforce_eager"] is False and kw["logprobs_mode"] == LOGPROBS_MODE
    assert _settings(model_dir, weight_sync_mode="per_param", bucket_bytes=1 << 20).bucket_bytes == 1 << 20


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


def _completion(index: int, ids: list[int], text: str, reason: str, stop: Any = None, lps: Any = None) -> Any:
    return SimpleNamespace(index=index, token_ids=ids, text=text, finish_reason=reason, stop_reason=stop, logprobs=lps)


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


def test_engine_declares_async_and_refuses_it_on_tp_groups() -> None:
    from genengine.engine.aio import AsyncEngineBase

    assert VLLMEngine.supports_async and issubclass(VLLMEngine, AsyncEngineBase)
    engine = VLLMEngine.__new__(VLLMEngine)  # the check reads the settings only: nothing is started
    engine.settings = SimpleNamespace(tp_size=2)  # type: ignore[assignment]
    with pytest.raises(EngineStateError, match="tp_size=2"):
        engine._check_async_available()
    engine.settings = SimpleNamespace(tp_size=1)  # type: ignore[assignment]
    engine._check_async_available()


def test_engine_lock_lets_callers_in_between_driver_steps() -> None:
    """The driver takes the lock straight back after each step; a caller waiting for it still gets it soon."""
    import threading
    import time

    from genengine.engine.aio import DriverLock

    lock = DriverLock()
    stop = threading.Event()
    steps = 0

    def driver() -> None:
        nonlocal steps
        while not stop.is_set():
            with lock.for_driver():
                time.sleep(0.002)  # one step
                steps += 1

    thread = threading.Thread(target=driver)
    thread.start()
    try:
        while steps < 3:
            time.sleep(0.001)
        waits = []
        for _ in range(20):
            start = time.perf_counter()
            with lock():
                waits.append(time.perf_counter() - start)
        assert max(waits) < 0.5, max(waits)
    finally:
        stop.set()
        thread.join()
    assert lock.waiting == 0


# ---- the async driver against an engine shaped like vLLM 0.26's in-process LLMEngine (a fake: it tests *our*
# driver's bookkeeping, not vLLM; GPU tests run the real one) ----------------------------------------------------
class _FakeCore:
    def __init__(self) -> None:
        self.batch_queue: list[Any] = []
        self.scheduler = SimpleNamespace(has_requests=lambda: False)
        self.calls: list[tuple[str, Any]] = []

    def pause_scheduler(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause", clear_cache))

    def resume_scheduler(self) -> None:
        self.calls.append(("resume", None))


class _FakeLLMEngine:
    """``add_request`` registers the id with the output processor, then the engine core takes it (or refuses
    it: ``refuse_in_core``), as llm_engine.py:274-276; ``step`` gives one token per request (DELTA outputs);
    ``abort_request`` forgets ids it knows and ignores the others."""

    def __init__(self) -> None:
        self.output_processor = SimpleNamespace(request_states={})
        self.running: dict[str, list[int]] = {}
        self.renderer = SimpleNamespace(cleared=0)
        self.renderer.clear_mm_cache = lambda: setattr(self.renderer, "cleared", self.renderer.cleared + 1)
        self.engine_core = SimpleNamespace(engine_core=_FakeCore())
        self.refuse_in_core = False
        self.fail_step: BaseException | None = None

    def add_request(self, vid: str, engine_input: Any, params: Any) -> None:
        self.output_processor.request_states[vid] = params
        if self.refuse_in_core:
            raise ValueError("the engine core refused it")
        self.running[vid] = [0, params.max_tokens]

    def abort_request(self, ids: list[str], internal: bool = False) -> None:
        for vid in ids:
            self.output_processor.request_states.pop(vid, None)
            self.running.pop(vid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.request_states)

    def step(self) -> list[Any]:
        if self.fail_step is not None:
            doomed = {"engine": self, "kv": bytearray(1024)}  # a frame local the error must not keep alive
            self.doomed_size = len(doomed)
            raise self.fail_step
        outputs = []
        for vid, pos in list(self.running.items()):
            pos[0] += 1
            done = pos[0] >= pos[1]
            outputs.append(
                SimpleNamespace(
                    request_id=vid,
                    finished=done,
                    outputs=[_completion(0, [pos[0]], "", "length" if done else None)],
                )
            )
            if done:
                del self.running[vid]
                self.output_processor.request_states.pop(vid, None)
        return outputs


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch) -> Any:
    import enum
    import types

    from genengine.engine.aio import DriverLock
    from genengine_vllm._async import AsyncDriver

    if not HAS_VLLM:
        kinds = types.ModuleType("vllm.sampling_params")
        kinds.RequestOutputKind = enum.Enum("RequestOutputKind", "CUMULATIVE DELTA FINAL_ONLY")  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "vllm", sys.modules.get("vllm") or types.ModuleType("vllm"))
        monkeypatch.setitem(sys.modules, "vllm.sampling_params", kinds)
    engine = _FakeLLMEngine()
    llm = SimpleNamespace(llm_engine=engine, _preprocess_cmpl_one=lambda prompt: dict(prompt))
    driver = AsyncDriver(llm, DriverLock(), detokenize=False, cuda=None)
    yield driver, engine
    driver.close()


def _async_request(loop: Any, rid: str, tokens: int) -> Any:
    from genengine.engine.aio import AsyncRequest
    from genengine.requests import normalize_requests

    request = normalize_requests(None, {"max_new_tokens": tokens}, prompt_token_ids=[[1, 2, 3]])[0]
    return AsyncRequest(rid, request, 0, loop)


def _params(tokens: int) -> Any:
    return SimpleNamespace(max_tokens=tokens, output_kind=None)


def test_driver_serves_streams_and_a_sync_batch(fake_driver: Any) -> None:
    driver, engine = fake_driver
    loop = asyncio.new_event_loop()
    try:
        request = _async_request(loop, "a", 3)
        with driver.lock():
            driver.start(request, [({"prompt_token_ids": [1, 2, 3]}, _params(3))])
            batch = driver.submit_sync([{"prompt_token_ids": [4]}], [_params(2)])
        driver.wake()
        outputs = batch.wait(driver.alive)
        assert [o.outputs[0].token_ids for o in outputs] == [[2]]  # FINAL_ONLY: the last output
        deadline = time.monotonic() + 5
        while not request.done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert request.done and request.samples[0].tokens == [1, 2, 3] and request.samples[0].finish == "length"
        assert not driver.busy and not engine.has_unfinished_requests()
    finally:
        loop.close()


def test_driver_forgets_a_request_the_engine_core_refused(fake_driver: Any) -> None:
    """vLLM's output processor has the id before the core refuses it: the driver aborts that id too, or
    ``has_unfinished_requests()`` would stay True and the next ``LLM.generate`` would step forever."""
    driver, engine = fake_driver
    loop = asyncio.new_event_loop()
    try:
        engine.refuse_in_core = True
        with driver.lock(), pytest.raises(InvalidArgumentError, match="vLLM refused the request: the engine core"):
            driver.start(_async_request(loop, "a", 3), [({"prompt_token_ids": [1]}, _params(3))])
        assert not engine.has_unfinished_requests() and not driver.busy
    finally:
        loop.close()


def test_driver_after_a_failed_step(fake_driver: Any) -> None:
    """A step that raises fails every request of ours (each caller gets the error, whose traceback keeps no
    frame locals of vLLM's), and nothing is handed to vLLM afterwards: it may be out of step."""
    driver, engine = fake_driver
    loop = asyncio.new_event_loop()
    try:
        engine.fail_step = RuntimeError("CUDA error: an illegal memory access")
        request = _async_request(loop, "a", 50)
        with driver.lock():
            driver.start(request, [({"prompt_token_ids": [1]}, _params(50))])
        driver.wake()
        deadline = time.monotonic() + 5
        while not request.done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert request.done and request.error is engine.fail_step
        frames = []
        tb = request.error.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        assert all("doomed" not in f.f_locals for f in frames)
        with driver.lock(), pytest.raises(EngineStateError, match=r"vLLM failed earlier .*illegal memory access"):
            driver.submit_sync([{"prompt_token_ids": [4]}], [_params(2)])
    finally:
        loop.close()


def test_driver_thread_dying_fails_later_calls(fake_driver: Any) -> None:
    """The driver's thread dying outside a step (here: the engine core's state cannot be read while it looks
    for work) makes every later call fail, and a generate() waiting on it fails instead of waiting forever."""
    from genengine_vllm._async import SyncBatch

    driver, engine = fake_driver

    def broken() -> bool:
        raise RuntimeError("the scheduler's state cannot be read")

    engine.engine_core.engine_core.scheduler.has_requests = broken
    with driver.lock():
        batch = driver.submit_sync([{"prompt_token_ids": [4]}], [_params(2)])
    driver.wake()
    assert [o.outputs[0].token_ids for o in batch.wait(driver.alive)] == [[2]]
    deadline = time.monotonic() + 5
    while driver.alive() and time.monotonic() < deadline:  # idle, it asks the core for work: that raises
        time.sleep(0.01)
    assert not driver.alive()
    with driver.lock(), pytest.raises(EngineStateError, match=r"vLLM failed earlier .*cannot be read"):
        driver.submit_sync([{"prompt_token_ids": [4]}], [_params(2)])
    orphan = SyncBatch(outputs=[None], remaining=1)  # a wait that nothing will end
    start = time.monotonic()
    with pytest.raises(EngineStateError, match="driver thread ended"):
        orphan.wait(driver.alive)
    assert time.monotonic() - start < 3


def test_driver_skips_a_request_aborted_before_it_reached_vllm(fake_driver: Any) -> None:
    driver, engine = fake_driver
    loop = asyncio.new_event_loop()
    try:
        request = _async_request(loop, "a", 5)
        request.finish(0, "abort")  # aborted from another thread while its submission waited for the lock
        with driver.lock():
            driver.start(request, [({"prompt_token_ids": [1]}, _params(5))])
        assert not driver.busy and not engine.output_processor.request_states
    finally:
        loop.close()


def test_driver_hold_clearing_the_cache_clears_the_renderers_multimodal_cache(fake_driver: Any) -> None:
    """As vLLM's AsyncLLM.pause_generation does: the engine core's reset clears only the receiver's cache."""
    driver, engine = fake_driver
    with driver.lock():
        driver.hold(clear_cache=False)
        driver.release()
        assert engine.renderer.cleared == 0
        driver.hold(clear_cache=True)
        driver.release()
    assert engine.renderer.cleared == 1
    assert engine.engine_core.engine_core.calls == [
        ("pause", False),
        ("resume", None),
        ("pause", False),
        ("pause", True),
        ("resume", None),
    ]


# ---- weight spec --------------------------------------------------------------------------------------------
# ---- RNG states -------------------------------------------------------------------------------------------
def test_rng_states_survive_engine_start() -> None:
    import numpy as np
    import torch

    def draw() -> tuple[Any, ...]:
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    expected = draw()
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    with vprocess.preserve_rng_states():  # what vLLM does while it starts: reseed everything
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        draw()
    assert draw() == expected


# ---- pass-through names: the installed vLLM's EngineArgs, else the pinned version's list ------------------
@dataclasses.dataclass
class _FakeEngineArgs:
    model: str = ""
    max_model_len: int | None = None
    brand_new_arg: bool = False
    _api_process_rank: int = 0


def _fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> Any:
    import importlib.machinery
    import types

    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A ``vllm`` package in ``sys.modules``: ``EngineArgs`` above and an ``LLM`` that records its start."""

    class InprocClient:
        def shutdown(self) -> None:
            pass

    class LLM:
        seen: ClassVar[list[dict[str, str | None]]] = []
        fail = False

        def __init__(self, **kwargs: Any) -> None:
            keys = ("VLLM_ENABLE_V1_MULTIPROCESSING", "RANK", "LOCAL_RANK", "PYTORCH_CUDA_ALLOC_CONF")
            LLM.seen.append({k: os.environ.get(k) for k in keys})
            if LLM.fail:
                raise RuntimeError("no GPU here")
            self.llm_engine = SimpleNamespace(engine_core=InprocClient())
            self.model_config = SimpleNamespace(max_model_len=kwargs.get("max_model_len") or 2048)

    vllm = _fake_module(monkeypatch, "vllm", LLM=LLM)
    _fake_module(monkeypatch, "vllm.engine")
    _fake_module(monkeypatch, "vllm.engine.arg_utils", EngineArgs=_FakeEngineArgs)
    _fake_module(monkeypatch, "vllm.v1")
    _fake_module(monkeypatch, "vllm.v1.engine")
    _fake_module(monkeypatch, "vllm.v1.engine.core_client", InprocClient=InprocClient)
    vsettings.engine_arg_names.cache_clear()
    yield vllm
    vsettings.engine_arg_names.cache_clear()


@needs_no_vllm
def test_engine_arg_names_fall_back_to_the_recorded_list() -> None:
    from genengine_vllm import compat

    vsettings.engine_arg_names.cache_clear()
    fallback = compat.recorded_engine_args()
    assert vsettings.engine_arg_names() is fallback
    assert fallback == {  # no vLLM installed here: the newest verified release's recorded fields
        f
        for f in compat.surface(compat.VERIFIED.maximum)["fields"]["vllm.engine.arg_utils:EngineArgs"]  # type: ignore[index]
        if not f.startswith("_")
    }
    assert {"max_model_len", "enable_prefix_caching", "gpu_memory_utilization"} <= fallback
    assert not any(name.startswith("_") for name in fallback)


@needs_no_vllm
def test_engine_arg_names_come_from_the_installed_engine_args(model_dir: Path, fake_vllm: Any) -> None:
    assert vsettings.engine_arg_names() == {"model", "max_model_len", "brand_new_arg"}
    assert _settings(model_dir, brand_new_arg=True).llm_options == {"brand_new_arg": True}
    with pytest.raises(ConfigError, match="'enable_prefix_caching'"):  # in the pinned list, not in this vLLM
        _settings(model_dir, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="'_api_process_rank'"):
        _settings(model_dir, _api_process_rank=1)
    with pytest.raises(ConfigError, match="did you mean 'max_model_len'"):
        _settings(model_dir, max_model_length=512)


# ---- environment: vLLM's start variables only while it starts, the allocator setting for the engine's life ---
_START_VARS = ("VLLM_ENABLE_V1_MULTIPROCESSING", "RANK", "LOCAL_RANK")


def test_start_environ() -> None:
    assert vprocess.start_environ(None) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    topology = SimpleNamespace(rank=3, local_rank=1)
    assert vprocess.start_environ(topology) == {  # type: ignore[arg-type]
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "RANK": "3",
        "LOCAL_RANK": "1",
    }


@pytest.mark.parametrize(
    ("conf", "inside"),
    [
        ("expandable_segments:True,max_split_size_mb:64", "max_split_size_mb:64"),
        ("expandable_segments:True", None),
        ("max_split_size_mb:64", "max_split_size_mb:64"),
        (None, None),
    ],
)
def test_expandable_segments_are_off_inside_the_block(
    monkeypatch: pytest.MonkeyPatch, conf: str | None, inside: str | None
) -> None:
    if conf is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    with vprocess.without_expandable_segments():
        assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == inside
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == conf


@needs_no_vllm
def test_engine_scopes_its_environment(
    model_dir: Path, fake_vllm: Any, fresh_slot: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in _START_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    outside = {"VLLM_ENABLE_V1_MULTIPROCESSING": None, "RANK": None, "LOCAL_RANK": None}
    engine = _from_config(model_dir, options={"max_model_len": 512})
    assert fake_vllm.LLM.seen[-1] == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "RANK": None,
        "LOCAL_RANK": None,
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64",
    }
    assert {k: os.environ.get(k) for k in _START_VARS} == outside  # the start is over
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"  # the engine lives
    with pytest.raises(EngineStateError, match="one engine per process"):
        _from_config(model_dir)
    engine.shutdown()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:64"
    assert {k: os.environ.get(k) for k in _START_VARS} == outside
    fake_vllm.LLM.fail = True  # a failed start gives everything back too, the sleep slot included
    with pytest.raises(RuntimeError, match="no GPU here"):
        _from_config(model_dir)
    assert fake_vllm.LLM.seen[-1]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:64"
    assert {k: os.environ.get(k) for k in _START_VARS} == outside
    vprocess.claim_sleep_slot(_FakeEngineArgs(), "after the failed start")  # any object a weakref can name


# ---- real process groups (2 ranks over gloo) ------------------------------------------------------------
def _scenarios(model: str) -> dict[str, Any]:
    """Run on each rank of a 2-rank world; returns what this rank saw."""
    import torch
    import torch.distributed as dist

    from genengine.distributed import engine_group

    rank = dist.get_rank()
    out: dict[str, Any] = {}

    def outcome(fn: Any) -> str:
        try:
            fn()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    # The world cannot be split into TP groups of 3: every rank raises, before vLLM.
    out["tp3"] = outcome(lambda: get_vllm_engine(model, 0.3, tp_size=3))
    if not HAS_VLLM:  # with vLLM installed this would start a real engine
        out["tp2"] = outcome(lambda: get_vllm_engine(model, 0.3, tp_size=2))

    group = engine_group(2, check_port=False, timeout_s=60)
    awake = EngineState()
    same = generate_check_value(["hi there"], SamplingParams(temperature=0.5, seed=3), None, None, awake)
    out["same"] = outcome(lambda: group.check_consistent(same, what="generate inputs"))
    prompt = "hi there" if rank == 0 else "hi there!"
    differ = generate_check_value([prompt], SamplingParams(temperature=0.5, seed=3), None, None, awake)
    out["prompt"] = outcome(lambda: group.check_consistent(differ, what="generate inputs"))
    seed = 3 if rank == 0 else 4
    differ = generate_check_value(["hi"], {"temperature": 0.5, "seed": seed}, None, None, awake)
    out["seed"] = outcome(lambda: group.check_consistent(differ, what="generate inputs"))
    state = awake if rank == 0 else EngineState(released_tags=frozenset({"weights", "kv_cache"}), sleep_level=1)
    differ = generate_check_value(None, None, [[1, 2, 3]], None, state)
    out["state"] = outcome(lambda: group.check_consistent(differ, what="generate inputs or engine state"))

    # vLLM's teardown destroys the default group; inside the guard that is a no-op, subgroups still go.
    sub = dist.new_group([0, 1], backend="gloo")
    with vprocess.keep_default_group(True):
        dist.destroy_process_group()
        dist.destroy_process_group(sub)
    out["initialised_after_guard"] = dist.is_initialized()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    out["all_reduce"] = total.item()
    out["restored"] = dist.destroy_process_group is not None and "guarded" not in dist.destroy_process_group.__name__
    return out


def _rank_main(rank: int, world: int, port: int, model: str, results: Any) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GENENGINE_COLLECTIVE_TIMEOUT_S": "60",
        }
    )
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        value = _scenarios(model)
        dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:
        results.put((rank, "err", traceback.format_exc()))


@pytest.fixture(scope="module")
def two_ranks(model_dir: Path) -> dict[int, dict[str, Any]]:
    ctx = worker_context()  # forked from a server that imported torch and transformers once (support/start.py)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, str(model_dir), results)) for r in range(2)]
    for p in procs:
        p.start()
    seen: dict[int, dict[str, Any]] = {}
    try:
        for _ in procs:
            rank, status, value = results.get(timeout=240)
            assert status == "ok", f"rank {rank} failed:\n{value}"
            seen[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return seen


def test_world_that_tp_cannot_split(two_ranks: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        assert two_ranks[rank]["tp3"].startswith("DistributedSetupError")
        assert "not divisible by tp_size 3" in two_ranks[rank]["tp3"]


@needs_no_vllm
def test_tp2_in_a_world_of_two_passes_the_checks(two_ranks: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):  # topology fine, no sleep engine yet: the next step is importing vLLM
        assert two_ranks[rank]["tp2"].startswith("BackendImportError"), two_ranks[rank]["tp2"]


def test_consistency_check_names_the_odd_rank(two_ranks: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        seen = two_ranks[rank]
        assert seen["same"] == "ok"
        for case in ("prompt", "seed", "state"):
            assert seen[case].startswith("InconsistentInputsError"), seen[case]
            assert "rank(s) [1] of TP group [0, 1]" in seen[case]  # on a tie the leader's value wins
        assert "engine state" in seen["state"]


def test_default_group_survives_the_guard(two_ranks: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        assert two_ranks[rank]["initialised_after_guard"] is True
        assert math.isclose(two_ranks[rank]["all_reduce"], 3.0)
        assert two_ranks[rank]["restored"] is True


def test_inconsistent_inputs_error_is_a_value_error() -> None:
    assert issubclass(InconsistentInputsError, ValueError)


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
        weight_sync_mode="bucketed", tp_size=1, skip_tokenizer_init=True, model="fake", model_config={"vocab_size": 64}
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
