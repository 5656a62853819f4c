"""Finding backends and weight transports: entry points → pluggy → ``create_engine`` / ``get_transport_info``.

Plugins load on first use. A plugin that fails to import, whose hook does not match the hookspec, whose
hook raises, that registers no backend, or that registers a name taken already (the first owner keeps it;
genengine's own backends register first) does not break listing or the other backends (it is reported
with a warning and as not loadable); selecting it raises an error naming its distribution with the
original exception chained.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import logging
import re
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, cast

import pluggy

from genengine import hookspecs
from genengine.config import EngineConfig
from genengine.errors import (
    BackendImportError,
    BackendNotFoundError,
    ConfigError,
    DuplicateBackendError,
    DuplicateTransportError,
    TransportNotFoundError,
    closest,
)
from genengine.plugins.versions import VerifiedRange, VersionStatus, installed_version
from genengine.protocol import GenerationEngine

__all__ = [
    "BUILTIN_TRANSPORTS_PLUGIN",
    "ENTRY_POINT_GROUP",
    "KNOWN_BACKENDS",
    "BackendInfo",
    "TransportInfo",
    "available_backends",
    "available_transports",
    "check_engine_config",
    "create_engine",
    "get_backend",
    "get_plugin_manager",
    "get_transport_info",
    "load_factory",
    "resolve_config",
    "resolve_ref",
]

ENTRY_POINT_GROUP = "genengine.backends"
BUILTIN_TRANSPORTS_PLUGIN = "genengine.transport.plugin"
"""The module that registers the built-in weight transports (gloo, nccl, cuda_ipc): a plugin without an entry point."""

KNOWN_BACKENDS: Mapping[str, str] = {
    "sglang": "pip install 'genengine[sglang]'",
    "vllm": "pip install 'genengine[vllm]'",
}
"""Backends we ship or know of, with how to install them: named in "unknown backend" errors."""

_log = logging.getLogger(__name__)

_PROTOCOL_METHODS = ("generate", "sleep", "wake", "load_weights", "flush_cache", "shutdown")


@dataclass(frozen=True)
class BackendInfo:
    """One registered backend, as ``genengine backends`` shows it."""

    name: str
    plugin: str
    distribution: str | None
    version: str | None
    description: str = ""
    factory: Any = None
    requires: tuple[str, ...] = ()
    install_hint: str | None = None
    raw_runner: Any = None
    raw_engine: Any = None
    """The raw engine kept alive beside ours for ``genengine bench``'s paired P1 (``(config) -> RawEngine``)."""
    error: BaseException | None = None
    """Set when the plugin itself failed to import or to register."""
    stage: str = "import"
    """What failed when ``error`` is set: ``"import"`` (``ep.load()``) or ``"register"`` (the hook)."""
    detail: str | None = None
    """A readable explanation of ``error``, when its own message is not one."""
    verified: Any = None
    """The engine releases the plugin was verified against (a ``genengine.backend.VerifiedRange``), if it says."""

    @property
    def engine_version(self) -> VersionStatus | None:
        """The installed engine's version against ``verified`` (read from metadata; nothing imported)."""
        if not isinstance(self.verified, VerifiedRange):
            return None
        return VersionStatus(self.verified, installed_version(self.verified.distribution))

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(m for m in self.requires if importlib.util.find_spec(m) is None)

    @property
    def factory_problem(self) -> str | None:
        """Why the factory string cannot be imported, when that shows without importing anything new: its
        module is absent although the package holding it is imported already (a typo in the module path).
        A typo in the attribute part shows only when the backend is selected (``create_engine`` says so)."""
        if not isinstance(self.factory, str):
            return None
        module = self.factory.partition(":")[0]
        parent = module.rpartition(".")[0]
        if parent and parent not in sys.modules:
            return None  # finding it would import the parent package: left to create_engine
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"its factory {self.factory!r} names module {module!r}, which does not exist"

    @property
    def loadable(self) -> bool:
        return self.error is None and not self.missing and self.factory_problem is None

    @property
    def _failure(self) -> str:
        return f"failed to {self.stage}: {self.detail or _describe(self.error)}" if self.error else ""

    @property
    def reason(self) -> str | None:
        """Why the backend cannot be used, or None if it can."""
        if self.error is not None:
            return f"plugin {self._failure}"
        missing = self.missing
        if missing:
            hint = self.useful_install_hint
            return f"not installed: missing module(s) {', '.join(missing)}" + (f"; {hint}" if hint else "")
        problem = self.factory_problem
        if problem:
            return f"broken registration: {problem} (distribution {self.distribution!r})"
        return None

    @property
    def useful_install_hint(self) -> str | None:
        """``install_hint``, unless it only reinstalls the plugin's own distribution (already installed,
        and what is missing is its requirement): ``pip install 'genengine[sglang]'`` is kept,
        ``pip install genengine-foo`` from the plugin ``genengine-foo`` is not."""
        hint = self.install_hint
        if not hint or self.distribution is None:
            return hint
        own = _normalize(self.distribution)
        words = [w.strip("'\"") for w in hint.split()]
        if "install" in words:
            targets = [w for w in words[words.index("install") + 1 :] if not w.startswith("-")]
            if targets and all(_normalize(t) == own for t in targets):
                return None
        return hint


@dataclass(frozen=True)
class TransportInfo:
    """One registered weight transport (``genengine.transport``)."""

    name: str
    plugin: str
    distribution: str | None
    factory: Any = None
    description: str = ""
    error: BaseException | None = None
    """Set when the plugin's ``register_weight_transports`` hook raised (then ``name`` is the plugin's)."""


def _normalize(requirement: str) -> str:
    """A distribution name as pip compares them (PEP 503), any version or marker cut off."""
    name = re.split(r"[\s;<>=!~@]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _describe(exc: BaseException) -> str:
    """``Type: message`` on one line (a backends table row), for an error raised by a plugin's own code."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _hook_signatures() -> str:
    """The hooks genengine calls, as a plugin must spell them (for errors about a plugin's hooks)."""
    specs = [obj for obj in vars(hookspecs).values() if callable(obj) and hasattr(obj, "genengine_spec")]
    return ", ".join(f"{f.__name__}({', '.join(inspect.signature(f).parameters)})" for f in specs)


class _Registry:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("genengine")
        self.pm.add_hookspecs(hookspecs)
        self.backends: dict[str, BackendInfo] = {}
        self.transports: dict[str, TransportInfo] = {}
        self.sources: dict[str, tuple[str | None, str | None]] = {}

    def load(self) -> None:
        contributed: dict[str, bool] = {}
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else None
            version = ep.dist.version if ep.dist is not None else None
            self.sources[ep.name] = (dist, version)
            stage = "import"
            try:
                module = ep.load()
                if self.pm.is_registered(module):
                    continue  # the same module reached through a second entry point
                stage = "register"
                self.pm.register(module, name=ep.name)
            except Exception as exc:
                if stage == "register" and self.pm.get_plugin(ep.name) is not None:
                    self.pm.unregister(name=ep.name)  # pluggy < 1.7 kept a plugin that failed validation
                detail = None
                if isinstance(exc, pluggy.PluginValidationError):
                    detail = f"{' '.join(str(exc).split())}; genengine calls {_hook_signatures()}"
                self._fail(ep.name, dist, version, exc, stage, detail)
                continue
            contributed[ep.name] = False
        self.pm.register(importlib.import_module(BUILTIN_TRANSPORTS_PLUGIN), name=BUILTIN_TRANSPORTS_PLUGIN)
        # genengine's own plugins first, so that a plugin reusing a built-in name is the one set aside.
        impls = self.pm.hook.register_backends.get_hookimpls()
        for impl in sorted(impls, key=lambda i: self.sources.get(i.plugin_name, (None, None))[0] != "genengine"):
            self._call(impl.plugin_name, impl.function)
        for impl in self.pm.hook.register_weight_transports.get_hookimpls():
            self._call_transports(impl.plugin_name, impl.function)
        for plugin in [b.plugin for b in self.backends.values()] + [t.plugin for t in self.transports.values()]:
            if plugin in contributed:
                contributed[plugin] = True
        for plugin, registered_some in contributed.items():
            if not registered_some:
                self._register_nothing(plugin)

    def _fail(
        self,
        plugin: str,
        dist: str | None,
        version: str | None,
        exc: BaseException,
        stage: str,
        detail: str | None = None,
    ) -> None:
        """Record one plugin as unusable (listed under its entry point's name) and warn; the others load on."""
        info = BackendInfo(plugin, plugin, dist, version, error=exc, stage=stage, detail=detail)
        what = "importing" if stage == "import" else "registering"
        warnings.warn(
            f"error {what} genengine plugin {plugin!r} (distribution {dist!r}): {detail or _describe(exc)}",
            RuntimeWarning,
            stacklevel=4,
        )
        self._add(info)

    def _register_nothing(self, plugin: str) -> None:
        """A plugin that registered no backend is a broken one (usually a misspelt hook): say so."""
        dist, version = self.sources.get(plugin, (None, None))
        module = self.pm.get_plugin(plugin)
        callers = self.pm.get_hookcallers(module) or []
        unknown = sorted(c.name for c in callers if not c.has_spec())
        known = _hook_signatures()
        if unknown:
            why = f"it implements {', '.join(unknown)}, which genengine does not call; genengine calls {known}"
        elif callers:
            why = "its hooks never called register(name, factory)"
        else:
            why = f"it has no hook marked @genengine.hookspecs.hookimpl; genengine calls {known}"
        detail = f"it registered no backend (nor weight transport): {why}"
        self.pm.unregister(name=plugin)
        self._fail(plugin, dist, version, BackendImportError(detail), "register", detail)

    def _call(self, plugin: str, hook: Callable[..., object]) -> None:
        dist, version = self.sources.get(plugin, (None, None))

        def register(
            name: str,
            factory: Any,
            *,
            requires: tuple[str, ...] = (),
            install_hint: str | None = None,
            description: str = "",
            raw_runner: Any = None,
            verified: Any = None,
            raw_engine: Any = None,
        ) -> None:
            if verified is not None and not isinstance(verified, VerifiedRange):
                raise TypeError(
                    f"register({name!r}, verified={verified!r}): expected a genengine.backend.VerifiedRange"
                )
            self._add(
                BackendInfo(
                    name,
                    plugin,
                    dist,
                    version,
                    description,
                    factory,
                    tuple(requires),
                    install_hint,
                    raw_runner,
                    raw_engine,
                    verified=verified,
                )
            )

        try:
            hook(register=register)
        except Exception as exc:
            self._fail(plugin, dist, version, exc, "register")

    def _call_transports(self, plugin: str, hook: Callable[..., object]) -> None:
        dist = self.sources.get(plugin, (None, None))[0]

        def register(name: str, factory: Any, *, description: str = "") -> None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"a transport named {name!r}: a transport name must be a non-empty str")
            old = self.transports.get(name)
            if old is not None:
                raise DuplicateTransportError(
                    f"weight transport {name!r} is registered twice: by plugin {old.plugin!r} (distribution "
                    f"{old.distribution!r}) and by plugin {plugin!r} (distribution {dist!r}); uninstall one of them"
                )
            self.transports[name] = TransportInfo(name, plugin, dist, factory, description)

        try:
            hook(register=register)
        except DuplicateTransportError:
            raise
        except Exception as exc:
            warnings.warn(
                f"error registering the weight transports of genengine plugin {plugin!r} (distribution {dist!r}): "
                f"{_describe(exc)}",
                RuntimeWarning,
                stacklevel=4,
            )
            self.transports.setdefault(plugin, TransportInfo(plugin, plugin, dist, error=exc))

    def _add(self, info: BackendInfo) -> None:
        """Record a backend; a name taken already keeps its first owner, and the newcomer is isolated as a
        broken plugin is: a warning, and a row that is not loadable (under its plugin's name) saying why."""
        old = self.backends.get(info.name)
        if old is not None and old.error is not None and info.error is None:
            # A broken plugin's row under its entry point's name gives way to a backend of that name.
            moved = self._free_name(old.name, old.plugin)
            self.backends[moved] = dataclasses.replace(old, name=moved)
            old = None
        if old is None:
            self.backends[info.name] = info
            return
        if info.error is not None:  # a failure record whose name is taken: listed under a name of its own
            name = self._free_name(info.name, info.plugin)
            self.backends[name] = dataclasses.replace(info, name=name)
            return
        exc = DuplicateBackendError(
            f"backend {info.name!r} is registered twice: by plugin {old.plugin!r} "
            f"(distribution {old.distribution!r}) and by plugin {info.plugin!r} "
            f"(distribution {info.distribution!r}); the first is used, this one is not: uninstall one of them"
        )
        warnings.warn(f"genengine plugin {info.plugin!r}: {exc}", RuntimeWarning, stacklevel=4)
        name = self._free_name(info.plugin, info.name)
        self.backends[name] = dataclasses.replace(info, name=name, error=exc, stage="register", factory=None)

    def _free_name(self, name: str, qualifier: str) -> str:
        """``name``, or ``name@qualifier`` (then numbered) when a backend holds ``name`` already."""
        candidate, n = name, 1
        while candidate in self.backends:
            candidate = f"{name}@{qualifier}" + (f"-{n}" if n > 1 else "")
            n += 1
        return candidate


_lock = threading.Lock()
_registry: _Registry | None = None


def _get() -> _Registry:
    global _registry
    with _lock:
        if _registry is None:
            registry = _Registry()
            registry.load()
            _registry = registry
        return _registry


def get_plugin_manager() -> pluggy.PluginManager:
    """The pluggy manager, with every installed plugin registered."""
    return _get().pm


def available_backends() -> list[BackendInfo]:
    """Every registered backend, loadable or not; imports no engine."""
    return sorted(_get().backends.values(), key=lambda b: b.name)


def resolve_ref(ref: Any) -> Any:
    """A ``"module:attr.attr"`` string imported now (plugins register factories this way); other values as is."""
    if not isinstance(ref, str):
        return ref
    module_name, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def get_backend(name: str) -> BackendInfo:
    """The backend called ``name``, or an error that lists what is installed and how to get the rest."""
    backends = _get().backends
    info = backends.get(name)
    if info is None:
        installed = ", ".join(sorted(n for n, b in backends.items() if b.loadable)) or "none"
        missing = [
            f"{n} ({hint})" for n, hint in KNOWN_BACKENDS.items() if n not in backends or not backends[n].loadable
        ]
        raise BackendNotFoundError(
            f"unknown backend {name!r}. Installed backends: {installed}."
            + (f" Known backends not installed: {'; '.join(missing)}." if missing else "")
        )
    if info.error is not None:
        raise BackendImportError(
            f"backend {name!r} cannot be used: its plugin (distribution {info.distribution!r}) {info._failure}"
        ) from info.error
    absent = info.missing
    if absent:
        hint = f"; to install: {info.useful_install_hint}" if info.useful_install_hint else ""
        raise BackendImportError(f"backend {name!r} is not installed (missing module(s): {', '.join(absent)}){hint}")
    return info


def available_transports() -> list[TransportInfo]:
    """Every registered weight transport (built-in and plugins'); imports no torch."""
    return sorted(_get().transports.values(), key=lambda t: t.name)


def get_transport_info(name: str) -> TransportInfo:
    """The transport called ``name``, or an error listing the registered ones."""
    transports = _get().transports
    info = transports.get(name)
    if info is None:
        names = ", ".join(sorted(n for n, t in transports.items() if t.error is None)) or "none"
        hint = closest(name, transports) if isinstance(name, str) else None
        raise TransportNotFoundError(
            f"unknown weight transport {name!r}"
            + (f" (did you mean {hint!r}?)" if hint else "")
            + f"; registered transports: {names}"
        )
    if info.error is not None:
        raise TransportNotFoundError(
            f"weight transport plugin {name!r} (distribution {info.distribution!r}) failed to register: "
            f"{_describe(info.error)}"
        ) from info.error
    return info


def _is_engine_class(obj: Any) -> bool:
    return isinstance(obj, type) and all(callable(getattr(obj, m, None)) for m in _PROTOCOL_METHODS)


def _is_engine_instance(obj: Any) -> bool:
    return not isinstance(obj, type) and all(callable(getattr(obj, m, None)) for m in _PROTOCOL_METHODS)


def resolve_config(config: Any, kwargs: Mapping[str, Any]) -> EngineConfig:
    """``config`` (any form ``EngineConfig.from_any`` takes, or None) with ``kwargs`` applied: ``EngineConfig``
    fields override it, any other keyword goes into ``options``. What ``create_engine`` builds from."""
    base = EngineConfig() if config is None else EngineConfig.from_any(config)
    names = set(EngineConfig.field_names())
    overrides = {k: v for k, v in kwargs.items() if k in names}
    extra = {k: v for k, v in kwargs.items() if k not in names}
    if extra:
        overrides["options"] = {**dict(overrides.get("options", base.options)), **extra}
    return base.replace(**overrides) if overrides else base


def create_engine(config: Any = None, /, **kwargs: Any) -> GenerationEngine:
    """Build an engine from a config (dict, dataclass, YAML path, OmegaConf, ``EngineConfig``) and/or kwargs.

    Keyword arguments that are ``EngineConfig`` fields override the config; any other keyword goes into
    ``options`` for the backend. ``backend`` may be a registered name, an engine class (built with
    ``cls.from_config(config)`` if it has one, else ``cls(config)``) or a ready engine instance.
    """
    cfg = resolve_config(config, kwargs)
    backend = cfg.backend
    if _is_engine_instance(backend):
        return backend
    if _is_engine_class(backend):
        engine = backend.from_config(cfg) if hasattr(backend, "from_config") else backend(cfg)
        _log_start(engine, cfg, f"{backend.__module__}.{backend.__qualname__}")
        return engine
    if not isinstance(backend, str):
        raise _not_a_backend(backend)
    info = get_backend(backend)
    if cfg.model is None:
        raise ConfigError(f"backend {backend!r} needs a model: pass model=PATH")
    engine = load_factory(info)(cfg)
    _log_start(engine, cfg, backend)
    return engine


def _not_a_backend(backend: Any) -> ConfigError:
    return ConfigError(
        f"backend={backend!r} is neither a backend name nor an engine class or instance "
        f"(an engine has {', '.join(_PROTOCOL_METHODS)})"
    )


def check_engine_config(config: Any = None, /, **kwargs: Any) -> EngineConfig:
    """What ``create_engine`` would refuse with the same arguments, found without starting an engine or
    reading a model, so a caller can refuse before slow work of its own (the CLI before it builds its tiny
    model): the config's values, the backend (registered, installed, its factory importable; the engine's
    module is imported) and, where the engine class has a ``check_config`` classmethod (every
    ``FromConfig`` engine has), its option names and values. ``model`` may still be missing. Returns the
    resolved config."""
    cfg = resolve_config(config, kwargs)
    backend = cfg.backend
    if _is_engine_instance(backend):
        return cfg
    if _is_engine_class(backend):
        owner: Any = backend
    elif isinstance(backend, str):
        owner = getattr(load_factory(get_backend(backend)), "__self__", None)  # a classmethod's class
    else:
        raise _not_a_backend(backend)
    check = getattr(owner, "check_config", None)
    if isinstance(owner, type) and callable(check):
        check(cfg)
    return cfg


def _log_start(engine: Any, cfg: EngineConfig, backend: str) -> None:
    """One INFO line per engine started, so a user (or a trainer's log) sees that genengine generates, and
    with what. Device and dtype are the engine's own where it says (``engine.device``, ``engine.dtype``, or
    its ``settings``), else the config's."""
    if not _log.isEnabledFor(logging.INFO):
        return
    settings = getattr(engine, "settings", None)
    device = getattr(engine, "device", None) or cfg.options.get("device")
    if device is None:
        torch = sys.modules.get("torch")  # imported by any engine that could be on a GPU; never imported here
        device = "cuda" if torch is not None and torch.cuda.is_available() else "cpu"
    dtype = getattr(engine, "dtype", None) or getattr(settings, "dtype", None) or cfg.dtype
    _log.info(
        "genengine: started engine backend=%s device=%s dtype=%s model=%s tp=%d",
        backend,
        device,
        str(dtype).removeprefix("torch."),
        cfg.model,
        cfg.tp_size,
    )


def load_factory(info: BackendInfo) -> Callable[[EngineConfig], Any]:
    """The backend's factory, imported now; a ``BackendImportError`` naming the backend, its distribution and
    the factory string when the string does not lead to a callable (a missing module, a misspelt name)."""
    where = f"backend {info.name!r} (distribution {info.distribution!r})"
    try:
        factory = resolve_ref(info.factory)
    except ImportError as exc:
        raise BackendImportError(f"{where} failed to import its engine {info.factory!r}: {exc}") from exc
    except AttributeError as exc:
        raise BackendImportError(
            f"{where} registers the factory {info.factory!r}, which does not exist: {exc}; the plugin's "
            "register(name, 'module:attribute') has a typo"
        ) from exc
    if not callable(factory):
        raise BackendImportError(f"{where} registers the factory {info.factory!r}, which is not callable: {factory!r}")
    return cast(Callable[[EngineConfig], Any], factory)
