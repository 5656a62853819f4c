"""Building an engine from an ``EngineConfig``: the registry's ``from_config`` factory for an engine built from a
model path (:class:`FromConfig`), and the device check every one-device engine makes before it loads anything.

Imports no torch (``check_device`` imports it when it must look for a GPU).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar, cast

from genengine.config import EngineConfig, check_options
from genengine.errors import ConfigError

__all__ = ["FromConfig", "check_device"]

_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def check_device(device: Any) -> str:
    """``device`` if it is "cpu", "cuda" or "cuda:N" and present here; a ``ConfigError`` before anything loads."""
    if not isinstance(device, str) or not _DEVICE_RE.match(device):
        raise ConfigError(f"device={device!r}: allowed are 'cpu', 'cuda' or 'cuda:N'")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} but CUDA is not available here; use device='cpu'")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


_E = TypeVar("_E", bound="FromConfig")


class FromConfig:
    """Mixin: the registry's factory, ``from_config(config)``, for an engine built as ``cls(model, **kwargs)``.

    Declare ``backend_name`` and ``config_options`` (the ``EngineConfig.options`` keys the engine takes);
    unknown options, a missing model and (for ``single_device`` engines) ``tp_size > 1`` are refused before
    anything loads. ``engine_kwargs`` maps the config to the constructor's keywords: dtype, enable_sleep,
    seed, and every option under its own name.
    """

    backend_name: ClassVar[str] = ""
    config_options: ClassVar[Sequence[str]] = ()
    single_device: ClassVar[bool] = True

    @classmethod
    def engine_kwargs(cls, config: EngineConfig) -> dict[str, Any]:
        return {"dtype": config.dtype, "enable_sleep": config.enable_sleep, "seed": config.seed, **config.options}

    @classmethod
    def check_config(cls, config: Any) -> EngineConfig:
        """The checks of :meth:`from_config` that need no model (option names, ``tp_size``, a ``device``
        option's value), alone: ``genengine.plugins.registry.check_engine_config`` runs them before a caller's own
        slow work (building a model, loading a policy)."""
        config = EngineConfig.from_any(config)
        name = cls.backend_name or cls.__name__
        check_options(name, config.options, cls.config_options)
        if cls.single_device and config.tp_size != 1:
            raise ConfigError(f"tp_size={config.tp_size}: the {name} backend runs on one device (tp_size=1)")
        if "device" in cls.config_options and "device" in config.options:
            check_device(config.options["device"])
        return config

    @classmethod
    def from_config(cls: type[_E], config: Any) -> _E:
        """Build from an ``EngineConfig`` (or anything ``EngineConfig.from_any`` takes); checks come first."""
        config = cls.check_config(config)
        name = cls.backend_name or cls.__name__
        if config.model is None:
            raise ConfigError(f"the {name} backend needs a model: pass model=PATH")
        return cast(Any, cls)(config.model, **cls.engine_kwargs(config))  # type: ignore[no-any-return]
