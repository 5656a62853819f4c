"""The ``GenerationEngine`` protocol and the data it speaks.

This module is the contract (docs/contract.md says the same in prose). It imports nothing heavy:
trainers type against it and ``import genengine`` stays fast.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from genengine.errors import InvalidArgumentError, closest

if TYPE_CHECKING:
    from types import TracebackType

    import torch

__all__ = [
    "TAG_KV_CACHE",
    "TAG_WEIGHTS",
    "EngineState",
    "FinishReason",
    "GenerationEngine",
    "GenerationOutput",
    "GenerationResult",
    "LoadReport",
    "SamplingParams",
]

TAG_WEIGHTS = "weights"
TAG_KV_CACHE = "kv_cache"

FinishReason = Literal["stop", "length"]


def _check_number(name: str, value: Any, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise InvalidArgumentError(f"{name}={value!r} is not {kind}")
    if not integer and not math.isfinite(value):
        raise InvalidArgumentError(f"{name}={value!r} must be finite")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt's completions. Validated on construction, so bad values never reach an engine.

    ``temperature=0`` is greedy. ``top_k`` is off when None or -1. ``stop`` strings end a completion
    (the text is cut before the stop string; the token that completed it stays in ``token_ids``);
    ``stop_token_ids`` (and EOS unless ``ignore_eos``) end it with that token kept in ``token_ids``.
    ``logprobs=True`` returns the processed log-probability of each sampled token.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None
    logprobs: bool = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_number("max_new_tokens", self.max_new_tokens, integer=True)
        if self.max_new_tokens <= 0:
            raise InvalidArgumentError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidArgumentError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k is not None:
            _check_number("top_k", self.top_k, integer=True)
            if self.top_k != -1 and self.top_k < 1:
                raise InvalidArgumentError(f"top_k={self.top_k} must be None or -1 (off) or an integer >= 1")
        _check_number("n", self.n, integer=True)
        if self.n < 1:
            raise InvalidArgumentError(f"n={self.n} must be >= 1")
        if self.seed is not None:
            _check_number("seed", self.seed, integer=True)
        for flag in ("logprobs", "ignore_eos"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidArgumentError(f"{flag}={getattr(self, flag)!r} must be a bool")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if stop is None:
            stop = ()
        if not isinstance(stop, Iterable) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidArgumentError(f"stop={self.stop!r} must be a string or a sequence of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        if not isinstance(ids, Iterable) or isinstance(ids, (str, bytes)):
            raise InvalidArgumentError(f"stop_token_ids={ids!r} must be a sequence of token ids (int >= 0)")
        ids = tuple(ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise InvalidArgumentError(f"stop_token_ids={ids!r} must be a sequence of token ids (int >= 0)")
        object.__setattr__(self, "stop_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def top_k_or_none(self) -> int | None:
        """``top_k`` with both spellings of "off" folded into None."""
        return None if self.top_k in (None, -1) else self.top_k

    @classmethod
    def coerce(cls, value: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        """Accept an instance, a plain mapping of field names (trainer configs), or None for defaults."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            names = [f.name for f in fields(cls)]
            unknown = [k for k in value if k not in names]
            if unknown:
                hint = closest(str(unknown[0]), names)
                raise InvalidArgumentError(
                    f"unknown sampling parameter {unknown[0]!r}"
                    + (f" (did you mean {hint!r}?)" if hint else "")
                    + f"; allowed: {', '.join(names)}"
                )
            return cls(**dict(value))
        raise InvalidArgumentError(f"sampling_params={value!r} must be a SamplingParams, a mapping, or a list of them")


@dataclass(frozen=True)
class GenerationOutput:
    """One sampled completion."""

    token_ids: list[int]
    text: str | None
    finish_reason: FinishReason
    logprobs: list[float] | None = None
    """Processed log-probability of each token in ``token_ids`` (same length), if asked for."""
    stop_reason: str | int | None = None
    """The stop string or token id that ended the completion; None for EOS or length."""


@dataclass(frozen=True)
class GenerationResult:
    """All completions of one prompt, in the order of the prompts given to ``generate``."""

    prompt_token_ids: list[int]
    outputs: list[GenerationOutput]


@dataclass(frozen=True)
class LoadReport:
    """What one ``load_weights`` call did; the numbers trainers log per step."""

    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float


@dataclass(frozen=True)
class EngineState:
    """A snapshot of the sleep/wake state machine."""

    released_tags: frozenset[str] = field(default_factory=frozenset)
    sleep_level: int | None = None
    weights_loaded: bool = True
    """False after a level-2 sleep or a failed load, until a ``load_weights`` covers every weight."""
    closed: bool = False

    @property
    def is_sleeping(self) -> bool:
        return bool(self.released_tags)


@runtime_checkable
class GenerationEngine(Protocol):
    """What a trainer needs from a rollout engine that shares its GPUs.

    Cycle of one RL step: ``generate`` → ``sleep`` (trainer steps) → ``wake(["weights"])`` →
    ``load_weights`` → ``wake(["kv_cache"])``. Waking weights before KV cache avoids the peak that
    OOMs when both come back at once; ``load_weights`` flushes the prefix cache so no stale KV serves
    new weights.
    """

    @property
    def supported_tags(self) -> tuple[str, ...]:
        """Memory tags ``wake`` accepts, weights first (e.g. ``("weights", "kv_cache")``)."""
        ...

    @property
    def state(self) -> EngineState: ...

    @property
    def is_sleeping(self) -> bool: ...

    def generate(
        self,
        prompts: Sequence[str] | None = None,
        sampling_params: SamplingParams | Mapping[str, Any] | Sequence[Any] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        image_data: Sequence[Any] | None = None,
    ) -> list[GenerationResult]:
        """Complete every prompt; results come back in prompt order, ``n`` outputs each.

        Give text ``prompts`` or ``prompt_token_ids``, not both. Raises ``EngineSleepingError`` while
        asleep and ``WeightsNotLoadedError`` after a level-2 sleep until weights are loaded again.
        """
        ...

    def sleep(self, level: int = 1) -> None:
        """Release GPU memory: level 1 keeps weights in host memory, level 2 discards them.

        Returns only when the memory is really free. Sleeping while asleep is a no-op.
        """
        ...

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Take memory back for ``tags`` (all when None), in ``supported_tags`` order. No-op when awake."""
        ...

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int | None = None
    ) -> LoadReport:
        """Copy the trainer's (HF name, tensor) pairs into the engine in bounded buckets.

        Each bucket's names, shapes and dtypes are checked before anything of it is written; the prefix
        cache is flushed afterwards. If the stream fails after a bucket was written, the engine refuses
        to generate until a ``load_weights`` covers every weight.
        """
        ...

    def flush_cache(self) -> None:
        """Drop cached prefixes/KV so nothing computed with old weights is reused."""
        ...

    def shutdown(self) -> None:
        """Free every resource and wait until GPU memory is back. Idempotent."""
        ...

    def __enter__(self) -> GenerationEngine: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
