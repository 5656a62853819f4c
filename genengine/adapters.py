"""LoRA adapters in the contract: their config, the checks every engine makes before writing one, what a load
returns, and the ``SupportsAdapters`` protocol an engine that serves them speaks.

An adapter is loaded from (name, tensor) pairs as PEFT names them (``get_peft_model_state_dict``:
``base_model.model.<module>.lora_A.weight`` and ``.lora_B.weight``) with its ``LoraConfig`` (or the same
fields as a mapping), then served per request (``SamplingParams(adapter=name)``). Everything here is checked
against the engine's weight spec (a module's ``.weight`` is ``[out, in]``, so ``lora_A`` must be
``[r, in]`` and ``lora_B`` ``[out, r]``) before any tensor reaches the engine: a bad adapter is refused whole
and the engine keeps serving the one it had. It imports nothing heavy (torch only when a tensor is checked).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from genengine.errors import InvalidArgumentError, WeightLoadError, closest

if TYPE_CHECKING:
    import torch

    from genengine.weights import WeightInfo

__all__ = [
    "ALL_LINEAR",
    "Adapter",
    "AdapterConfig",
    "AdapterInfo",
    "SupportsAdapters",
    "check_adapter",
    "check_adapter_name",
    "supports_adapters",
]

ALL_LINEAR = "all-linear"
"""PEFT's ``target_modules`` spelling for "every linear layer but the output head"."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@:-]{0,127}")
_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_UNSUPPORTED = {
    "use_dora": "DoRA adapters are not served",
    "use_rslora": "rank-stabilised scaling is not served (train with use_rslora=False)",
    "target_parameters": "LoRA on parameters (target_parameters, fused MoE experts) is not served",
}
_HEADS = ("lm_head", "embed_out", "output")


def check_adapter_name(name: object) -> str:
    """An adapter name: 1-128 characters of letters, digits and ``_ . @ : -``, starting with a letter or digit."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"adapter name {name!r}: allowed are 1-128 characters of letters, digits and _ . @ : -, "
            "starting with a letter or digit"
        )
    return name


def _positive_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{what}={value!r} must be an integer >= 1")
    return value


@dataclass(frozen=True)
class AdapterConfig:
    """What an engine needs of a PEFT ``LoraConfig``: the rank, the scale, the modules the adapter targets.

    ``target_modules`` are module-name suffixes as PEFT takes them (``("q_proj", "v_proj")``) or
    ``"all-linear"``; the effective scale is ``lora_alpha / r``.
    """

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str

    def __post_init__(self) -> None:
        _positive_int("r", self.r)
        alpha = self.lora_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
            raise InvalidArgumentError(f"lora_alpha={alpha!r} must be a number > 0")
        object.__setattr__(self, "lora_alpha", float(alpha))
        targets = self.target_modules
        if targets == ALL_LINEAR:
            return
        if isinstance(targets, str):
            raise InvalidArgumentError(
                f"target_modules={targets!r}: a regular expression is not served; give a list of module names "
                f"(e.g. ['q_proj', 'v_proj']) or {ALL_LINEAR!r}"
            )
        if not isinstance(targets, (list, tuple, set, frozenset)) or not targets:
            raise InvalidArgumentError(
                f"target_modules={targets!r} must be a non-empty list of module names or {ALL_LINEAR!r}"
            )
        if not all(isinstance(t, str) and t and "." not in t for t in targets):
            raise InvalidArgumentError(f"target_modules={targets!r} must hold module names such as 'q_proj'")
        object.__setattr__(self, "target_modules", tuple(sorted(targets)))

    @property
    def scaling(self) -> float:
        """What ``lora_B @ lora_A`` is multiplied by: ``lora_alpha / r``."""
        return self.lora_alpha / self.r

    @classmethod
    def coerce(cls, value: object) -> AdapterConfig:
        """An ``AdapterConfig``, a PEFT ``LoraConfig`` (or any object with its fields), or a mapping of them
        (``adapter_config.json``). PEFT features the engines do not serve are refused by name."""
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            get = value.get
        elif all(hasattr(value, a) for a in ("r", "lora_alpha", "target_modules")):

            def get(key: str, default: Any = None) -> Any:
                return getattr(value, key, default)
        else:
            raise InvalidArgumentError(
                f"adapter config {value!r}: give a peft LoraConfig, an AdapterConfig, or a mapping with "
                "r, lora_alpha and target_modules"
            )
        for key, why in _UNSUPPORTED.items():
            if get(key, False):
                raise InvalidArgumentError(f"adapter config {key}={get(key)!r}: {why}")
        for key in ("rank_pattern", "alpha_pattern"):
            if get(key, None):
                raise InvalidArgumentError(f"adapter config {key}={get(key)!r}: per-module ranks are not served")
        if get("modules_to_save", None):
            raise InvalidArgumentError(
                f"adapter config modules_to_save={get('modules_to_save')!r}: fully trained modules are not "
                "adapter weights; sync them with load_weights (or the merge path)"
            )
        if get("bias", "none") not in (None, "none"):
            raise InvalidArgumentError(f"adapter config bias={get('bias')!r}: only bias='none' is served")
        targets = get("target_modules", None)
        if isinstance(targets, (set, frozenset)):
            targets = tuple(sorted(targets))
        return cls(r=get("r", None), lora_alpha=get("lora_alpha", None), target_modules=targets)


@dataclass(frozen=True)
class AdapterInfo:
    """What one ``load_adapter`` loaded: the numbers a trainer logs, and the label its outputs carry."""

    name: str
    version: int
    """The ``weight_versions`` label of outputs generated with this adapter."""
    r: int
    modules: tuple[str, ...]
    """The base model's module paths the adapter changes."""
    num_tensors: int
    num_bytes: int
    seconds: float = 0.0
    phases: Mapping[str, float] = field(default_factory=dict, compare=False)
    """Where ``seconds`` went, by step (``check_s``, the backend's own steps such as ``write_folder_s`` or
    ``add_lora_s``, ``retire_s``): host-side seconds, GPU work may finish in a later step. A key without ``_s`` is
    a backend's flag, not seconds (SGLang's ``flatten_reused``: 1.0 when the load reused a shared-memory buffer)."""


_serial = itertools.count(1)


@dataclass(eq=False)
class Adapter:
    """One checked adapter, as an engine holds it: requests bound to it keep it until they finish, so a
    replacement under the same name never changes a request in flight. Compared by identity."""

    name: str
    version: int
    config: AdapterConfig
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Module path (the base weight's name without ``.weight``) → ``(lora_A [r, in], lora_B [out, r])``."""
    uid: int = field(default_factory=lambda: next(_serial))
    handle: Any = None
    """What the backend made of it (device copies, the engine's own id); set by the backend's ``_add_adapter``."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of each step of its load (``AdapterInfo.phases``); the backend's ``_add_adapter`` adds its own."""

    def info(self, seconds: float = 0.0) -> AdapterInfo:
        tensors = [t for pair in self.pairs.values() for t in pair]
        return AdapterInfo(
            name=self.name,
            version=self.version,
            r=self.config.r,
            modules=tuple(self.pairs),
            num_tensors=len(tensors),
            num_bytes=sum(int(t.numel()) * int(t.element_size()) for t in tensors),
            seconds=seconds,
            phases=dict(self.phases),
        )


def _module_of(key: str) -> tuple[str, str]:
    """A PEFT state-dict key as (module path in the base model, "A" or "B")."""
    stripped = key[len(_PEFT_PREFIX) :] if key.startswith(_PEFT_PREFIX) else key
    if stripped.endswith((".lora_A.weight", ".lora_B.weight")) and len(stripped) > 14:  # the usual names, fast
        return stripped[:-14], stripped[-8]
    match = _LORA_KEY.match(stripped)
    if match is None:
        raise WeightLoadError(
            f"adapter tensor {key!r} is not a LoRA weight: expected '<module>.lora_A.weight' or "
            "'<module>.lora_B.weight' (PEFT's get_peft_model_state_dict names)"
        )
    return match["module"], match["part"]


def _linear_modules(spec: Mapping[str, WeightInfo]) -> dict[str, tuple[int, int]]:
    """Module path → (out, in) of every 2-D ``.weight`` of the base model."""
    return {
        name[: -len(".weight")]: (info.shape[0], info.shape[1])
        for name, info in spec.items()
        if name.endswith(".weight") and len(info.shape) == 2
    }


def _targeted(config: AdapterConfig, linear: Mapping[str, tuple[int, int]]) -> set[str]:
    if config.target_modules == ALL_LINEAR:
        return {m for m in linear if m.rpartition(".")[2] not in _HEADS and "embed" not in m.rpartition(".")[2]}
    return {m for m in linear if m.rpartition(".")[2] in config.target_modules}


def check_adapter(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    config: AdapterConfig,
    spec: Mapping[str, WeightInfo],
    *,
    max_rank: int,
    servable: Sequence[str] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter's ``lora_A``/``lora_B`` pairs by module path, or a ``WeightLoadError`` naming what is wrong.

    Checked against the base model's ``spec``: the rank (at most ``max_rank``), every target module names a
    linear layer the model has and the engine can adapt (``servable``: module-name suffixes, None for any),
    every tensor belongs to a targeted module, each module has both halves, in the shapes its weight asks for,
    of a floating dtype. Reads no tensor data.
    """
    import torch

    if config.r > max_rank:
        raise WeightLoadError(f"adapter rank r={config.r} is over the engine's max_lora_rank={max_rank}")
    linear = _linear_modules(spec)
    suffixes = sorted({m.rpartition(".")[2] for m in linear})
    if config.target_modules != ALL_LINEAR:
        for target in config.target_modules:
            if target not in suffixes:
                hint = closest(target, suffixes)
                raise WeightLoadError(
                    f"adapter target module {target!r} is not a linear layer of the model"
                    + (f" (did you mean {hint!r}?)" if hint else "")
                    + f"; the model has {', '.join(suffixes)}"
                )
    if servable is not None:
        bad = sorted({m.rpartition(".")[2] for m in _targeted(config, linear)} - set(servable))
        if bad:
            raise WeightLoadError(
                f"adapter target module(s) {', '.join(bad)}: this engine serves adapters on {', '.join(servable)}"
            )
    targeted = _targeted(config, linear)
    if isinstance(named_tensors, (str, bytes)) or not isinstance(named_tensors, (Iterable, Mapping)):
        raise InvalidArgumentError(
            f"an adapter is (name, tensor) pairs or a mapping of them, got {type(named_tensors).__name__}"
        )
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise InvalidArgumentError(f"adapter entry {item!r} is not a (name, tensor) pair")
        key, tensor = item
        module, part = _module_of(key)
        if module not in linear:
            raise WeightLoadError(f"adapter tensor {key!r}: the model has no linear layer {module!r}")
        if module not in targeted:
            raise WeightLoadError(
                f"adapter tensor {key!r}: module {module!r} is not in the config's target_modules "
                f"{config.target_modules!r}"
            )
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta or tensor.layout != torch.strided:
            raise WeightLoadError(f"adapter tensor {key!r} must be a dense tensor with data, got {type(tensor)}")
        if not tensor.is_floating_point():
            raise WeightLoadError(f"adapter tensor {key!r} has dtype {tensor.dtype}; a floating dtype is required")
        out_features, in_features = linear[module]
        want = (config.r, in_features) if part == "A" else (out_features, config.r)
        if tuple(tensor.shape) != want:
            raise WeightLoadError(
                f"adapter tensor {key!r} has shape {tuple(tensor.shape)}; with r={config.r} the model's "
                f"{module}.weight {[out_features, in_features]} asks for {list(want)}"
            )
        if part in halves.setdefault(module, {}):
            raise WeightLoadError(f"adapter tensor {key!r} is given twice")
        halves[module][part] = tensor
    if not halves:
        raise WeightLoadError("the adapter has no tensors")
    for module, parts in halves.items():
        if len(parts) != 2:
            missing = "lora_B" if "A" in parts else "lora_A"
            raise WeightLoadError(f"adapter module {module!r} has no {missing} tensor")
    return {module: (parts["A"], parts["B"]) for module, parts in sorted(halves.items())}


@runtime_checkable
class SupportsAdapters(Protocol):
    """An engine that serves LoRA adapters per request. Not part of ``GenerationEngine``: ask
    :func:`supports_adapters` (the declaration), not ``isinstance``."""

    supports_adapters: ClassVar[bool]

    @property
    def max_lora_rank(self) -> int:
        """The largest adapter rank the engine takes."""
        ...

    @property
    def adapters(self) -> Mapping[str, AdapterInfo]:
        """The adapters loaded now, by name."""
        ...

    def load_adapter(
        self,
        name: str,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        config: Any,
        *,
        version: int | None = None,
    ) -> AdapterInfo:
        """Check the whole adapter, then load it under ``name`` (replacing one of that name: requests in flight
        finish under the adapter they started with). ``version`` labels its outputs' ``weight_versions``
        (None: the replaced adapter's version, or 0). A refused adapter changes nothing."""
        ...

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name`` (requests in flight with it finish); later requests naming it are refused."""
        ...


def supports_adapters(engine: object) -> bool:
    """Whether ``engine`` declares that it serves adapters (``supports_adapters = True``)."""
    return bool(getattr(engine, "supports_adapters", False))
