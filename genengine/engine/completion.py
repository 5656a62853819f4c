"""One sample as an engine generates it: its seed, its text, and the contract's stop rules.

Every adapter otherwise writes these again, and gets them subtly different from the others: ``Completion``
(one token at a time) and ``complete`` (a whole stream) apply EOS, stop ids, stop strings and
``max_new_tokens`` in vLLM's order; ``text_decoder`` is an output's text; ``Seeds`` makes a run reproducible
from ``EngineConfig.seed``. Imports no torch; ``text_decoder`` reads transformers' classes when called.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from genengine.protocol import FinishReason, GenerationOutput, SamplingParams

__all__ = ["Completion", "Decode", "Seeds", "StopStrings", "complete", "sample_seed", "text_decoder"]

Decode = Callable[[list[int]], str]
"""Token ids → the output's text (special tokens skipped), as every backend decodes it."""

_STOP_CONTEXT = 4
"""Tokens decoded before the new ones when looking for stop strings: a decoder may treat the first token of
what it decodes specially (SentencePiece drops its leading space), so the new text is read off a decode that
starts this many tokens earlier, minus that earlier part."""


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
