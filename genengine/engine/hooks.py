"""The hooks of ``EngineBase`` and ``AsyncEngineBase`` a backend may override; what a TP backend compares.

``HOOKS`` is the list docs/plugins.md documents: a plugin overrides those and nothing else of the base (the state
machine's own members, ``_end_load`` and ``_begin_load`` among them, stay the base's); the hygiene test
(``tests/core/test_import_hygiene.py``) fails on a shipped plugin that overrides another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from genengine.protocol import EngineState

__all__ = ["HOOKS", "check_hook_signatures", "generate_check_value"]

HOOKS = (
    "_generate",
    "_release",
    "_resume",
    "_weight_spec",
    "_apply_weights",
    "_flush_cache",
    "_shutdown",
    "_vocab_size",
    "_bucket_cost",
    "_finish_weights",
    "_load_ended",
    "_check_consistent",
    "_check_sleep",
    "_check_load",
    "_check_weights_may_change",
    "_on_new_weight_version",
    "passes_tensors_on",
    # AdapterHost's (genengine.engine.adapters), for a backend that serves LoRA adapters
    "_max_lora_rank",
    "_add_adapter",
    "_drop_adapter",
    # AsyncEngineBase's (genengine.engine.aio)
    "_check_async_available",
    "_async_start",
    "_async_abort",
    "_async_hold",
    "_async_release_hold",
    "_check_idle",
)
"""The private members of ``EngineBase`` and ``AsyncEngineBase`` a backend may override (docs/plugins.md lists what
each is for), and ``passes_tensors_on``; every other private member of the bases, ``_end_load`` and
``_begin_load`` included, is the state machine's own. ``tests/test_import_hygiene`` fails when a shipped plugin
overrides another."""


def _by_content(images: Any) -> Any:
    """Images by content for a TP consistency check, without pickling whole PIL objects."""
    if images is None:
        return None
    if isinstance(images, (list, tuple)):
        return [_by_content(x) for x in images]
    if hasattr(images, "tobytes") and hasattr(images, "mode") and hasattr(images, "size"):
        return ("image", images.mode, tuple(images.size), images.tobytes())
    return images


def generate_check_value(
    prompts: Any, sampling_params: Any, prompt_token_ids: Any, image_data: Any, state: EngineState
) -> tuple[Any, ...]:
    """What must be equal on every rank of a TP group before a ``generate`` reaches the engine
    (``EngineBase._check_consistent``). The engine state is part of it: a rank that is asleep while the others
    generate would leave them waiting in the engine's collectives forever."""
    return ("generate", prompts, sampling_params, prompt_token_ids, _by_content(image_data), state)


_ARGUMENTS = {
    "_apply_weights": ("bucket", "session"),
    "_bucket_cost": ("tensor", "session"),
    "_finish_weights": ("session",),
}
"""The hooks that take the load's session, and their arguments after ``self``."""


def check_hook_signatures(cls: type) -> None:
    """Refuse, when ``cls`` is defined, a hook of ``_ARGUMENTS`` it defines with too few arguments (written before
    the hooks took the load's session): a clear error at import instead of a TypeError inside the first load."""
    import inspect

    for name, wanted in _ARGUMENTS.items():
        hook = vars(cls).get(name)
        if hook is None or not callable(hook):
            continue
        params = list(inspect.signature(hook).parameters.values())[1:]
        if any(p.kind is p.VAR_POSITIONAL for p in params):
            continue
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) < len(wanted):
            raise TypeError(
                f"{cls.__qualname__}.{name} takes ({', '.join(['self', *(p.name for p in positional)])}); "
                f"EngineBase calls it as {name}(self, {', '.join(wanted)}): the load's LoadSession comes last "
                "(its mode and pass_on; docs/plugins.md, 'The hooks a backend may override')"
            )
