"""The verified engine range (issue 44 point 3): an SGLang or vLLM outside it is refused at engine creation,
before the engine starts, unless the user allows it; ``genengine backends`` shows it; pyproject agrees.

The engines are not installed on CPU machines: the installed version is faked through ``importlib.metadata``,
which is all the check reads.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import genengine_sglang.compat as sglang_compat
import genengine_vllm.compat as vllm_compat
from genengine.backend import EngineConfig, VerifiedRange
from genengine.errors import ConfigError, DistributedSetupError
from genengine.models.tiny_model import tiny_model_dir
from genengine.plugins.versions import ALLOW_UNVERIFIED_ENV
from genengine_sglang.engine import SGLangEngine
from genengine_vllm.engine import VLLMEngine

ROOT = Path(__file__).resolve().parents[2]
COMPAT = {"sglang": sglang_compat.VERIFIED, "vllm": vllm_compat.VERIFIED}


class Started(Exception):
    """Raised where the engine would start: reaching it means the version check let the engine through."""


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture
def fake_installed(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str | None], None]:
    """``fake_installed("sglang", "0.5.16")``: metadata says that version is installed (None: not installed)."""
    fakes: dict[str, str | None] = {}
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name in fakes:
            found = fakes[name]
            if found is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return found
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.delenv(ALLOW_UNVERIFIED_ENV, raising=False)
    return fakes.__setitem__


def _bump(version: str, by: int) -> str:
    """A release just below (``by=-1``) or above (``by=1``): 0.5.17 -> 0.5.16 / 0.5.18, 0.26.0 -> 0.25.99."""
    parts = [int(p) for p in version.split(".")]
    i = len(parts) - 1
    while by < 0 and parts[i] == 0:  # 0.26.0 -> 0.25.99
        parts[i] = 99
        i -= 1
    parts[i] += by
    return ".".join(map(str, parts))


def _start_sglang(monkeypatch: pytest.MonkeyPatch, model_dir: Path, **options: Any) -> None:
    """``SGLangEngine.from_config``, with the engine's construction (its group, processes, GPU) replaced by
    ``Started``: settings are resolved, and checked, before it."""

    def started(self: Any, *args: Any, **kwargs: Any) -> None:
        raise Started

    monkeypatch.setattr(SGLangEngine, "__init__", started)
    SGLangEngine.from_config(EngineConfig(backend="sglang", model=str(model_dir), options=options))


def _start_vllm(monkeypatch: pytest.MonkeyPatch, model_dir: Path, **options: Any) -> None:
    """``VLLMEngine.from_config`` with vLLM's import (the first step of its start) replaced by ``Started``."""

    def started() -> None:
        raise Started

    monkeypatch.setattr("genengine_vllm.engine.import_vllm", started)
    VLLMEngine.from_config(
        EngineConfig(backend="vllm", model=str(model_dir), mem_util=0.3, enable_sleep=False, options=options)
    )


START = {"sglang": _start_sglang, "vllm": _start_vllm}


# ---- the range, and pyproject ----------------------------------------------------------------------------------
def _extras() -> dict[str, list[str]]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        tomllib = pytest.importorskip("tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["project"]["optional-dependencies"])


@pytest.mark.parametrize("engine", sorted(COMPAT))
def test_pyproject_extra_declares_exactly_the_verified_range(engine: str) -> None:
    """One place for the fact: the extra a user installs is the range the plugin accepts."""
    verified = COMPAT[engine]
    assert verified.distribution == engine
    assert _extras()[engine] == [verified.requirement]


def test_verified_range_bounds() -> None:
    one = VerifiedRange("vllm", "0.26.0", "0.26.0")
    assert one.contains("0.26.0") and one.contains("0.26.0+cu130")  # a local build of the same release
    assert not one.contains("not-a-version")
    assert not one.contains("0.25.9") and not one.contains("0.26.1") and not one.contains("0.26.0rc1")
    assert one.requirement == "vllm==0.26.0" and str(one) == "vllm 0.26.0"
    wide = VerifiedRange("sglang", "0.5.12", "0.5.17")
    assert wide.contains("0.5.12") and wide.contains("0.5.14") and wide.contains("0.5.17")
    assert not wide.contains("0.5.11") and not wide.contains("0.5.18") and not wide.contains("0.6.0")
    assert wide.requirement == "sglang>=0.5.12,<=0.5.17"
    with pytest.raises(ValueError, match=r"minimum 0\.5\.17 > maximum 0\.5\.12"):
        VerifiedRange("sglang", "0.5.17", "0.5.12")


# ---- engine creation ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", sorted(COMPAT))
@pytest.mark.parametrize("installed", ["in", "not installed", "local build"])
def test_verified_or_absent_engine_goes_on_to_start(
    engine: str, installed: str, fake_installed: Any, monkeypatch: pytest.MonkeyPatch, model_dir: Path, caplog: Any
) -> None:
    verified = COMPAT[engine]
    fake_installed(
        engine, {"in": verified.maximum, "not installed": None, "local build": verified.minimum + "+cu130"}[installed]
    )
    with caplog.at_level(logging.WARNING), pytest.raises(Started):
        START[engine](monkeypatch, model_dir)
    assert "unverified" not in caplog.text


@pytest.mark.parametrize("engine", sorted(COMPAT))
@pytest.mark.parametrize("side", ["below", "above"])
def test_unverified_engine_is_refused_before_it_starts(
    engine: str, side: str, fake_installed: Any, monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    verified = COMPAT[engine]
    version = _bump(verified.minimum, -1) if side == "below" else _bump(verified.maximum, 1)
    fake_installed(engine, version)
    with pytest.raises(ConfigError) as info:  # not Started: the engine's start was never reached
        START[engine](monkeypatch, model_dir)
    message = str(info.value)
    assert f"{engine} {version} is installed" in message  # the installed version
    assert f"verified with {verified}" in message and verified.requirement in message  # the range
    assert "allow_unverified_version=True" in message and f"{ALLOW_UNVERIFIED_ENV}=1" in message  # the override


@pytest.mark.parametrize("engine", sorted(COMPAT))
@pytest.mark.parametrize("how", ["option", "env"])
def test_override_warns_and_proceeds(
    engine: str, how: str, fake_installed: Any, monkeypatch: pytest.MonkeyPatch, model_dir: Path, caplog: Any
) -> None:
    verified = COMPAT[engine]
    version = _bump(verified.maximum, 1)
    fake_installed(engine, version)
    options: dict[str, Any] = {}
    if how == "option":
        options["allow_unverified_version"] = True
    else:
        monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="genengine"), pytest.raises(Started):
        START[engine](monkeypatch, model_dir, **options)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "unverified" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    text = warnings[0].getMessage()
    assert f"{engine} {version} is installed" in text and f"verified with {verified}" in text
    assert ("allow_unverified_version=True" if how == "option" else f"{ALLOW_UNVERIFIED_ENV}=1") in text


@pytest.mark.parametrize("engine", sorted(COMPAT))
def test_bad_override_values_are_refused(
    engine: str, fake_installed: Any, monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    fake_installed(engine, _bump(COMPAT[engine].maximum, 1))
    with pytest.raises(ConfigError, match=r"allow_unverified_version='yes' must be True or False"):
        START[engine](monkeypatch, model_dir, allow_unverified_version="yes")
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "sure")
    with pytest.raises(ConfigError, match=rf"{ALLOW_UNVERIFIED_ENV}='sure': allowed are"):
        START[engine](monkeypatch, model_dir)


def test_vllm_override_option_is_not_passed_to_vllm(fake_installed: Any, model_dir: Path) -> None:
    from genengine_vllm.settings import resolve_settings

    fake_installed("vllm", "0.99.0")
    config = EngineConfig(backend="vllm", model=str(model_dir), options={"allow_unverified_version": True})
    assert "allow_unverified_version" not in resolve_settings(config).llm_options


def test_lightrft_faces_are_refused_first_and_take_the_env_override(
    fake_installed: Any, monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    """LightRFT's ``get_*_engine`` have no options: the refusal comes before their distributed check, and
    ``GENENGINE_ALLOW_UNVERIFIED=1`` lets them on to it."""
    from genengine_sglang.lightrft import get_sglang_engine
    from genengine_vllm.lightrft import get_vllm_engine

    fake_installed("sglang", "0.5.99")
    fake_installed("vllm", "0.99.0")
    faces = [
        lambda: get_sglang_engine(str(model_dir), 0.5, enable_engine_sleep=False),
        lambda: get_vllm_engine(str(model_dir), 0.5, enable_engine_sleep=False),
    ]
    for face in faces:
        with pytest.raises(ConfigError, match="is installed"):
            face()
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "1")
    for face in faces:
        with pytest.raises(DistributedSetupError):
            face()


# ---- genengine backends ------------------------------------------------------------------------------------------
def test_backends_lists_engine_version_and_whether_verified(fake_installed: Any, capsys: Any) -> None:
    from genengine.cli import main

    fake_installed("sglang", sglang_compat.VERIFIED.maximum)
    fake_installed("vllm", "0.99.0")
    assert main(["backends", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["sglang"]["engine"] == f"sglang {sglang_compat.VERIFIED.maximum}"
    assert rows["sglang"]["in_verified_range"] is True
    assert rows["vllm"]["engine"] == "vllm 0.99.0" and rows["vllm"]["in_verified_range"] is False
    assert rows["vllm"]["verified_range"] == vllm_compat.VERIFIED.requirement
    assert rows["transformers"]["engine"] == "-" and rows["transformers"]["in_verified_range"] is None

    assert main(["backends"]) == 0
    table = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    sglang_range, vllm_range = (re.escape(c.VERIFIED.requirement) for c in (sglang_compat, vllm_compat))
    assert re.search(rf"sglang {re.escape(sglang_compat.VERIFIED.maximum)}\s+yes \({sglang_range}\)", table["sglang"])
    assert re.search(rf"vllm 0\.99\.0\s+NO \({vllm_range}\)", table["vllm"])

    fake_installed("vllm", None)
    assert main(["backends", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["vllm"]["engine"] == "not installed" and rows["vllm"]["in_verified_range"] is None
