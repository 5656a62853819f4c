"""Everything a backend plugin needs, in one import (as ``import llm`` is for llm's plugins).

``from genengine.backend import EngineBase, Completion, ...`` gives the base class, the data it speaks, the
errors, the hook marker, and the bookkeeping every engine adapter otherwise writes again: the weight list
of a loaded model, the stop/EOS rules, per-request seeds, option checks and a ``from_config`` factory; and
for the async calls, ``AsyncEngineBase`` (an ``EngineBase`` that serves them too) with the request objects
its hooks report into and the ``DriverLock`` a driver thread shares with callers; and what an engine that
owns processes needs: the checkpoint readers, scoped environment changes, exit hooks and the process's
live-engine tracking. Backend plugins import the core only from here (and ``genengine.distributed``;
tests/core/test_import_hygiene.py holds them to it). The module imports no torch (helpers that need it import
it when called), so a plugin module may import it.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from genengine.config import EngineConfig, check_options, option_bool, option_int, option_number
from genengine.engine.aio import (
    PAUSE_MODES,
    AsyncEngineBase,
    AsyncRequest,
    DriverLock,
    PauseMode,
    RequestStream,
    StreamChunk,
    normalize_async_request,
)
from genengine.engine.base import EngineBase, LoadSession
from genengine.engine.checkpoint import checkpoint_dtype, read_model_config, resolve_model_dir, vocab_size, weight_spec
from genengine.engine.environ import ALLOC_CONF, scoped_environ, strip_expandable_segments
from genengine.engine.ipc import dumps as ipc_dumps
from genengine.engine.lifecycle import ExitHandle, at_exit, live_engines, track_engine, untrack_engine
from genengine.errors import (
    BackendImportError,
    CheckpointError,
    CollectiveTimeoutError,
    ConfigError,
    DistributedSetupError,
    EngineClosedError,
    EngineSleepingError,
    EngineStateError,
    GenEngineError,
    InconsistentInputsError,
    InvalidArgumentError,
    WeightLoadError,
    WeightsNotLoadedError,
    closest,
)
from genengine.hookspecs import RegisterBackend, hookimpl
from genengine.integrations.lightrft import REFERENCE_DTYPES, check_reference_args
from genengine.plugins.versions import (
    ALLOW_UNVERIFIED_ENV,
    ALLOW_UNVERIFIED_OPTION,
    VerifiedRange,
    VersionStatus,
    check_engine_version,
    installed_version,
)
from genengine.protocol import (
    TAG_KV_CACHE,
    TAG_WEIGHTS,
    AsyncGenerationEngine,
    EngineState,
    FinishReason,
    GenerationEngine,
    GenerationOutput,
    GenerationResult,
    GenerationStream,
    LoadReport,
    SamplingParams,
    is_async_engine,
)
from genengine.requests import Request
from genengine.weights import DEFAULT_BUCKET_BYTES, WeightInfo

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALLOC_CONF",
    "ALLOW_UNVERIFIED_ENV",
    "ALLOW_UNVERIFIED_OPTION",
    "DEFAULT_BUCKET_BYTES",
    "PAUSE_MODES",
    "REFERENCE_DTYPES",
    "TAG_KV_CACHE",
    "TAG_WEIGHTS",
    "AsyncEngineBase",
    "AsyncGenerationEngine",
    "AsyncRequest",
    "BackendImportError",
    "CheckpointError",
    "CollectiveTimeoutError",
    "Completion",
    "ConfigError",
    "Decode",
    "DistributedSetupError",
    "DriverLock",
    "EngineBase",
    "EngineClosedError",
    "EngineConfig",
    "EngineSleepingError",
    "EngineState",
    "EngineStateError",
    "ExitHandle",
    "FinishReason",
    "FromConfig",
    "GenEngineError",
    "GenerationEngine",
    "GenerationOutput",
    "GenerationResult",
    "GenerationStream",
    "InconsistentInputsError",
    "InvalidArgumentError",
    "LoadReport",
    "LoadSession",
    "PauseMode",
    "RegisterBackend",
    "Request",
    "RequestStream",
    "SamplingParams",
    "Seeds",
    "StopStrings",
    "StreamChunk",
    "VerifiedRange",
    "VersionStatus",
    "WeightInfo",
    "WeightLoadError",
    "WeightsNotLoadedError",
    "at_exit",
    "check_device",
    "check_engine_version",
    "check_options",
    "check_reference_args",
    "closest",
    "complete",
    "hookimpl",
    "installed_version",
    "ipc_dumps",
    "is_async_engine",
    "live_engines",
    "module_weight_spec",
    "normalize_async_request",
    "option_bool",
    "option_int",
    "option_number",
    "read_model_config",
    "resolve_model_dir",
    "sample_seed",
    "scoped_environ",
    "strip_expandable_segments",
    "text_decoder",
    "torch_dtype",
    "track_engine",
    "untrack_engine",
    "vocab_size",
    "weight_spec",
]

Decode = Callable[[list[int]], str]
"""Token ids → the output's text (special tokens skipped), as every backend decodes it."""

_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_STOP_CONTEXT = 4
"""Tokens decoded before the new ones when looking for stop strings: a decoder may treat the first token of
what it decodes specially (SentencePiece drops its leading space), so the new text is read off a decode that
starts this many tokens earlier, minus that earlier part."""


# ---- configuration ----------------------------------------------------------------------------------------
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


def torch_dtype(dtype: str, model_dir: str) -> torch.dtype:
    """``EngineConfig.dtype`` as a torch dtype; "auto" is what ``config.json`` names (float32 if nothing)."""
    import torch

    if dtype == "auto":
        dtype = checkpoint_dtype(read_model_config(model_dir)) or "float32"
    found: torch.dtype = getattr(torch, dtype)
    return found


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


# ---- weights ----------------------------------------------------------------------------------------------
def module_weight_spec(module: torch.nn.Module, *, buffers: bool = True) -> dict[str, WeightInfo]:
    """``_weight_spec`` of a loaded torch model: every HF name of its state dict (only its parameters without
    ``buffers``), with the shape and dtype it has now.

    A name that is a second alias of a parameter already listed (a tied ``lm_head.weight``) is optional, as
    in ``genengine.engine.checkpoint.weight_spec``: trainers' ``state_dict()`` carries it, but need not send it.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    source = module.state_dict() if buffers else params
    seen: set[int] = set()
    spec: dict[str, WeightInfo] = {}
    for name, tensor in source.items():
        param = params.get(name)
        required = param is None or id(param) not in seen
        spec[name] = WeightInfo(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), required=required)
        if param is not None:
            seen.add(id(param))
    return spec


# ---- seeds ------------------------------------------------------------------------------------------------
def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed``: stable across runs and machines."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{index}".encode()).digest()[:8], "little") & (2**63 - 1)


class Seeds:
    """Seeds for requests: a request's own ``seed`` when it has one, else a draw from a stream seeded by
    ``EngineConfig.seed``, so that a whole run is reproducible from the config."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def request(self, params: SamplingParams) -> int:
        """One seed for all ``n`` samples of a request (an engine drawing them one after another from it)."""
        return params.seed if params.seed is not None else self._rng.getrandbits(63)

    def sample(self, params: SamplingParams, index: int) -> int:
        """The seed of sample ``index`` alone: samples then do not depend on each other or the batch."""
        return sample_seed(params.seed, index) if params.seed is not None else self._rng.getrandbits(63)


# ---- text and stop rules ----------------------------------------------------------------------------------
def _plain_decode(tokenizer: Any) -> Callable[..., str]:
    """``tokenizer.decode``, or the Rust tokenizer's own where transformers' wrapper adds nothing to it.

    Half the cost of a stop-string check is the wrapper (issue 15). It only forwards to the Rust tokenizer
    when neither method is overridden and the space clean-up is off, so the text is the same.
    """
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # older transformers (the GPU images)
        return tokenizer.decode  # type: ignore[no-any-return]
    cls = type(tokenizer)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    )
    return tokenizer._tokenizer.decode if plain else tokenizer.decode  # type: ignore[no-any-return]


def text_decoder(tokenizer: Any) -> Decode:
    """``tokenizer.decode(ids, skip_special_tokens=True)`` of a Hugging Face tokenizer: an output's text."""
    decode = _plain_decode(tokenizer)

    def text(ids: list[int]) -> str:
        return str(decode(ids, skip_special_tokens=True))

    return text


class StopStrings:
    """Finds a row's stop strings as tokens come, decoding a few recent tokens instead of the whole output.

    The rule is the full-decode one: stop after the first token at which ``decode(tokens)`` contains a stop
    string, and cut that text before the earliest one. Decoding everything at every step made long outputs
    quadratic (issue 15). Since the text one token earlier held no stop string, a new one ends in the new
    text, so only the new text and the ``longest - 1`` characters before it are searched.

    The full text up to the last step that ended on a whole character is taken as settled; only its last
    characters are kept (``_tail``). The text after it is a decode from token ``_start`` (``_STOP_CONTEXT``
    or more tokens before that step, where there are any) minus ``_anchor``, what the same decode read at that
    step. A hit found there is decided on the full decode, which also gives the returned text; so is every
    step where the window no longer starts with ``_anchor`` (a decoder that rewrote text behind the newest
    token, as transformers' space clean-up does, or a multi-byte character completed). Settling only
    on whole characters spares a character that arrives in pieces that full decode.
    """

    def __init__(self, decode: Decode, stops: Sequence[str]) -> None:
        self._decode = decode
        self._stops = tuple(stops)
        self._keep = max(len(s) for s in self._stops) - 1
        self._start = 0
        self._anchor = self._tail = ""

    def check(self, tokens: list[int]) -> tuple[str, str] | None:
        """After each new token: (the stop string, the text before it) once the full text holds one, else None."""
        count = len(tokens)
        window = self._decode(tokens[self._start : count])
        if window.startswith(self._anchor):
            searched = self._tail + window[len(self._anchor) :]
            if not any(s in searched for s in self._stops):
                if not window.endswith("\ufffd"):  # a whole character: settle the text up to here
                    self._tail = searched[max(0, len(searched) - self._keep) :]
                    if count - self._start >= 2 * _STOP_CONTEXT:
                        self._start = count - _STOP_CONTEXT
                        window = self._decode(tokens[self._start : count])
                    self._anchor = window
                return None
        text = self._decode(tokens)
        hits = [(text.find(s), s) for s in self._stops if s in text]
        if hits:
            cut, stop = min(hits)
            return stop, text[:cut]
        self._tail = text[max(0, len(text) - self._keep) :]  # no hit after all: settle on the full text
        self._start = max(0, count - _STOP_CONTEXT)
        self._anchor = self._decode(tokens[self._start : count])
        return None


class Completion:
    """One sample as it is generated: ``add`` each new token, and the contract's stop rules say when it ends.

    The rules, in vLLM's order: an EOS id (unless ``ignore_eos``) ends it with ``stop_reason`` None; an id of
    ``stop_token_ids`` ends it with that id; a stop string ends it once the decoded text holds one; after
    ``max_new_tokens`` tokens it ends with "length". ``token_ids`` keep the token that ended it; the text
    leaves out an EOS or stop token and is cut before a stop string. Without ``decode`` there is no text
    (None) and no stop-string check.
    """

    __slots__ = ("_decode", "_eos", "_stops", "finish_reason", "logprobs", "params", "stop_reason", "text", "tokens")

    def __init__(
        self, params: SamplingParams, *, eos_token_ids: Iterable[int] = (), decode: Decode | None = None
    ) -> None:
        self.params = params
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.text: str | None = None
        self._eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._decode = decode
        self._stops: StopStrings | None = None

    def add(self, token: int, logprob: float) -> bool:
        """Record the next token and its logprob; True while the sample goes on."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        p = self.params
        if token in self._eos:
            self.finish_reason = "stop"
        elif token in p.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token
        if self.finish_reason is not None:
            self.text = self._text(self.tokens[:-1])
            return False
        if p.stop and self._decode is not None:
            if self._stops is None:
                self._stops = StopStrings(self._decode, p.stop)
            hit = self._stops.check(self.tokens)
            if hit is not None:
                self.finish_reason = "stop"
                self.stop_reason, self.text = hit
                return False
        if len(self.tokens) >= p.max_new_tokens:
            self.finish_reason = "length"
            self.text = self._text(self.tokens)
            return False
        return True

    def abort(self) -> None:
        """End the sample now, from outside (``abort``): it keeps its tokens, and the text is theirs."""
        if self.finish_reason is None:
            self.finish_reason, self.text = "abort", self._text(self.tokens)

    def _text(self, ids: list[int]) -> str | None:
        return None if self._decode is None else self._decode(ids)

    def output(self) -> GenerationOutput:
        """The sample as ``generate`` returns it; one the engine ended early (its context full) ends "length"."""
        if self.finish_reason is None:
            self.finish_reason, self.text = "length", self._text(self.tokens)
        return GenerationOutput(
            token_ids=self.tokens,
            text=self.text,
            finish_reason=self.finish_reason,
            logprobs=self.logprobs if self.params.logprobs else None,
            stop_reason=self.stop_reason,
        )


def complete(
    steps: Iterable[tuple[int, float]],
    params: SamplingParams,
    *,
    eos_token_ids: Iterable[int] = (),
    decode: Decode | None = None,
) -> GenerationOutput:
    """Read (token, logprob) pairs from an engine's stream until the stop rules end the sample (see ``Completion``)."""
    out = Completion(params, eos_token_ids=eos_token_ids, decode=decode)
    for token, logprob in steps:
        if not out.add(token, logprob):
            break
    return out.output()
