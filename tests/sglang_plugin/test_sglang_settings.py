"""The sglang plugin's options and settings (no SGLang needed): bad options named, the environment's options,
the server arguments passed through, and the refused CUDA-graph/memory-saver combination.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from genengine.config import EngineConfig
from genengine.errors import ConfigError
from genengine_sglang.settings import (
    DEFAULT_BUCKET_BYTES,
    OPTIONS_ENV,
    SYNC_LOADER,
    resolve_settings,
    server_kwargs,
)

HAS_SGLANG = importlib.util.find_spec("sglang") is not None


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
    kwargs = server_kwargs(settings, base_gpu_id=2, port=40002, group_seed=8)  # seed 7 + TP group 1
    assert kwargs["model_path"] == str(model_dir)
    assert kwargs["mem_fraction_static"] == 0.6 and kwargs["tp_size"] == 2
    assert kwargs["base_gpu_id"] == 2 and kwargs["gpu_id_step"] == 1 and kwargs["port"] == 40002
    assert kwargs["enable_memory_saver"] is True and kwargs["enable_weights_cpu_backup"] is False
    assert kwargs["trust_remote_code"] is True and kwargs["dtype"] == "bfloat16" and kwargs["random_seed"] == 8
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
