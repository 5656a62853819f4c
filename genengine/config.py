"""``EngineConfig``: the engine section of a trainer's config, from whatever the trainer keeps it in.

Trainers keep configs as dicts, dataclasses, YAML files or OmegaConf objects; all of them become one
validated ``EngineConfig`` here, so a typo or an out-of-range value fails with a message before any
engine (or GPU memory) is touched.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from genengine.errors import ConfigError, closest

__all__ = ["DTYPES", "EngineConfig", "check_options", "option_bool", "option_int", "option_number"]

DTYPES = ("bfloat16", "float16", "float32", "auto")


def _to_plain(value: Any) -> Any:
    """Mappings (OmegaConf's DictConfig too) to dicts, recursively; other values unchanged."""
    if isinstance(value, Mapping):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class EngineConfig:
    """Which backend to run, on which model, and how much of the GPU it may take.

    ``options`` holds backend-specific settings passed to the engine unchanged (for example SGLang's
    ``attention_backend``); each backend rejects options it does not know.
    """

    backend: Any = "transformers"
    """A registered backend name, or an engine class or instance (see ``create_engine``)."""
    model: str | None = None
    tp_size: int = 1
    mem_util: float = 0.8
    """Share of the GPU's memory the engine may take, in (0, 1]."""
    dtype: str = "bfloat16"
    enable_sleep: bool = True
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.backend, str) and not self.backend:
            raise ConfigError("backend is empty: give a backend name such as 'transformers', 'sglang' or 'vllm'")
        if self.model is not None:
            if isinstance(self.model, os.PathLike):
                object.__setattr__(self, "model", os.fspath(self.model))
            if not isinstance(self.model, str) or not self.model:
                raise ConfigError(f"model={self.model!r} must be a non-empty path or model name")
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ConfigError(f"tp_size={self.tp_size!r} must be an integer >= 1")
        mem = self.mem_util
        if isinstance(mem, bool) or not isinstance(mem, (int, float)) or not 0 < mem <= 1:
            raise ConfigError(f"mem_util={mem!r} must be a number in (0, 1]")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
        if not isinstance(self.enable_sleep, bool):
            raise ConfigError(f"enable_sleep={self.enable_sleep!r} must be true or false")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed={self.seed!r} must be an integer")
        if not isinstance(self.options, Mapping):
            raise ConfigError(f"options={self.options!r} must be a mapping of backend-specific settings")
        object.__setattr__(self, "options", _to_plain(self.options))

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> EngineConfig:
        data = _to_plain(data)
        names = cls.field_names()
        unknown = [k for k in data if k not in names]
        if unknown:
            key = str(unknown[0])
            hint = closest(key, names)
            raise ConfigError(
                f"unknown engine config key {key!r}"
                + (f" (did you mean {hint!r}?)" if hint else "")
                + f"; allowed: {', '.join(names)} (backend-specific settings go under 'options')"
            )
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> EngineConfig:
        import yaml

        try:
            with open(path, encoding="utf-8") as fh:
                data = yaml.safe_load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read engine config {os.fspath(path)!r}: {exc}") from exc
        if not isinstance(data, Mapping):
            raise ConfigError(f"engine config {os.fspath(path)!r} must hold a mapping, got {type(data).__name__}")
        return cls.from_mapping(data)

    @classmethod
    def from_any(cls, value: Any) -> EngineConfig:
        """An ``EngineConfig``, a mapping (dict, OmegaConf), a dataclass instance or a YAML file path."""
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls.from_mapping(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return cls.from_mapping({f.name: getattr(value, f.name) for f in fields(value)})
        if isinstance(value, (str, os.PathLike)):
            return cls.from_yaml(value)
        raise ConfigError(
            f"cannot build an engine config from {type(value).__name__}: "
            "give a dict, a dataclass, an OmegaConf config or a YAML file path"
        )

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def check_options(
    backend: str,
    options: Mapping[str, Any],
    allowed: Iterable[str],
    *,
    passthrough: Iterable[str] = (),
    passthrough_from: str = "",
) -> None:
    """Reject backend options the backend does not know, naming the closest known one.

    An engine-config field (``tp_size``, ``mem_util``, ...) put under ``options``, or a misspelling of one
    (``create_engine(tp_sze=2)`` lands there too), is named as such: it belongs at the config's top level.
    ``passthrough`` are the engine's own arguments the backend hands on (hundreds, read from the installed
    engine): accepted and searched for the hint, but summed up as ``passthrough_from`` in the message.
    """
    own = list(allowed)
    handed_on = [n for n in passthrough if n not in own]
    allowed = [*own, *handed_on]
    fields_ = EngineConfig.field_names()
    for key in options:
        if key in allowed:
            continue
        listed = f"allowed options: {', '.join(sorted(own)) or 'none'}"
        if handed_on:
            listed += f", and any of the {len(handed_on)} fields of {passthrough_from} that genengine does not set"
        hint = closest(key, [*allowed, *fields_])
        if hint in fields_ and hint not in allowed:
            where = (
                f"give it as create_engine({hint}=...) or at the top level of the engine config, not under 'options'"
            )
            if hint == key:
                raise ConfigError(
                    f"option {key!r} for backend {backend!r} is an engine config field: {where}; {listed}"
                )
            raise ConfigError(
                f"unknown option {key!r} for backend {backend!r} (did you mean the engine config field {hint!r}? "
                f"{where}); {listed}"
            )
        raise ConfigError(
            f"unknown option {key!r} for backend {backend!r}"
            + (f" (did you mean {hint!r}?)" if hint else "")
            + f"; {listed}"
        )


# ---- backend option values: one wording for every backend ---------------------------------------------------
def option_bool(name: str, value: Any) -> bool:
    """A backend option that must be True or False (not 0/1, not "true": a YAML typo should not pass)."""
    if not isinstance(value, bool):
        raise ConfigError(f"option {name}={value!r} must be True or False")
    return value


def option_int(name: str, value: Any, lo: int = 1, hi: int | None = None) -> int:
    """A backend option that must be an integer in ``[lo, hi]`` (no upper bound when ``hi`` is None)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        allowed = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise ConfigError(f"option {name}={value!r} must be {allowed}")
    return value


def option_number(name: str, value: Any) -> float:
    """A backend option that must be a finite number > 0 (a timeout, a fraction of memory)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"option {name}={value!r} must be a finite number > 0")
    return float(value)
