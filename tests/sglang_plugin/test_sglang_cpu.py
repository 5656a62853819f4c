"""The sglang backend on a CPU machine without SGLang: validation, argument mapping, weight spec, the logit
filter that makes logprobs processed, and the distributed guards (real gloo groups, two processes).

The parts that need a GPU and SGLang are in tests/gpu/test_sglang_gpu.py and tests/gpu/tp2_sglang.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import json
import math
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
from support.ports import free_port
from support.start import worker_context

from genengine.config import EngineConfig
from genengine.errors import (
    BackendImportError,
    ConfigError,
    DistributedSetupError,
    GenEngineError,
    InvalidArgumentError,
)
from genengine.models.tiny_model import tiny_model_dir
from genengine.protocol import SamplingParams
from genengine.requests import normalize_requests
from genengine_sglang._process import engine_environment
from genengine_sglang.engine import SGLangEngine
from genengine_sglang.errors import SGLangEngineError
from genengine_sglang.lightrft import RLGenerationEngine, get_sglang_engine
from genengine_sglang.mapping import (
    SEEDED_TOP_K,
    build_entries,
    finish_from_sglang,
    output_from_sglang,
    results_from_sglang,
    sampling_to_sglang,
    stream_delta,
)
from genengine_sglang.settings import (
    DEFAULT_BUCKET_BYTES,
    OPTIONS_ENV,
    SYNC_LOADER,
    resolve_settings,
    server_kwargs,
)

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
needs_no_sglang = pytest.mark.skipif(HAS_SGLANG, reason="checks what happens when SGLang is missing")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture(autouse=True)
def _no_env_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OPTIONS_ENV, raising=False)


# ---- the package stays light ---------------------------------------------------------------------------------
def test_imports_load_neither_torch_nor_sglang() -> None:
    code = (
        "import genengine_sglang, genengine_sglang.plugin, genengine_sglang.engine, genengine_sglang.sgl_model_saver\n"
        "import genengine_sglang.lightrft, genengine_sglang.raw, genengine_sglang._weightsync\n"
        "import genengine_sglang._process, genengine_sglang.settings, genengine_sglang.mapping\n"
        "import genengine_sglang._async, genengine_sglang._loop, genengine_sglang._group\n"
        "import sys; print(sorted(m for m in ('torch', 'sglang', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_lazy_exports() -> None:
    import genengine_sglang
    from genengine_sglang import engine, lightrft

    assert genengine_sglang.get_sglang_engine is lightrft.get_sglang_engine
    assert genengine_sglang.RLGenerationEngine is lightrft.RLGenerationEngine
    assert genengine_sglang.get_sglang_engine_for_rollout is lightrft.get_sglang_engine_for_rollout
    assert genengine_sglang.SGLangEngine is engine.SGLangEngine
    with pytest.raises(AttributeError):
        genengine_sglang.no_such_thing  # noqa: B018
    # The protocol module does not reach up to LightRFT's face (which imports it): the names live in lightrft.
    for name in ("RLGenerationEngine", "get_sglang_engine", "get_sglang_engine_for_rollout"):
        assert not hasattr(engine, name) and callable(getattr(lightrft, name))
    with pytest.raises(AttributeError):
        engine.no_such_thing  # noqa: B018


def test_plugin_targets_resolve() -> None:
    """The strings the plugin registers name real attributes (imported lazily by the registry)."""
    from genengine_sglang import plugin

    seen: dict[str, Any] = {}
    plugin.register_backends(register=lambda name, factory, **kw: seen.update(name=name, factory=factory, **kw))
    assert seen["name"] == "sglang" and seen["requires"] == ("sglang",)
    for ref in (seen["factory"], seen["raw_runner"], seen["raw_engine"]):
        module, _, attr = ref.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        assert callable(obj), ref
    # The protocol class is the backend, as in the vLLM plugin; LightRFT's face is a subclass on top of it.
    assert seen["factory"] == "genengine_sglang.engine:SGLangEngine.from_config"
    assert inspect.ismethod(RLGenerationEngine.from_config)
    assert issubclass(RLGenerationEngine, SGLangEngine)


def test_get_sglang_engine_has_the_reference_signature() -> None:
    params = inspect.signature(get_sglang_engine).parameters
    assert [(p.name, p.default) for p in params.values()] == [
        ("model_name_or_path", inspect.Parameter.empty),
        ("engine_mem_util", inspect.Parameter.empty),
        ("enable_engine_sleep", True),
        ("tp_size", 1),
        ("skip_tokenizer_init", False),
        ("dtype", "bfloat16"),
        ("disable_cuda_graph", False),
    ]


def test_protocol_class_has_the_protocol_face_only() -> None:
    """``SGLangEngine`` is the protocol's API alone; LightRFT's calls live on its subclass."""
    from genengine.engine.base import EngineBase

    for method in ("generate", "sleep", "wake", "load_weights"):
        assert inspect.signature(getattr(SGLangEngine, method)) == inspect.signature(getattr(EngineBase, method))
    for name in ("wake_up", "update_weights_from_tensor"):
        assert not hasattr(SGLangEngine, name) and hasattr(RLGenerationEngine, name)
    params = list(inspect.signature(SGLangEngine).parameters)
    assert params == ["settings", "group", "require_distributed"]
    assert SGLangEngine.supported_tags == RLGenerationEngine.supported_tags


def test_both_faces_on_one_class() -> None:
    gen = inspect.signature(RLGenerationEngine.generate).parameters
    for name in ("prompts", "sampling_params", "prompt_token_ids", "image_data"):
        assert name in gen
    for name in ("prompt", "input_ids", "return_logprob", "logprob_start_len", "top_logprobs_num", "gather_inputs"):
        assert gen[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert "release_weights" in inspect.signature(RLGenerationEngine.sleep).parameters
    ref = inspect.signature(RLGenerationEngine.update_weights_from_tensor).parameters
    assert list(ref)[1:] == ["name", "tensor", "flush_cache", "load_format"]
    assert RLGenerationEngine.supported_tags == ("weights", "kv_cache", "cuda_graph")


# ---- bad input, before any process or memory --------------------------------------------------------------------
BAD_ARGS: list[tuple[dict[str, Any], str]] = [
    ({"engine_mem_util": 0}, "engine_mem_util"),
    ({"engine_mem_util": 0.0}, "engine_mem_util"),
    ({"engine_mem_util": 1.5}, "engine_mem_util"),
    ({"engine_mem_util": -0.1}, "engine_mem_util"),
    ({"engine_mem_util": math.nan}, "engine_mem_util"),
    ({"engine_mem_util": "0.5"}, "engine_mem_util"),
    ({"engine_mem_util": True}, "engine_mem_util"),
    ({"tp_size": 0}, "tp_size"),
    ({"tp_size": -2}, "tp_size"),
    ({"tp_size": 1.0}, "tp_size"),
    ({"tp_size": True}, "tp_size"),
    ({"dtype": "float32"}, "dtype"),
    ({"dtype": "bf16"}, "dtype"),
    ({"disable_cuda_graph": "yes"}, "disable_cuda_graph"),
    ({"disable_cuda_graph": 1}, "disable_cuda_graph"),
    ({"enable_engine_sleep": None}, "enable_engine_sleep"),
    ({"skip_tokenizer_init": 0}, "skip_tokenizer_init"),
]


@pytest.mark.parametrize(
    ("bad", "needle"), BAD_ARGS, ids=[f"{next(iter(b))}={next(iter(b.values()))!r}" for b, _ in BAD_ARGS]
)
def test_bad_arguments(model_dir: Path, bad: dict[str, Any], needle: str) -> None:
    kwargs = {"model_name_or_path": str(model_dir), "engine_mem_util": 0.5, **bad}
    with pytest.raises(InvalidArgumentError) as info:
        get_sglang_engine(**kwargs)
    assert isinstance(info.value, ValueError)
    assert needle in str(info.value) and repr(next(iter(bad.values()))) in str(info.value)


def test_bad_model_paths(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        get_sglang_engine(str(tmp_path / "nope"), 0.5)
    with pytest.raises(InvalidArgumentError, match=r"no config\.json"):
        get_sglang_engine(str(tmp_path), 0.5)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match="is a file"):
        get_sglang_engine(str(tmp_path / "weights.bin"), 0.5)
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        get_sglang_engine("", 0.5)
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        get_sglang_engine("no-such-org/no-such-model", 0.5)  # not in the HF cache: nothing is downloaded


def test_not_initialised_is_an_assertion_error(model_dir: Path) -> None:
    with pytest.raises(DistributedSetupError) as info:
        get_sglang_engine(str(model_dir), 0.5)
    assert isinstance(info.value, AssertionError)
    assert "torch.distributed is not initialised" in str(info.value)
    assert not mp.active_children()


def test_not_initialised_survives_python_O(model_dir: Path) -> None:
    code = (
        "from genengine_sglang import get_sglang_engine\n"
        "try:\n"
        f"    get_sglang_engine({str(model_dir)!r}, 0.5)\n"
        "except AssertionError as e:\n"
        "    print('raised', type(e).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert "raised DistributedSetupError" in out.stdout, out.stderr


def test_rollout_wrapper_maps_the_reference_arguments(model_dir: Path) -> None:
    from types import SimpleNamespace

    from genengine_sglang import get_sglang_engine_for_rollout

    args = SimpleNamespace(pretrain=str(model_dir), engine_mem_util=0.5, enable_engine_sleep=True, engine_tp_size=1)
    with pytest.raises(InvalidArgumentError, match="bf16"):
        get_sglang_engine_for_rollout(args)
    args.bf16 = True
    with pytest.raises(DistributedSetupError):  # valid arguments: the reference's distributed check
        get_sglang_engine_for_rollout(args)
    args.engine_mem_util = 3
    with pytest.raises(InvalidArgumentError, match="engine_mem_util"):
        get_sglang_engine_for_rollout(args)


def test_tp_above_one_needs_distributed(model_dir: Path) -> None:
    with pytest.raises(DistributedSetupError, match="tp_size=2"):
        RLGenerationEngine.from_config(EngineConfig(backend="sglang", model=str(model_dir), tp_size=2))


@needs_no_sglang
def test_missing_sglang_is_a_backend_import_error(model_dir: Path) -> None:
    config = EngineConfig(backend="sglang", model=str(model_dir), options={"base_port": free_port()})
    with pytest.raises(BackendImportError, match="genengine\\[sglang\\]"):
        RLGenerationEngine.from_config(config)
    assert not mp.active_children()
    with pytest.raises(BackendImportError):
        RLGenerationEngine(model_path=str(model_dir), base_port=free_port())


@needs_no_sglang
def test_create_engine_names_the_missing_engine(model_dir: Path) -> None:
    import genengine

    with pytest.raises(BackendImportError, match="sglang"):
        genengine.create_engine(backend="sglang", model=str(model_dir))


# ---- options and settings ---------------------------------------------------------------------------------------
def _settings(model_dir: Path, **options: Any) -> Any:
    return resolve_settings(EngineConfig(backend="sglang", model=str(model_dir), options=options), environ={})


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"attention_backen": "triton"}, "did you mean 'attention_backend'"),
        ({"weight_sync_mode": "fast"}, "weight_sync_mode='fast'"),
        ({"bucket_bytes": 0}, "bucket_bytes=0"),
        ({"bucket_bytes": 1.5}, "bucket_bytes=1.5"),
        ({"weight_sync_barrier": "generate"}, "weight_sync_barrier='generate'"),
        ({"release_timeout_s": -1}, "release_timeout_s=-1"),
        ({"base_port": 70000}, "base_port=70000"),
        ({"base_gpu_id": -1}, "base_gpu_id=-1"),
        ({"check_inputs": "yes"}, "check_inputs='yes'"),
        ({"enable_weights_cpu_backup": 1}, "enable_weights_cpu_backup=1"),
        ({"server_args": ["x"]}, "server_args"),
        ({"server_args": {"tp_size": 2}}, "'tp_size' is set by genengine"),
        ({"server_args": {"mem_fraction_static": 0.2}}, "use mem_util"),
        ({"disable_cuda_graph": "no"}, "disable_cuda_graph='no'"),
    ],
)
def test_bad_options(model_dir: Path, options: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        _settings(model_dir, **options)
    assert needle in str(info.value)


def test_options_from_the_environment(model_dir: Path) -> None:
    env = {OPTIONS_ENV: json.dumps({"attention_backend": "triton", "sampling_backend": "pytorch"})}
    config = EngineConfig(backend="sglang", model=str(model_dir), options={"sampling_backend": "flashinfer"})
    settings = resolve_settings(config, environ=env)
    assert settings.server_overrides == {"attention_backend": "triton", "sampling_backend": "flashinfer"}
    for raw, needle in (("{not json", "not valid JSON"), ("[1, 2]", "JSON object"), ('{"bogus": 1}', "'bogus'")):
        with pytest.raises(ConfigError, match=needle):
            resolve_settings(config, environ={OPTIONS_ENV: raw})


def test_server_kwargs_keep_the_reference_arguments(model_dir: Path) -> None:
    config = EngineConfig(
        backend="sglang",
        model=str(model_dir),
        tp_size=2,
        mem_util=0.6,
        enable_sleep=True,
        seed=7,
        options={"attention_backend": "triton", "disable_cuda_graph": True, "server_args": {"log_level": "info"}},
    )
    settings = resolve_settings(config, environ={})
    kwargs = server_kwargs(settings, base_gpu_id=2, port=40002)
    assert kwargs["model_path"] == str(model_dir)
    assert kwargs["mem_fraction_static"] == 0.6 and kwargs["tp_size"] == 2
    assert kwargs["base_gpu_id"] == 2 and kwargs["gpu_id_step"] == 1 and kwargs["port"] == 40002
    assert kwargs["enable_memory_saver"] is True and kwargs["enable_weights_cpu_backup"] is False
    assert kwargs["trust_remote_code"] is True and kwargs["dtype"] == "bfloat16" and kwargs["random_seed"] == 7
    assert kwargs["skip_tokenizer_init"] is False and kwargs["disable_cuda_graph"] is True
    assert kwargs["attention_backend"] == "triton" and kwargs["log_level"] == "info"
    assert kwargs["custom_weight_loader"] == [SYNC_LOADER] and kwargs["enable_custom_logit_processor"] is True
    assert settings.weight_sync_mode == "handles" and settings.bucket_bytes == DEFAULT_BUCKET_BYTES["handles"]
    assert _settings(model_dir, weight_sync_mode="flattened").bucket_bytes == 512 << 20


def test_every_sglang_server_argument_passes_through(model_dir: Path) -> None:
    """Options are the fields of SGLang's ``ServerArgs`` (the installed one, else the recorded fields of the
    newest verified release), less what genengine sets itself and its own option names; each goes to
    ``sglang.Engine`` unchanged."""
    from genengine_sglang.compat import recorded_server_args
    from genengine_sglang.settings import OUR_OPTIONS, passthrough_options

    allowed = passthrough_options()
    assert allowed <= set(recorded_server_args()) or HAS_SGLANG
    for reserved in ("model_path", "tp_size", "mem_fraction_static", "dtype", "custom_weight_loader", "nnodes"):
        assert reserved not in allowed
    assert not allowed & set(OUR_OPTIONS)
    # the names accepted before the list came from ServerArgs are all still accepted
    for name in ("attention_backend", "mm_attention_backend", "sampling_backend", "disable_radix_cache", "port"):
        assert name in allowed
    settings = _settings(model_dir, cuda_graph_max_bs_decode=8, server_args={"log_level": "info"})
    assert settings.server_overrides == {"cuda_graph_max_bs_decode": 8, "log_level": "info"}
    with pytest.raises(ConfigError, match="unknown option 'mem_fraction_static'"):  # as under server_args: reserved
        _settings(model_dir, mem_fraction_static=0.5)


def test_sync_loader_is_importable_by_name() -> None:
    module, _, attr = SYNC_LOADER.rpartition(".")
    assert callable(getattr(importlib.import_module(module), attr))


# ---- the engine processes' environment --------------------------------------------------------------------------
def test_engine_environment_is_scoped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    method = mp.get_start_method(allow_none=True)
    with engine_environment(enable_sleep=True):
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
        assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
        os.environ["NCCL_CUMEM_ENABLE"] = "0"  # what SGLang's start-up does to this process
        mp.set_start_method("spawn", force=True)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:64"
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert "NCCL_CUMEM_ENABLE" not in os.environ
    assert mp.get_start_method(allow_none=True) == method
    with engine_environment(enable_sleep=False):
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:64"


_SIGTERM_TRAINER = """
import asyncio, signal, sys, time
from genengine_sglang._process import return_sigterm
mode = sys.argv[1]
if mode == "own-handler":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))  # the trainer's own checkpoint-and-exit handler
before = signal.getsignal(signal.SIGTERM)
loop = asyncio.new_event_loop()
loop.add_signal_handler(signal.SIGTERM, lambda: None)  # what SGLang's tokenizer manager does on first use
if mode != "sglang-as-is":
    return_sigterm(loop, before)
print("READY", flush=True)
time.sleep(60)  # training: the engine's loop does not run
"""


@pytest.mark.parametrize(("mode", "want"), [("default", -signal.SIGTERM), ("own-handler", 3), ("sglang-as-is", None)])
def test_sigterm_reaches_a_trainer_between_engine_calls(mode: str, want: int | None) -> None:
    """SGLang's loop-bound SIGTERM handler would swallow SIGTERM while the trainer trains (the control shows
    it: the process is still alive); after return_sigterm the trainer's own disposition acts at once."""
    proc = subprocess.Popen([sys.executable, "-c", _SIGTERM_TRAINER, mode], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = proc.wait(timeout=3 if want is None else 20)
        except subprocess.TimeoutExpired:
            code = None
        assert code == want
    finally:
        proc.kill()
        proc.wait()


# ---- the weight spec --------------------------------------------------------------------------------------------
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


def test_loop_driver_lends_the_loop_to_a_thread_while_tasks_run() -> None:
    """The driver on a plain asyncio loop (SGLang's is one): sync calls run in the caller's thread while no task
    is live, on the loop's thread while tasks are, and the tasks go on during them; the thread ends when idle."""
    import asyncio
    import threading

    from genengine_sglang._loop import LoopThread

    loop = asyncio.new_event_loop()
    driver = LoopThread(loop)
    try:

        async def where() -> threading.Thread:
            return threading.current_thread()

        assert driver.run(where()) is threading.current_thread()  # today's path
        release = asyncio.Event()
        ticks: list[int] = []

        async def task() -> None:
            while not release.is_set():
                ticks.append(1)
                await asyncio.sleep(0.001)

        driver.spawn(task())
        assert driver.live == 1
        thread = driver.run(where())
        assert thread is not threading.current_thread() and thread.name == "genengine-sglang-loop"

        async def slow() -> int:
            before = len(ticks)
            await asyncio.sleep(0.05)
            return len(ticks) - before

        assert driver.run(slow()) > 5  # the task ran during the job's run_until_complete
        with pytest.raises(ZeroDivisionError):
            driver.call(lambda: 1 // 0)  # a job's error reaches the caller
        loop.call_soon_threadsafe(release.set)
        assert driver.wait_idle(10)
        thread.join(10)
        assert not thread.is_alive()
        assert driver.run(where()) is threading.current_thread()  # the loop is the callers' again
        driver.spawn(task())  # and a thread takes it back for new tasks
        driver.close(10)
        with pytest.raises(GenEngineError, match="shut down"):
            driver.spawn(task())
    finally:
        loop.close()


def test_loop_driver_tasks_spawned_while_a_caller_runs_the_loop() -> None:
    """A task spawned from another thread while a caller runs the loop itself: it starts there, and a thread
    takes the loop over when that call ends."""
    import asyncio
    import threading

    from genengine_sglang._loop import LoopThread

    loop = asyncio.new_event_loop()
    driver = LoopThread(loop)
    done = threading.Event()
    try:

        async def task() -> None:
            await asyncio.sleep(0.05)
            done.set()

        async def caller() -> None:
            threading.Thread(target=driver.spawn, args=(task(),)).start()
            await asyncio.sleep(0.01)

        driver.run(caller())
        assert done.wait(10)
        assert driver.wait_idle(10)
    finally:
        driver.close(10)
        loop.close()


# ---- LoopThread against the tokenizer manager's pattern (a fake: it tests our driver, not SGLang) ----------------
class _FakeTokenizerManager:
    """Imitates how SGLang 0.5.17's ``TokenizerManager`` uses its loop, to test *our* driver (it stands in for
    no SGLang behaviour a test claims): a receive task started lazily on the loop of the first request
    (``auto_create_handle_loop``) reads outputs from a socket, fed by another thread (the scheduler and
    detokenizer processes), and hands them to per-request events; ``abort_request`` is a sync call;
    ``generate_sync`` runs the loop itself, as every sync ``sgl.Engine`` method does."""

    def __init__(self, loop: Any) -> None:
        import queue

        self.loop = loop
        self._recv, self._send = socket.socketpair()
        self._recv.setblocking(False)
        self.event_loop: Any = None
        self.handle_loops = 0
        self.states: dict[str, tuple[Any, list[str]]] = {}
        self._submitted: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self._aborted: set[str] = set()
        self._scheduler = threading.Thread(target=self._schedule, daemon=True)
        self._scheduler.start()

    def auto_create_handle_loop(self) -> None:
        if self.event_loop is not None:
            return
        loop = asyncio.get_running_loop()
        self.event_loop = loop
        self.handle_task = loop.create_task(self._handle_loop())
        self.handle_loops += 1

    async def _handle_loop(self) -> None:
        loop = asyncio.get_running_loop()
        buffer = b""
        while True:
            buffer += await loop.sock_recv(self._recv, 65536)
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                rid, _, item = line.decode().partition(" ")
                state = self.states.get(rid)
                if state is not None:  # a late output of a request that is gone is dropped
                    state[1].append(item)
                    state[0].set()

    def emit(self, rid: str, item: str) -> None:
        self._send.sendall(f"{rid} {item}\n".encode())

    def _schedule(self) -> None:
        """One output per live request per step, as a batch."""
        import queue

        active: dict[str, list[int]] = {}
        while True:
            try:
                while True:
                    job = self._submitted.get(block=not active)
                    if job is None:
                        return
                    active[job[0]] = [0, job[1]]
            except queue.Empty:
                pass
            for rid, pos in list(active.items()):
                if rid in self._aborted:
                    self.emit(rid, "abort")
                    del active[rid]
                    continue
                self.emit(rid, str(pos[0]))
                pos[0] += 1
                if pos[0] == pos[1]:
                    self.emit(rid, "end")
                    del active[rid]
            time.sleep(0.001)

    async def generate_request(self, rid: str, n: int) -> Any:
        self.auto_create_handle_loop()
        event, out = asyncio.Event(), []
        self.states[rid] = (event, out)
        self._submitted.put((rid, n))
        try:
            while True:
                await event.wait()
                event.clear()
                items, out[:] = list(out), []
                for item in items:
                    yield item
                    if item in ("end", "abort"):
                        return
        finally:
            self.states.pop(rid, None)

    def abort_request(self, rid: str) -> None:
        self._aborted.add(rid)

    async def collect(self, rid: str, n: int) -> list[str]:
        return [item async for item in self.generate_request(rid, n)]

    def generate_sync(self, rid: str, n: int) -> list[str]:
        return list(self.loop.run_until_complete(self.collect(rid, n)))

    def close(self) -> None:
        self._submitted.put(None)
        self._scheduler.join(5)
        self._recv.close()
        self._send.close()


def _new_loop(kind: str) -> Any:
    if kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")  # SGLang's loop on the GPU machine (it sets uvloop's policy)
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _run_caller(kind: str, coro: Any) -> Any:
    """Run ``coro`` as a trainer's coroutine: on a loop of its own (of the same kind) in this thread."""
    loop = _new_loop(kind)
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def _no_loop_thread(timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(t.name == "genengine-sglang-loop" and t.is_alive() for t in threading.enumerate()):
            return True
        time.sleep(0.005)
    return False


@pytest.fixture(params=["asyncio", "uvloop"])
def sgl_loop(request: pytest.FixtureRequest) -> Any:
    loop = _new_loop(request.param)
    yield request.param, loop
    loop.close()


def test_loop_driver_sync_calls_from_inside_a_coroutine(sgl_loop: tuple[str, Any]) -> None:
    """A sync SGLang call made from inside a trainer's coroutine with no stream live (``load_weights`` between
    pause and resume) runs on the driver's thread: on the caller's, SGLang's loop cannot run (``Cannot run the
    event loop while another loop is running``, and uvloop left the call behind as a task on SGLang's loop: the
    GPU hang of issue 17). Nothing is left on the loop, the thread ends after the call, and a later call from
    a plain thread runs there again."""
    from genengine_sglang._loop import LoopThread

    kind, loop = sgl_loop
    driver = LoopThread(loop)
    tm = _FakeTokenizerManager(loop)
    try:
        assert driver.call(lambda: tm.generate_sync("first", 3)) == ["0", "1", "2", "end"]  # the receive task starts
        here = threading.current_thread()

        async def where() -> threading.Thread:
            return threading.current_thread()

        async def trainer() -> tuple[threading.Thread, list[str]]:
            thread = driver.run(where())
            return thread, driver.call(lambda: tm.generate_sync("inside", 4), "the test's generate")

        thread, got = _run_caller(kind, trainer())
        assert thread is not here and thread.name == "genengine-sglang-loop"
        assert got == ["0", "1", "2", "3", "end"]
        assert _no_loop_thread()
        assert [t for t in asyncio.all_tasks(loop) if t is not tm.handle_task] == []  # nothing left behind
        assert driver.run(where()) is here and tm.handle_loops == 1
    finally:
        driver.close(5)
        tm.close()


def test_loop_driver_streams_with_a_lazily_started_receive_task(sgl_loop: tuple[str, Any]) -> None:
    """The receive task starts on SGLang's loop while our thread runs it (a stream is the first request), and
    serves every later runner of the loop: sync calls from a coroutine and from a plain thread while streams
    run, aborts told through ``soon`` from another thread, a spawn and a ``soon`` from the loop's own thread,
    and, once the thread has gone, a sync call in the caller's thread (outputs that arrived while nobody ran
    the loop waited in the socket)."""
    from genengine_sglang._loop import LoopThread

    kind, loop = sgl_loop
    driver = LoopThread(loop)
    tm = _FakeTokenizerManager(loop)
    sinks: dict[str, list[str]] = {f"s{i}": [] for i in range(40)}
    follow_up: list[str] = []
    told: list[threading.Thread] = []

    async def pump(rid: str, n: int, sink: list[str]) -> None:
        async for item in tm.generate_request(rid, n):
            sink.append(item)
        if rid == "s1":  # from the loop's own thread
            driver.spawn(pump("follow-up", 2, follow_up))
            driver.soon(lambda: told.append(threading.current_thread()))

    try:
        for rid, sink in sinks.items():
            driver.spawn(pump(rid, 30, sink))

        async def trainer() -> list[str]:
            while not sinks["s0"]:
                await asyncio.sleep(0.001)
            return driver.call(lambda: tm.generate_sync("from-coroutine", 5))

        assert _run_caller(kind, trainer()) == ["0", "1", "2", "3", "4", "end"]
        got: list[Any] = []
        plain = threading.Thread(target=lambda: got.append(driver.call(lambda: tm.generate_sync("from-thread", 2))))
        plain.start()
        plain.join(10)
        assert got == [["0", "1", "end"]]
        aborted = {f"s{i}" for i in range(0, 40, 4)}
        for rid in aborted:
            driver.soon(lambda rid=rid: tm.abort_request(rid))
        assert driver.wait_idle(10), driver.describe()
        for rid, sink in sinks.items():
            if rid in aborted and sink[-1] == "abort":
                assert sink[:-1] == [str(k) for k in range(len(sink) - 1)], rid
            else:
                assert sink == [*map(str, range(30)), "end"], rid
        assert sum(sinks[rid][-1] == "abort" for rid in aborted) >= 1
        assert follow_up == ["0", "1", "end"] and [t.name for t in told] == ["genengine-sglang-loop"]
        assert _no_loop_thread()
        tm.emit("gone", "7")  # a late output while nobody runs the loop
        assert driver.call(lambda: tm.generate_sync("after", 3)) == ["0", "1", "2", "end"]
        assert tm.handle_loops == 1  # one receive task throughout, whoever ran the loop
    finally:
        driver.close(5)
        tm.close()


def test_loop_driver_waits_are_bounded(sgl_loop: tuple[str, Any]) -> None:
    """``wait_idle`` returns False at its bound; a call the thread does not take (a callback blocks the loop)
    fails after ``pickup_timeout_s`` naming the call and where the loop is stuck, and never runs later; a call
    that does not return fails after ``call_timeout_s``; a sync call from a task on the loop itself fails
    at once."""
    from genengine_sglang._loop import LoopThread

    _kind, loop = sgl_loop
    driver = LoopThread(loop, pickup_timeout_s=0.3, call_timeout_s=0.5)
    release, gate, slow = threading.Event(), threading.Event(), threading.Event()
    ran: list[str] = []
    errors: list[BaseException] = []

    async def held() -> None:
        while not release.is_set():
            await asyncio.sleep(0.005)

    def blocking_callback() -> None:
        gate.wait(10)

    async def calls_sync_from_the_loop() -> None:
        try:
            driver.call(lambda: None, "a call from a task")
        except SGLangEngineError as exc:
            errors.append(exc)

    try:
        driver.spawn(held())
        start = time.monotonic()
        assert driver.wait_idle(0.2) is False and time.monotonic() - start < 2
        driver.spawn(calls_sync_from_the_loop())
        driver.soon(blocking_callback)
        with pytest.raises(
            SGLangEngineError,
            match=r"(?s)the test's call: .* did not take the call within 0\.3 s.*"
            r"blocking_callback",
        ):
            driver.call(lambda: ran.append("late"), "the test's call")
        gate.set()
        assert driver.call(lambda: 7) == 7 and ran == []  # recovered; the refused call never ran
        with pytest.raises(SGLangEngineError, match=r"the test's slow call did not return within 0\.5 s"):
            driver.call(lambda: slow.wait(10), "the test's slow call")
        slow.set()
        assert len(errors) == 1 and "SGLang's own event loop" in str(errors[0])
        release.set()
        assert driver.wait_idle(10), driver.describe()
    finally:
        gate.set()
        slow.set()
        release.set()
        driver.close(5)


def test_loop_driver_close_with_tasks_pending(sgl_loop: tuple[str, Any]) -> None:
    """``close`` cancels live tasks and stops the thread; one that ignores its cancellation is reported (left
    behind) within the bound; spawns after it are refused."""
    from genengine_sglang._loop import LoopThread

    _kind, loop = sgl_loop
    seen: list[str] = []
    stubborn = threading.Event()

    started = threading.Semaphore(0)

    async def cancellable() -> None:
        started.release()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def ignores_cancel() -> None:
        started.release()
        while not stubborn.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                seen.append("ignored")

    driver = LoopThread(loop)
    driver.spawn(cancellable())
    driver.spawn(cancellable())
    assert started.acquire(timeout=5) and started.acquire(timeout=5)
    driver.close(5)
    assert seen == ["cancelled", "cancelled"] and driver.live == 0 and _no_loop_thread()
    with pytest.raises(GenEngineError, match="shut down"):
        driver.spawn(cancellable())

    other = LoopThread(loop)
    other.spawn(ignores_cancel())
    assert started.acquire(timeout=5)
    start = time.monotonic()
    with pytest.raises(SGLangEngineError, match=r"1 task\(s\) on SGLang's event loop did not end within 0\.3 s"):
        other.close(0.6)
    assert time.monotonic() - start < 3 and "ignored" in seen
    stubborn.set()
    loop.run_until_complete(asyncio.sleep(0.05))  # the stubborn task ends once the loop runs again


def test_loop_driver_asks_run_forever_to_stop_once() -> None:
    """uvloop's ``stop()`` queues a handle (it is not a flag, as in asyncio): a second stop asked in the pass
    that ends ``run_forever`` would stay queued and end the next job's ``run_until_complete`` after one pass
    ("Event loop stopped before Future completed"). A job queued behind such a pass runs to its end."""
    from genengine_sglang._loop import LoopThread, _Job

    uvloop = pytest.importorskip("uvloop")
    loop = uvloop.new_event_loop()
    driver = LoopThread(loop)
    release = threading.Event()

    async def held() -> None:
        while not release.is_set():
            await asyncio.sleep(0.005)

    async def slow() -> str:
        await asyncio.sleep(0.05)
        return "done"

    job = _Job(lambda: loop.run_until_complete(slow()), "the test's job")

    def two_stops() -> None:  # the second one in the pass where the first stop takes effect
        with driver._changed:
            driver._jobs.append(job)
        driver._maybe_stop()
        loop.call_soon(driver._maybe_stop)

    try:
        driver.spawn(held())
        driver.soon(two_stops)
        assert job.done.wait(10)
        assert job.error is None and job.value == "done", job.error
    finally:
        release.set()
        driver.close(5)
        loop.close()


def test_loop_driver_call_queued_behind_a_stuck_call_is_bounded(sgl_loop: tuple[str, Any]) -> None:
    """A call waiting behind another call that does not return fails at its own ``call_timeout_s``, naming
    the call before it, instead of waiting as long as that one; it never runs later."""
    from genengine_sglang._loop import LoopThread

    _kind, loop = sgl_loop
    driver = LoopThread(loop, pickup_timeout_s=0.2, call_timeout_s=0.6)
    release, stuck = threading.Event(), threading.Event()
    ran: list[str] = []

    async def held() -> None:
        while not release.is_set():
            await asyncio.sleep(0.005)

    def first() -> None:
        with contextlib.suppress(SGLangEngineError):
            driver.call(lambda: (stuck.set(), release.wait(10)), "the stuck call")

    try:
        driver.spawn(held())
        other = threading.Thread(target=first)
        other.start()
        assert stuck.wait(5)
        start = time.monotonic()
        with pytest.raises(SGLangEngineError, match=r"the second call: not started within 0\.6 s.*the stuck call"):
            driver.call(lambda: ran.append("late"), "the second call")
        assert time.monotonic() - start < 3
        release.set()
        other.join(5)
        assert driver.call(lambda: 7) == 7 and ran == []
    finally:
        release.set()
        driver.close(5)


def test_loop_driver_close_while_a_caller_runs_the_loop(sgl_loop: tuple[str, Any]) -> None:
    """Shutdown while a caller runs SGLang's loop in its own sync call, with a task spawned meanwhile: the
    close waits for that call, then cancels the task; nothing is left live."""
    from genengine_sglang._loop import LoopThread

    _kind, loop = sgl_loop
    driver = LoopThread(loop)
    inside, seen = threading.Event(), []

    async def cancellable() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def busy() -> None:
        inside.set()
        await asyncio.sleep(0.4)

    caller = threading.Thread(target=lambda: driver.run(busy(), "the caller's call"))
    caller.start()
    assert inside.wait(5)
    driver.spawn(cancellable())  # spawned while the caller runs the loop: no thread of ours yet
    driver.close(5)
    caller.join(5)
    assert seen == ["cancelled"] and driver.live == 0 and _no_loop_thread()


class _SilentTokenizerManager:
    """SGLang's tokenizer manager after its scheduler died: requests are taken and never answered."""

    incremental_streaming_output = False

    def __init__(self) -> None:
        self.rid_to_state: dict[str, Any] = {}

    async def generate_request(self, obj: Any, request: Any) -> Any:
        self.rid_to_state[obj.rid] = obj
        await asyncio.Event().wait()
        yield {}

    def abort_request(self, rid: str) -> None:
        self.rid_to_state.pop(rid, None)


def test_async_requests_fail_when_sglang_processes_die(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang reports a dead scheduler by SIGQUIT, which uvloop drops while our thread runs the loop: the
    async layer checks SGLang's processes itself, and every stream in flight raises, naming the dead process,
    within about one check interval; the loop's thread ends. (SGLang's ``GenerateReqInput`` is a stand-in
    here: this tests our watch, not SGLang.)"""
    import types

    from genengine.engine.aio import AsyncRequest
    from genengine_sglang._async import AsyncDriver
    from genengine_sglang._loop import LoopThread

    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    io_struct.GenerateReqInput = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)

    sgl_loop, caller_loop = asyncio.new_event_loop(), asyncio.new_event_loop()
    driver = LoopThread(sgl_loop)
    tm = _SilentTokenizerManager()
    died = threading.Event()
    aio = AsyncDriver(
        driver,
        tm,
        deterministic=False,
        processor=None,
        extra_key=lambda: None,
        timeout_s=30,
        dead=lambda: "SGLang's scheduler (pid 4242, exit code -9) died" if died.is_set() else None,
        watch_interval_s=0.05,
    )
    requests = normalize_requests(None, {"temperature": 0, "max_new_tokens": 8}, prompt_token_ids=[[1, 2, 3]])
    entries = build_entries(requests, deterministic=False, has_tokenizer=True)
    handle = AsyncRequest("r0", requests[0], 0, caller_loop)
    try:
        aio.start(handle, entries)
        time.sleep(0.3)
        assert not handle.done and len(tm.rid_to_state) == 1  # alive: it waits, as a slow request would
        died.set()
        start = time.monotonic()
        deadline = start + 5
        while not handle.done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handle.done and time.monotonic() - start < 2
        assert isinstance(handle.error, SGLangEngineError)
        assert "scheduler (pid 4242, exit code -9) died" in str(handle.error)
        assert _no_loop_thread() and driver.live == 0
    finally:
        driver.close(5)
        sgl_loop.close()
        caller_loop.close()


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


# ---- sgl_model_saver ----------------------------------------------------------------------------------------------
def test_model_saver_arguments() -> None:
    from genengine_sglang import sgl_model_saver

    with pytest.raises(InvalidArgumentError, match="RLGenerationEngine"):
        sgl_model_saver.release_memory_occupation(object())  # type: ignore[arg-type]
    sgl_model_saver.release_memory_occupation()  # no live engine in this process: nothing to do
    sgl_model_saver.resume_memory_occupation()


# ---- real process groups ------------------------------------------------------------------------------------------
def _scenario(rank: int, world: int, port: int, model: str, out: Any) -> None:
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}
    )
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GENENGINE_COLLECTIVE_TIMEOUT_S": "60"})
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    results: dict[str, Any] = {}
    try:
        import torch.distributed as dist

        from genengine_sglang import get_sglang_engine
        from genengine_sglang.lightrft import RLGenerationEngine

        dist.init_process_group("gloo", rank=rank, world_size=world)
        base = 30000 + (port % 5000) * 2  # the engine port check must find these free

        def attempt(name: str, fn: Any) -> None:
            try:
                fn()
                results[name] = ("ok", "", [])
            except BaseException as exc:
                results[name] = (type(exc).__name__, str(exc), [c.__name__ for c in type(exc).__mro__])

        os.environ["GENENGINE_SGLANG_OPTIONS"] = json.dumps({"base_port": base})
        attempt("tp3", lambda: get_sglang_engine(model, 0.5, tp_size=3))
        attempt("tp2", lambda: get_sglang_engine(model, 0.5, tp_size=2))
        attempt("tp1", lambda: get_sglang_engine(model, 0.5, tp_size=1))
        attempt("bad_mem", lambda: get_sglang_engine(model, 2.0, tp_size=2))
        group = dist.new_group([0, 1], backend="gloo")
        attempt("reference_ctor", lambda: RLGenerationEngine(group, model_path=model, base_port=base))
        attempt("after", lambda: dist.barrier())  # the trainer's group still works after all of it
        results["children"] = len(mp.active_children())
        dist.destroy_process_group()
    except BaseException:
        results["crash"] = traceback.format_exc()
    out.put((rank, results))


@needs_no_sglang
def test_distributed_errors_reach_every_rank(model_dir: Path) -> None:
    """Two real ranks over gloo: the reference's AssertionErrors, and the leader's failure on both ranks."""
    ctx = worker_context()  # forked from a server that imported torch and transformers once (support/start.py)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_scenario, args=(r, 2, port, str(model_dir), queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank in (0, 1):
        res = got[rank]
        assert "crash" not in res, res.get("crash")
        kind, message, mro = res["tp3"]
        assert kind == "DistributedSetupError" and "AssertionError" in mro and "tp_size 3" in message
        kind, message, _ = res["tp2"]
        assert kind == "BackendImportError", res["tp2"]  # the leader's import error, broadcast to rank 1
        if rank == 1:
            assert "TP leader (rank 0)" in message or "genengine[sglang]" in message
        assert res["tp1"][0] == "BackendImportError"  # each rank is its own leader
        assert res["bad_mem"][0] == "InvalidArgumentError"
        assert res["reference_ctor"][0] == "BackendImportError"
        assert res["after"][0] == "ok" and res["children"] == 0


def test_errors_are_genengine_errors() -> None:
    assert issubclass(SGLangEngineError, GenEngineError) and issubclass(SGLangEngineError, RuntimeError)


def test_graph_memory_saver_with_breakable_graphs_is_refused() -> None:
    """SGLang 0.5.17 would raise in its scheduler after loading the model, and its launcher kills the trainer."""
    from genengine_sglang.settings import check_graph_memory_saver

    on = {"enable_memory_saver": True, "disable_cuda_graph": False}
    env = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true"}
    with pytest.raises(ConfigError) as err:
        check_graph_memory_saver(on, env)
    message = str(err.value)
    assert "SGLANG_MEMORY_SAVER_CUDA_GRAPH='true'" in message and "prefill, its default" in message
    assert "disable_prefill_cuda_graph=True" in message and "disable_cuda_graph=True" in message
    with pytest.raises(ConfigError, match="decode"):
        check_graph_memory_saver(
            {**on, "disable_prefill_cuda_graph": True, "cuda_graph_backend_decode": "breakable"}, env
        )
    with pytest.raises(ConfigError):
        check_graph_memory_saver(
            {**on, "cuda_graph_backend_prefill": "breakable"}, {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}
        )
    for allowed_kwargs, allowed_env in [
        (on, {}),  # not set: the graphs' pool stays through a release, nothing crashes
        (on, {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "false"}),
        ({**on, "enable_memory_saver": False}, env),
        ({**on, "disable_cuda_graph": True}, env),
        ({**on, "disable_prefill_cuda_graph": True}, env),
        ({**on, "cuda_graph_backend_prefill": "tc_piecewise"}, env),
        ({**on, "cuda_graph_config": {"prefill": {"backend": "tc_piecewise"}}}, env),
    ]:
        check_graph_memory_saver(allowed_kwargs, allowed_env)


def test_shutdown_closes_sglangs_sockets_so_no_later_collection_hangs(tmp_path: Path) -> None:
    """SGLang leaves its ZMQ sockets open; collecting them later terminates their context, which waits
    forever for a message queued to a process that is gone (the GPU suite's pytest hung so after its
    summary). The plugin's stop closes them without lingering and ends their contexts."""
    import threading
    from types import SimpleNamespace

    zmq = pytest.importorskip("zmq")
    from genengine_sglang._process import close_zmq, zmq_sockets

    context = zmq.Context(2)
    push = context.socket(zmq.PUSH)
    push.connect(f"ipc://{tmp_path}/scheduler-gone")
    push.send(b"queued for a scheduler that was killed")
    pull = context.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp_path}/detokenizer")
    rpc_context = zmq.Context(1)
    rpc = rpc_context.socket(zmq.DEALER)
    rpc.connect(f"ipc://{tmp_path}/rpc-gone")
    rpc.send(b"queued too")
    engine = SimpleNamespace(
        send_to_rpc=rpc, tokenizer_manager=SimpleNamespace(send_to_scheduler=push, recv_from_detokenizer=pull, x=1)
    )
    sockets = zmq_sockets(engine)
    assert {id(s) for s in sockets} == {id(push), id(pull), id(rpc)}
    done = threading.Event()
    threading.Thread(target=lambda: (close_zmq(sockets), done.set()), daemon=True).start()
    assert done.wait(10.0), "closing SGLang's sockets hung (a context waited for its queued messages)"
    assert push.closed and pull.closed and rpc.closed and context.closed and rpc_context.closed
