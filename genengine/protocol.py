"""The ``GenerationEngine`` protocol, its async extension ``AsyncGenerationEngine``, and the data they speak.

This module is the contract (docs/contract.md says the same in prose). It imports nothing heavy:
trainers type against it and ``import genengine`` stays fast.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeGuard, runtime_checkable

from genengine.adapters import check_adapter_name
from genengine.errors import InvalidArgumentError, closest

if TYPE_CHECKING:
    from types import TracebackType

    import torch

__all__ = [
    "PAUSE_MODES",
    "TAG_KV_CACHE",
    "TAG_WEIGHTS",
    "AsyncGenerationEngine",
    "EngineState",
    "FinishReason",
    "GenerationEngine",
    "GenerationOutput",
    "GenerationResult",
    "GenerationStream",
    "LoadReport",
    "PauseMode",
    "SamplingParams",
    "StreamChunk",
    "SupportsLoadSessions",
    "WeightLoadSession",
    "is_async_engine",
]

TAG_WEIGHTS = "weights"
TAG_KV_CACHE = "kv_cache"

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "wait", "keep"]
"""What ``pause_generation`` does with requests in flight (docs/async.md)."""
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")


def _show(value: Any) -> str:
    """``repr(value)`` for an error message; an int too long to print as text is described instead."""
    try:
        return repr(value)
    except ValueError:  # Python refuses to print ints of more than 4300 digits
        return f"<an int of {value.bit_length()} bits>"


def plain_scalar(value: Any) -> Any:
    """A numpy scalar or 0-d numpy/torch array as the Python number (or bool) it holds; anything else as is.

    Duck-typed (``.tolist()`` and ``.dtype``) so that neither numpy nor torch is imported here.
    """
    if hasattr(value, "tolist") and hasattr(value, "dtype"):
        plain = value.tolist()
        if not isinstance(plain, list):
            return plain
    return value


def _real(name: str, value: Any, allowed: str) -> float:
    """``value`` as a finite float: any real number (``np.float32`` too), not a bool, a string or NaN."""
    plain = plain_scalar(value)
    if isinstance(plain, bool) or not isinstance(plain, numbers.Real):
        raise InvalidArgumentError(f"{name}={_show(value)} is not a number; allowed: {allowed}")
    try:
        number = float(plain)
    except OverflowError:  # an int beyond float range
        number = math.inf
    if not math.isfinite(number):
        raise InvalidArgumentError(f"{name}={_show(value)} must be finite; allowed: {allowed}")
    return number


def _integer(name: str, value: Any, allowed: str) -> int:
    """``value`` as an int: any integral number (``np.int64`` too), not a bool or a float such as 2.0."""
    plain = plain_scalar(value)
    if isinstance(plain, bool) or not isinstance(plain, numbers.Integral):
        raise InvalidArgumentError(f"{name}={_show(value)} is not an integer; allowed: {allowed}")
    return int(plain)


def _count(name: str, value: Any) -> int:
    """``value`` as an int >= 1 (a number of tokens or samples)."""
    number = _integer(name, value, "an integer >= 1")
    if number < 1:
        raise InvalidArgumentError(f"{name}={number} must be >= 1")
    return number


def _flag(name: str, value: Any, extra: str = "") -> bool:
    plain = plain_scalar(value)  # np.bool_ is a bool
    if not isinstance(plain, bool):
        raise InvalidArgumentError(f"{name}={_show(value)} must be a bool (True or False){extra}")
    return plain


def _is_sequence(value: Any) -> bool:
    """A list, tuple or other ordered sequence (OmegaConf's ListConfig): not a string, mapping, set or iterator."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def as_token_ids(name: str, value: Any) -> tuple[int, ...]:
    """A 1-D sequence of token ids as a tuple of ints, or an ``InvalidArgumentError`` naming ``name``.

    Takes a list or tuple of ints (numpy integers and 0-d tensors too) or a 1-D numpy/torch array of an
    integer dtype; refuses a float or bool array, iterators, sets and mappings (a dict would give its keys).
    """
    # The common case (a trainer's list of ints), checked in C: a 64 x 128-token batch took ~9 ms through the
    # general loop below, about 1 % of a 7B generate of 128 tokens (issue 41, P1). A bad one goes the long way.
    if type(value) in (list, tuple) and value and all(type(tok) is int for tok in value) and min(value) >= 0:
        return tuple(value)
    allowed = "a list of token ids (ints >= 0) or a 1-D integer numpy/torch array"
    dtype = getattr(value, "dtype", None)
    if dtype is not None and hasattr(value, "tolist"):
        items = value.tolist()
        if not isinstance(items, list):
            raise InvalidArgumentError(f"{name}={_show(value)} is a single value, not a list; allowed: {allowed}")
        if any(isinstance(i, list) for i in items):
            shape = tuple(getattr(value, "shape", ()))
            raise InvalidArgumentError(f"{name} is an array of shape {shape}; allowed: {allowed}")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            raise InvalidArgumentError(
                f"{name} is an array of dtype {dtype}: token ids must be integers; allowed: {allowed}"
            )
        value = items
    if not _is_sequence(value):
        raise InvalidArgumentError(f"{name}={_show(value)} ({type(value).__name__}) is not {allowed}")
    ids = []
    for tok in value:
        plain = plain_scalar(tok)
        if isinstance(plain, bool) or not isinstance(plain, numbers.Integral) or plain < 0:
            raise InvalidArgumentError(f"{name} holds {_show(tok)}: token ids are ints >= 0")
        ids.append(int(plain))
    return tuple(ids)


UNSUPPORTED_SAMPLING_PARAMS: Mapping[str, str] = {
    # the same setting under another engine's name
    "max_tokens": "it is vLLM's name: use max_new_tokens",
    "max_completion_tokens": "it is OpenAI's name: use max_new_tokens",
    "sampling_seed": "it is SGLang's name: use seed",
    "return_logprob": "it is SGLang's name: use logprobs=True",
    # settings genengine fixes for every backend
    "skip_special_tokens": "text is always decoded with special tokens skipped (token_ids keep them)",
    "spaces_between_special_tokens": "text is always decoded by the tokenizer's defaults",
    "detokenize": "text is always decoded",
    "include_stop_str_in_output": "text is always cut before the stop string (token_ids keep its tokens)",
    "no_stop_trim": "text is always cut before the stop string (token_ids keep its tokens)",
    "flat_logprobs": "logprobs=True returns one float per sampled token",
    "top_logprobs_num": "only the sampled token's logprob is returned: use logprobs=True",
    "prompt_logprobs": "only the sampled tokens' logprobs are returned: use logprobs=True",
    "output_kind": "generate returns whole completions, never a stream",
    "stream_interval": "generate returns whole completions, never a stream",
    # sampling features genengine does not offer
    "min_tokens": "there is no minimum length (ignore_eos=True turns EOS off entirely)",
    "min_new_tokens": "there is no minimum length (ignore_eos=True turns EOS off entirely)",
    "best_of": "sample n completions and pick the best yourself",
    "use_beam_search": "there is no beam search",
    "length_penalty": "there is no beam search",
    "min_p": "use top_p or top_k",
    "presence_penalty": "there are no penalties",
    "frequency_penalty": "there are no penalties",
    "repetition_penalty": "there are no penalties",
    "logit_bias": "logits cannot be changed",
    "allowed_token_ids": "logits cannot be changed",
    "bad_words": "logits cannot be changed",
    "logits_processors": "logits cannot be changed",
    "custom_params": "logits cannot be changed",
    "custom_logit_processor": "logits cannot be changed",
    "truncate_prompt_tokens": "truncate the prompt yourself",
    "regex": "there is no constrained decoding",
    "stop_regex": "there is no constrained decoding; stop takes plain strings",
    "json_schema": "there is no constrained decoding",
    "ebnf": "there is no constrained decoding",
    "structural_tag": "there is no constrained decoding",
    "guided_decoding": "there is no constrained decoding",
    "structured_outputs": "there is no constrained decoding",
    "extra_args": "there is no place for engine-specific sampling arguments",
}
"""vLLM and SGLang sampling parameters that ``SamplingParams`` does not take, with what to do instead.

Named in the error for an unknown sampling parameter, so that a vLLM or SGLang user gets the real answer rather than
the nearest spelling of one of our fields (``min_tokens`` is not ``max_new_tokens``).
"""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt's completions. Validated on construction, so bad values never reach an engine.

    ``temperature=0`` is greedy. ``top_k`` is off when None or -1. ``stop`` strings end a completion
    (the text is cut before the stop string; the token that completed it stays in ``token_ids``);
    ``stop_token_ids`` (and EOS unless ``ignore_eos``) end it with that token kept in ``token_ids``.
    ``logprobs=True`` returns the processed log-probability of each sampled token. ``adapter`` names a LoRA
    adapter loaded with ``load_adapter`` to generate with (None: the base model).
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
    adapter: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalised values (np.float32 → float, list → tuple) are set here
        set_(self, "max_new_tokens", _count("max_new_tokens", self.max_new_tokens))
        temperature = _real("temperature", self.temperature, "a number >= 0 (0 is greedy)")
        if temperature < 0:
            raise InvalidArgumentError(f"temperature={_show(self.temperature)} must be >= 0 (0 is greedy)")
        set_(self, "temperature", temperature)
        top_p = _real("top_p", self.top_p, "a number in (0, 1]")
        if not 0 < top_p <= 1:
            raise InvalidArgumentError(f"top_p={_show(self.top_p)} must be in (0, 1]")
        set_(self, "top_p", top_p)
        if self.top_k is not None:
            allowed = "None or -1 (off) or an integer >= 1"
            top_k = _integer("top_k", self.top_k, allowed)
            if top_k != -1 and top_k < 1:
                raise InvalidArgumentError(f"top_k={top_k} must be {allowed}")
            set_(self, "top_k", top_k)
        set_(self, "n", _count("n", self.n))
        if self.seed is not None:
            set_(self, "seed", _integer("seed", self.seed, "None or an integer"))
        vllm_logprobs = " (only the sampled token's logprob is returned: vLLM's logprobs=0)"
        set_(self, "logprobs", _flag("logprobs", self.logprobs, vllm_logprobs))
        set_(self, "ignore_eos", _flag("ignore_eos", self.ignore_eos))
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        allowed = "a non-empty string or a list/tuple of non-empty strings"
        if not _is_sequence(stop):
            raise InvalidArgumentError(f"stop={_show(self.stop)} ({type(self.stop).__name__}) is not {allowed}")
        if not all(isinstance(s, str) and s for s in stop):
            raise InvalidArgumentError(f"stop={_show(self.stop)} must be {allowed}")
        set_(self, "stop", tuple(stop))
        ids = () if self.stop_token_ids is None else as_token_ids("stop_token_ids", self.stop_token_ids)
        set_(self, "stop_token_ids", ids)
        set_(self, "adapter", None if self.adapter is None else check_adapter_name(self.adapter))

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
                key = unknown[0]
                instead = UNSUPPORTED_SAMPLING_PARAMS.get(key) if isinstance(key, str) else None
                if instead is not None:
                    what = f"vLLM/SGLang sampling parameter {key!r} is not supported by genengine: {instead}"
                else:
                    hint = closest(str(key), names)
                    what = f"unknown sampling parameter {key!r}" + (f" (did you mean {hint!r}?)" if hint else "")
                raise InvalidArgumentError(f"{what}; allowed: {', '.join(names)}")
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
    weight_versions: tuple[tuple[int, int], ...] = ()
    """``(token index, weight version)`` pairs, in order: the version that sampled the tokens from that index
    on (one pair unless a ``load_weights`` landed while the request was paused with ``keep``)."""


@dataclass(frozen=True)
class GenerationResult:
    """All completions of one prompt, in the order of the prompts given to ``generate``."""

    prompt_token_ids: list[int]
    outputs: list[GenerationOutput]


@dataclass(frozen=True)
class StreamChunk:
    """New tokens of one completion of one request, as the engine produced them."""

    request_id: str
    index: int
    """Which of the request's ``n`` completions."""
    token_ids: list[int]
    logprobs: list[float] | None
    weight_version: int
    """The weight version these tokens were sampled with."""
    finish_reason: FinishReason | None = None
    """Set on the completion's last chunk (which may carry no tokens)."""


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
        """Take memory back for ``tags`` (all when None), in ``supported_tags`` order.

        A no-op when those tags are awake, and for an empty list (a trainer's computed tag list may be empty).
        """
        ...

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int | None = None,
        check_finite: bool = False,
        version: int | None = None,
    ) -> LoadReport:
        """Copy the trainer's (HF name, tensor) pairs into the engine in buckets of at most ``bucket_bytes``.

        Tensors may be views, any floating dtype, or DTensors (gathered, a collective on every rank); meta,
        sparse and freed tensors are refused. Each bucket's names, shapes, dtypes and kinds are checked
        before anything of it is written (a dict, list or tuple: the whole call before the first write);
        ``check_finite`` also refuses NaN/inf values (off by default: it reads every tensor). The prefix
        cache is flushed afterwards. If the call fails once writing began, the engine refuses to generate
        until a ``load_weights`` covers every weight.

        ``version`` (an int >= 0) labels the weights from here on: ``weight_version`` and the
        ``weight_versions`` of later outputs say it; None keeps the current label. Every engine takes it, so
        that a transport can label the last bucket of a sync without asking whether the engine can.
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


@runtime_checkable
class WeightLoadSession(Protocol):
    """One weight load written bucket by bucket, as a transport receives it: ``write`` each bucket, then
    ``commit`` once. The engine flushes its cache and takes the ``version`` label at the commit, not per bucket.

    A failed ``write`` or ``commit`` ends the session by ``load_weights``' rule: before the first tensor was
    written the old weights stay whole, after it the engine refuses to generate until a load covers every
    weight. As a context manager, an error in the block (or leaving it without ``commit``) aborts it.
    """

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Check one bucket's (name, tensor) pairs as ``load_weights`` does (a name written twice in one
        session is refused) and write them."""
        ...

    def commit(self) -> LoadReport:
        """End the load: one cache flush, then the session's ``version``; the report covers every write."""
        ...

    def abort(self, exc: BaseException | None = None) -> None:
        """End the load without committing (``exc``: why, for the engine's refusal message); the version stays."""
        ...

    def __enter__(self) -> WeightLoadSession: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class SupportsLoadSessions(Protocol):
    """An engine that loads through sessions (every ``EngineBase`` does). Not part of ``GenerationEngine``: an
    engine with only ``load_weights`` stays valid, and transports fall back to one ``load_weights`` a bucket."""

    def begin_load(self, *, check_finite: bool = False, version: int | None = None) -> WeightLoadSession:
        """Open a load session (``check_finite`` and ``version`` as for ``load_weights``). While it is open,
        generate, sleep, wake and other loads raise ``EngineStateError`` naming it; only one is open at a time."""
        ...


@runtime_checkable
class GenerationStream(Protocol):
    """One request submitted with ``AsyncGenerationEngine.stream``: an async iterator of its chunks, then its
    result. ``genengine.engine.aio.RequestStream`` (an engine's) and the Ray pool's ``PoolStream`` are two."""

    @property
    def request_id(self) -> str: ...

    def __aiter__(self) -> GenerationStream: ...

    async def __anext__(self) -> StreamChunk:
        """The next chunk of new tokens of one completion; the stream ends after every completion's last one."""
        ...

    async def collect(self) -> GenerationResult:
        """Read the chunks not read yet and return the result; a caller cancelled meanwhile aborts the request."""
        ...

    def result(self) -> GenerationResult:
        """Every completion with its tokens, logprobs and weight versions; only once the stream has ended."""
        ...

    async def aclose(self) -> None:
        """Stop reading: a request still running is aborted."""
        ...


@runtime_checkable
class AsyncGenerationEngine(GenerationEngine, Protocol):
    """A ``GenerationEngine`` that also takes requests one prompt at a time, streams them, aborts them, and
    pauses for a weight update (docs/async.md).

    ``genengine.engine.aio.AsyncEngineBase`` implements it over a backend's scheduler; the Ray ``EnginePool`` over
    its replicas. Ask :func:`is_async_engine`, not ``isinstance``, whether an engine offers it.
    """

    supports_async: ClassVar[bool]
    """True: the declaration :func:`is_async_engine` reads (``AsyncEngineBase`` and the pool make it)."""

    @property
    def weight_version(self) -> int:
        """The version of the weights in force: the last ``load_weights(version=...)``, 0 at start."""
        ...

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished: running, held by a ``keep`` pause, or queued during a pause."""
        ...

    @property
    def paused(self) -> PauseMode | None:
        """The mode of the pause in force, or None."""
        ...

    def stream(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        image_data: Any = None,
        request_id: str | None = None,
    ) -> GenerationStream:
        """Submit one prompt (not a batch); iterate the returned stream for its chunks as they come, then read
        ``result()``. Closing the stream early aborts the request. A ``request_id`` in flight is refused."""
        ...

    async def generate_async(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        image_data: Any = None,
        request_id: str | None = None,
    ) -> GenerationResult:
        """One prompt's completions once all are finished (an aborted one with its partial tokens)."""
        ...

    async def abort(self, request_ids: str | Sequence[str] | None = None) -> list[str]:
        """Abort requests (every one in flight when None); returns the ids aborted. An aborted request keeps
        its tokens and their logprobs, with ``finish_reason="abort"``."""
        ...

    async def pause_generation(self, mode: PauseMode = "keep", *, clear_cache: bool = True) -> None:
        """Stop generating so that the weights can change; requests submitted meanwhile wait for the resume.

        ``"abort"``: in-flight requests end now; ``"wait"``: returns once they finished on their own;
        ``"keep"``: they stay where they are and go on after ``resume_generation`` (their KV recomputed with
        the new weights when ``clear_cache``).
        """
        ...

    async def resume_generation(self) -> None:
        """Go on after ``pause_generation``: held requests continue, queued ones start. Raises (and stays
        paused) while the engine is asleep or its weights are incomplete."""
        ...


def is_async_engine(engine: object) -> TypeGuard[AsyncGenerationEngine]:
    """Whether ``engine`` offers the async calls: whether it declares ``supports_async = True``.

    The one place genengine asks. It reads the declaration rather than ``isinstance(engine,
    AsyncGenerationEngine)``: a structural check only sees that the names exist (a synchronous engine with a
    ``stream`` method of its own would pass), on Python 3.10 and 3.11 it evaluates every property of the
    protocol (a pool's ``state`` asks each replica), and on 3.12+ it misses attributes a wrapper forwards
    through ``__getattr__``. Third-party backends that implement the calls without ``AsyncEngineBase``
    declare it too.
    """
    return bool(getattr(engine, "supports_async", False))
