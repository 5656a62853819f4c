from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from genengine.config import EngineConfig, check_options
from genengine.errors import ConfigError


def test_from_dict_dataclass_yaml_and_omegaconf(tmp_path: Path) -> None:
    data = {"backend": "sglang", "model": "/m", "tp_size": 2, "mem_util": 0.6, "options": {"port": 40000}}
    cfg = EngineConfig.from_any(data)
    assert (cfg.backend, cfg.model, cfg.tp_size, cfg.mem_util, cfg.options) == ("sglang", "/m", 2, 0.6, {"port": 40000})

    @dataclasses.dataclass
    class TrainerEngineSection:
        backend: str = "vllm"
        model: str = "/m"
        dtype: str = "float16"

    assert EngineConfig.from_any(TrainerEngineSection()).dtype == "float16"

    path = tmp_path / "engine.yaml"
    path.write_text("backend: vllm\nmodel: /m\ntp_size: 4\nenable_sleep: false\noptions:\n  enforce_eager: true\n")
    cfg = EngineConfig.from_any(path)
    assert (cfg.backend, cfg.tp_size, cfg.enable_sleep, cfg.options) == ("vllm", 4, False, {"enforce_eager": True})
    assert EngineConfig.from_any(str(path)) == cfg

    from omegaconf import OmegaConf

    oc = OmegaConf.create({"backend": "sglang", "model": "/m", "options": {"attention_backend": "triton"}})
    cfg = EngineConfig.from_any(oc)
    assert cfg.options == {"attention_backend": "triton"} and type(cfg.options) is dict


@pytest.mark.parametrize(
    ("key", "hint"), [("mem_utl", "mem_util"), ("tp", None), ("tp_szie", "tp_size"), ("enable_slep", "enable_sleep")]
)
def test_unknown_key_names_it_and_closest(key: str, hint: str | None) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_mapping({key: 1})
    assert repr(key) in str(info.value)
    if hint:
        assert f"did you mean {hint!r}" in str(info.value)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("mem_util", 0, "(0, 1]"),
        ("mem_util", 1.5, "(0, 1]"),
        ("mem_util", math.nan, "(0, 1]"),
        ("mem_util", True, "(0, 1]"),
        ("tp_size", 0, ">= 1"),
        ("tp_size", 1.0, ">= 1"),
        ("dtype", "fp8", "bfloat16, float16, float32, auto"),
        ("enable_sleep", "yes", "true or false"),
        ("model", "", "non-empty"),
        ("options", [1], "mapping"),
    ],
)
def test_out_of_range_values_name_value_and_allowed(field: str, value: object, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(**{field: value})
    assert allowed in str(info.value) and field in str(info.value)


def test_yaml_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        EngineConfig.from_any(tmp_path / "missing.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        EngineConfig.from_any(bad)
    with pytest.raises(ConfigError, match="cannot build"):
        EngineConfig.from_any(42)


def test_check_options() -> None:
    check_options("sglang", {"port": 1}, ["port", "attention_backend"])
    with pytest.raises(ConfigError, match=r"'atention_backend'.*did you mean 'attention_backend'"):
        check_options("sglang", {"atention_backend": "triton"}, ["port", "attention_backend"])


@pytest.mark.parametrize(
    ("kwargs", "key", "field"),
    [
        ({"tp_sze": 2}, "tp_sze", "tp_size"),  # a misspelt field keyword lands in options
        ({"options": {"tp_sze": 2}}, "tp_sze", "tp_size"),
        ({"options": {"tp_size": 2}}, "tp_size", "tp_size"),  # a real field, in the wrong place
        ({"mem_utl": 0.5}, "mem_utl", "mem_util"),
    ],
)
def test_engine_config_field_under_options_is_named_as_one(kwargs: dict[str, object], key: str, field: str) -> None:
    """Issue 20: the hint said "did you mean 'tp_size'" for an *option*, which tp_size is not (and hinted
    'tp_size' for 'tp_size' itself); it now says where the field goes."""
    from genengine.plugins.registry import create_engine

    with pytest.raises(ConfigError) as info:
        create_engine(backend="transformers", model="/nonexistent", **kwargs)
    msg = str(info.value)
    assert repr(key) in msg and "'transformers'" in msg
    assert f"engine config field{'' if key == field else f' {field!r}'}" in msg
    assert f"create_engine({field}=...)" in msg and "not under 'options'" in msg
    assert "allowed options: " in msg and "max_batch_size" in msg
