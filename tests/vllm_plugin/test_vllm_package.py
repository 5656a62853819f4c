"""The vllm plugin on a CPU machine without vLLM: the package stays light, its names resolve, and bad input
is refused before vLLM is imported or memory taken.

The plugin's CPU tests are split by topic in tests/vllm_plugin/ (package, settings, mapping, async, process,
weights); everything runs without vLLM installed. The parts that need a GPU and vLLM are in
tests/gpu/test_vllm_gpu.py.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.vllm_fakes import HAS_VLLM, needs_no_vllm
from support.vllm_fakes import engine_from_config as _from_config

from genengine.config import EngineConfig
from genengine.errors import (
    BackendImportError,
    ConfigError,
    DistributedSetupError,
    EngineStateError,
    InvalidArgumentError,
)
from genengine_vllm import _process as vprocess
from genengine_vllm.engine import VLLMEngine
from genengine_vllm.lightrft import get_vllm_engine


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
