"""The plugin hooks. A plugin is a module named by a ``genengine.backends`` entry point; it implements
``register_backends``, ``register_weight_transports`` or both."""

from __future__ import annotations

from typing import Any, Protocol

import pluggy

__all__ = ["RegisterBackend", "RegisterTransport", "hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("genengine")
hookimpl = pluggy.HookimplMarker("genengine")


class RegisterBackend(Protocol):
    def __call__(
        self,
        name: str,
        factory: Any,
        *,
        requires: tuple[str, ...] = (),
        install_hint: str | None = None,
        description: str = "",
        raw_runner: Any = None,
        verified: Any = None,
        raw_engine: Any = None,
    ) -> None: ...


@hookspec
def register_backends(register: RegisterBackend) -> None:
    """Register backends by calling ``register(name, factory, ...)`` once per backend.

    ``factory`` is a callable taking an ``EngineConfig`` and returning a ``GenerationEngine``, or a
    ``"module:attribute"`` string imported only when the backend is first used, so that listing backends
    imports no engine. ``requires`` names the top-level modules the backend needs (checked without importing
    them); ``install_hint`` says how to get them. ``raw_runner`` (same two forms) measures the raw engine
    beside ours in ``genengine bench``: a callable ``(config, prompt_token_ids, max_new_tokens) -> tokens/s``.
    ``raw_engine`` (same two forms), ``(config) -> engine`` with ``generate_tokens(prompt_token_ids,
    max_new_tokens) -> int`` (greedy, EOS ignored; the output tokens) and ``close()``, lets the benchmark keep
    the raw engine alive in a child process and pair its samples with ours (``genengine.cli.bench.paired``): it
    is preferred to ``raw_runner`` when both are given.
    ``verified`` (a ``genengine.backend.VerifiedRange``) names the engine releases the plugin was verified
    against; ``genengine backends`` shows the installed one against it.
    """


class RegisterTransport(Protocol):
    def __call__(self, name: str, factory: Any, *, description: str = "") -> None: ...


@hookspec
def register_weight_transports(register: RegisterTransport) -> None:
    """Register weight transports by calling ``register(name, factory, description=...)`` once per transport.

    ``factory`` is a callable taking no argument and returning a ``genengine.transport.WeightTransport``
    (a class will do), or a ``"module:attribute"`` string imported only when the transport is first used,
    so that listing transports imports no torch. ``name`` is what ``TransportSpec.transport`` selects.
    """
