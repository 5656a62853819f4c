"""The vllm plugin's settings (no vLLM needed): the LLM's keyword arguments, the pass-through option names
read from the installed vLLM's EngineArgs (else the pinned version's list), and the environment: vLLM's start
variables only while it starts, the allocator setting for the engine's life.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from support.vllm_fakes import engine_from_config as _from_config
from support.vllm_fakes import needs_no_vllm

from genengine.config import EngineConfig
from genengine.errors import (
    ConfigError,
    EngineStateError,
)
from genengine_vllm import _process as vprocess
from genengine_vllm import settings as vsettings
from genengine_vllm.settings import LOGPROBS_MODE, build_llm_kwargs, resolve_settings


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


@needs_no_vllm
@pytest.mark.parametrize("enable_sleep", [True, False])
def test_shutdown_releases_the_sleep_pools_after_the_teardown_where_vllm_does_not(
    model_dir: Path, fake_vllm: Any, fresh_slot: Any, monkeypatch: pytest.MonkeyPatch, enable_sleep: bool
) -> None:
    """vLLM 0.24.0's ``Worker.shutdown`` keeps the sleep allocator's pools (and so the engine's memory, which
    the GPU run showed: 42 GiB after shutdown); the engine's shutdown releases them after vLLM's own teardown,
    pools before allocators, and only for a sleep engine (the process's one sleep engine owns them)."""
    events: list[str] = []

    class Pool:
        def __del__(self) -> None:
            events.append("pool freed")

    class Old:  # 0.24.0's CuMemAllocator: no release_pools
        instance: Any = None

        def __init__(self) -> None:
            self.allocator_and_pools = {"weights": (Pool(), object()), "kv_cache": (Pool(), object())}

    _fake_module(monkeypatch, "vllm.device_allocator")
    _fake_module(monkeypatch, "vllm.device_allocator.cumem", CuMemAllocator=Old)
    monkeypatch.setattr(fake_vllm.LLM, "fail", False)
    engine = _from_config(model_dir, enable_sleep=enable_sleep)
    Old.instance = Old()
    monkeypatch.setattr(engine._llm.llm_engine.engine_core, "shutdown", lambda: events.append("vllm teardown"))
    try:
        engine.shutdown()
        if enable_sleep:
            assert Old.instance.allocator_and_pools == {}
            assert events == ["vllm teardown", "pool freed", "pool freed"]
        else:
            assert len(Old.instance.allocator_and_pools) == 2 and events == ["vllm teardown"]
    finally:
        Old.instance = None


@needs_no_vllm
def test_the_last_engine_drops_vllms_cuda_graphs_and_leaves_a_fresh_graph_pool(
    model_dir: Path, fake_vllm: Any, fresh_slot: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM shares one graph pool id per process and leaves its captured graphs to whenever their wrappers die; on
    vLLM 0.24.0 the GPU suite's first graph engine after another one shut down failed its capture on that id
    (torch's ``use_count > 0`` assert). The process's last engine drops the graphs before vLLM's teardown and
    leaves the next engine a new pool id; an engine that is not the last touches neither (another one replays
    them)."""
    events: list[str] = []

    def wrapper(name: str) -> Any:
        return type(name, (), {"clear_all_graphs": classmethod(lambda cls: events.append(f"{name} cleared"))})

    class CudaPlatform:
        _global_graph_pool: Any = (0, 3)

    _fake_module(monkeypatch, "vllm.compilation")
    _fake_module(monkeypatch, "vllm.compilation.cuda_graph", CUDAGraphWrapper=wrapper("CUDAGraphWrapper"))
    _fake_module(monkeypatch, "vllm.compilation.breakable_cudagraph", BreakableCUDAGraphWrapper=wrapper("Breakable"))
    _fake_module(monkeypatch, "vllm.platforms", _current_platform=CudaPlatform())
    monkeypatch.setattr(fake_vllm.LLM, "fail", False)
    first, second = _from_config(model_dir, enable_sleep=False), _from_config(model_dir, enable_sleep=False)
    core = first._llm.llm_engine.engine_core
    core.engine_core = SimpleNamespace(
        structured_output_manager=SimpleNamespace(clear_backend=lambda: events.append("first: own teardown")),
        model_executor=SimpleNamespace(shutdown=lambda: None),
        scheduler=SimpleNamespace(shutdown=lambda: None),
    )
    first.shutdown()  # the second engine still replays its graphs from the shared pool
    assert events == ["first: own teardown"] and CudaPlatform._global_graph_pool == (0, 3)
    monkeypatch.setattr(second._llm.llm_engine.engine_core, "shutdown", lambda: events.append("vllm teardown"))
    second.shutdown()
    assert events[1:] == ["CUDAGraphWrapper cleared", "Breakable cleared", "vllm teardown"]
    assert CudaPlatform._global_graph_pool is None  # vLLM makes a new one for the next engine
