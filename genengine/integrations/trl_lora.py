"""A PEFT (LoRA) policy's sync to the engine, shared by the TRL trainers here (``GRPOTrainer``/``RLOOTrainer``
in :mod:`genengine.integrations.trl`, ``AsyncGRPOTrainer``'s transfer in :mod:`genengine.integrations.trl_async`).

Where the engine serves adapters (``supports_adapters``) and can serve the policy's, a sync sends only the
adapter: the base weights once, then one ``load_adapter`` per sync. Otherwise TRL's way: the adapter merged into
the base weights, the whole model sent. :func:`choose_lora_sync` makes that choice (``lora_sync``) and says why.
No TRL import here: both integrations import this module.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Literal

from genengine.adapters import AdapterConfig, supports_adapters
from genengine.errors import ConfigError, InvalidArgumentError

__all__ = [
    "ADAPTER_NAME",
    "LORA_SYNC_MODES",
    "LoraSync",
    "MergeHold",
    "SyncMode",
    "check_lora_sync",
    "choose_lora_sync",
    "is_peft_policy",
    "peft_adapter_weights",
    "peft_base_weights",
]

LoraSync = Literal["auto", "adapter", "merge"]
LORA_SYNC_MODES: tuple[LoraSync, ...] = ("auto", "adapter", "merge")
"""How a PEFT (LoRA) policy reaches the engine: ``"adapter"`` sends only the adapter (``load_adapter``), ``"merge"``
merges it into the base weights, sends the whole model and unmerges (TRL's way), ``"auto"`` the adapter where the
backend serves adapters and the adapter can be served, else the merge; each says what it chose in the log."""
SyncMode = Literal["full", "merge", "adapter"]
"""What each sync sends: the whole model (a policy without PEFT), the PEFT policy merged, or only its adapter."""
ADAPTER_NAME = "policy"
"""The name the policy's adapter is served under (``SamplingParams(adapter=...)`` of the rollouts)."""


def check_lora_sync(value: object) -> LoraSync:
    if value not in LORA_SYNC_MODES:
        raise ConfigError(f"lora_sync={value!r}: allowed are {', '.join(map(repr, LORA_SYNC_MODES))}")
    return value  # type: ignore[return-value]


def is_peft_policy(model: object) -> bool:
    """Whether ``model`` is a PEFT model (without importing peft where it is not loaded)."""
    import sys

    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def choose_lora_sync(
    policy: Any, engine: Any, lora_sync: LoraSync, *, sharded: str = ""
) -> tuple[SyncMode, AdapterConfig | None, str]:
    """``(mode, adapter config, why not the adapter)`` for a PEFT ``policy`` on ``engine``: ``"adapter"`` where
    ``lora_sync`` allows it and the engine can serve the policy's one active LoRA adapter, else ``"merge"`` with
    the reason (``sharded``: a reason the policy's sharding rules it out). ``lora_sync="adapter"`` that cannot be
    honoured raises a ``ConfigError`` naming why."""
    if lora_sync == "merge":
        return "merge", None, "lora_sync='merge'"
    why, config = "", None
    active = list(getattr(policy, "active_adapters", None) or [policy.active_adapter])
    if len(active) != 1:
        why = f"{len(active)} adapters are active ({active}); one is served"
    else:
        try:
            config = AdapterConfig.coerce(policy.peft_config[active[0]])
        except InvalidArgumentError as exc:
            why = f"its adapter cannot be served ({exc})"
    if not supports_adapters(engine):
        why = f"backend {type(engine).__name__} does not serve adapters"
    elif sharded:
        why = sharded
    elif config is not None and config.r > engine.max_lora_rank:
        why = f"the adapter's rank {config.r} is over the engine's max_lora_rank {engine.max_lora_rank}"
    if not why:
        return "adapter", config, ""
    if lora_sync == "adapter":
        raise ConfigError(f"lora_sync='adapter' but {why}; allowed: lora_sync='auto' or 'merge'")
    return "merge", None, why


def log_choice(log: logging.Logger, what: str, mode: SyncMode, why: str) -> None:
    """The one INFO line that says how a PEFT policy is synced, and why not the adapter where it is not."""
    sends = "only the adapter (load_adapter; the base once)" if mode == "adapter" else "the merged model"
    log.info("%s: PEFT policy: each sync sends %s%s", what, sends, f" ({why})" if why else "")


def peft_base_weights(policy: Any) -> Iterator[tuple[str, Any]]:
    """The base model's weights of a PEFT policy, unmerged, under the base checkpoint's names (PEFT's
    ``base_model.model.`` prefix and ``.base_layer`` dropped, the adapter's own tensors left out)."""
    for name, param in policy.named_parameters():
        if policy.prefix not in name:
            yield name.removeprefix("base_model.model.").replace(".base_layer", ""), param.detach()


def peft_adapter_weights(policy: Any) -> list[tuple[str, Any]]:
    """The active adapter's tensors as PEFT names them (``get_peft_model_state_dict``), each a copy: the engine
    may hold them while the trainer's optimizer moves the originals."""
    from peft import get_peft_model_state_dict

    tensors = get_peft_model_state_dict(policy, adapter_name=policy.active_adapter)
    return [(name, tensor.detach().clone()) for name, tensor in tensors.items()]


class MergeHold:
    """Makes a PEFT policy's ``merge_adapter``/``unmerge_adapter`` no-ops between :meth:`hold` and
    :meth:`release`: TRL 1.16's ``AsyncGRPOTrainer`` merges the adapter into the policy's base weights around
    every ``send_weights`` (its path for any custom transfer); an adapter-only sync reads the adapter instead, and a
    merge/unmerge round trip would move the trainer's base weights away from the engine's (bf16 rounding)."""

    _METHODS = ("merge_adapter", "unmerge_adapter")

    def __init__(self) -> None:
        self._held: Any = None

    def hold(self, policy: Any) -> None:
        self.release()

        def skipped(*_: Any, **__: Any) -> None:
            return None

        for method in self._METHODS:
            setattr(policy, method, skipped)  # an instance attribute: found before PeftModel's __getattr__
        self._held = policy

    def release(self) -> None:
        policy, self._held = self._held, None
        if policy is not None:
            for method in self._METHODS:
                policy.__dict__.pop(method, None)

    @property
    def held(self) -> bool:
        return self._held is not None
