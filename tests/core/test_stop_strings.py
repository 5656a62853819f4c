"""Stop strings are checked on a short window of recent tokens (issue 15); the results must be exactly those
of the plain rule: stop after the first token at which the full decode contains a stop string.

The rule is checked on random token sequences under three kinds of decoder (byte-level BPE as Qwen2's,
byte fallback with a stripped leading space as Llama 2's, WordPiece with transformers' space clean-up, which
rewrites text behind the newest token), and end to end through the engine.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from genengine import SamplingParams
from genengine.backends.transformers.engine import TransformersEngine
from genengine.engine.completion import StopStrings as _StopStrings
from genengine.models.tiny_model import tiny_model_dir
from genengine.testing.conformance import PROMPTS

_CORPUS = [
    "héllo wörld, it's a test. don't stop — 日本語のテキスト 🙂 naïve café ' quoted ' text",
    "the quick brown fox jumps over the lazy dog ... isn't it? ümlaut ß € 💡 ok",
]
_SAMPLE = "x é 日本 🙂 it ' s a test . isn ' t ß€"
"""Multi-byte characters (2, 3 and 4 bytes in UTF-8) and the clean-up's patterns, cut into tokens."""

Decode = Callable[[list[int]], str]
Hit = tuple[int, str, str]


def _full_decode_rule(decode: Decode, tokens: list[int], stops: tuple[str, ...]) -> Hit | None:
    """The definition: (tokens kept, stop string, text before it), decoding everything after every token."""
    for k in range(1, len(tokens) + 1):
        text = decode(tokens[:k])
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            cut, stop = min(hits)
            return k, stop, text[:cut]
    return None


def _incremental(decode: Decode, tokens: list[int], stops: tuple[str, ...]) -> Hit | None:
    """The engine's checker, fed one token at a time as the decode loop does."""
    checker = _StopStrings(decode, stops)
    for k in range(1, len(tokens) + 1):
        hit = checker.check(tokens[:k])
        if hit is not None:
            return k, hit[0], hit[1]
    return None


def _byte_fallback_tokenizer() -> Any:
    """Llama 2's decoder: SentencePiece spaces, <0xNN> byte tokens fused into characters, one leading space cut."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(_CORPUS * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False
    )


def _cleanup_tokenizer() -> Any:
    """WordPiece with transformers' clean-up: "it '" becomes "it's" when "s" comes, rewriting text behind it."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)
    tok.train_from_iterator(_CORPUS * 20, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", "[SEP]"]))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", clean_up_tokenization_spaces=True
    )


def _tiny_tokenizer() -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir())


_TOKENIZERS: dict[str, Callable[[], Any]] = {
    "byte-level": _tiny_tokenizer,
    "byte-fallback": _byte_fallback_tokenizer,
    "cleanup": _cleanup_tokenizer,
}


def _random_tokens(rnd: random.Random, tokenizer: Any, pieces: list[int]) -> list[int]:
    """Random ids (stray bytes of multi-byte characters included), runs of real text, special tokens."""
    tokens: list[int] = []
    while len(tokens) < rnd.randint(10, 50):
        roll = rnd.random()
        if roll < 0.55:
            tokens.append(rnd.randrange(len(tokenizer)))
        elif roll < 0.9:
            start = rnd.randrange(len(pieces))
            tokens += pieces[start : start + rnd.randint(1, 8)]
        else:
            tokens.append(rnd.choice(tokenizer.all_special_ids))
    return tokens


def _random_stops(rnd: random.Random, decode: Decode, tokens: list[int]) -> tuple[str, ...]:
    """Mostly strings spanning a token boundary of this very text, so that many cases stop, at any point."""
    stops: list[str] = []
    for _ in range(rnd.randint(1, 3)):
        roll = rnd.random()
        k = rnd.randint(2, len(tokens))
        before, upto = decode(tokens[: k - 1]), decode(tokens[:k])
        if roll < 0.6 and upto:
            end = rnd.randint(max(1, min(len(before), len(upto) - 1) + 1), len(upto))
            stops.append(upto[max(0, end - rnd.randint(2, 6)) : end])  # ends in token k's text, starts before
        elif roll < 0.8:
            start = rnd.randrange(len(_SAMPLE) - 1)
            stops.append(_SAMPLE[start : start + rnd.randint(1, 3)])
        elif roll < 0.9:
            stops.append("\ufffd")  # the replacement character an unfinished multi-byte character decodes to
        else:
            stops.append("\x00never\x00")
    return tuple(dict.fromkeys(s for s in stops if s))


@pytest.mark.parametrize("kind", list(_TOKENIZERS))
def test_window_check_equals_the_full_decode_rule(kind: str) -> None:
    tokenizer = _TOKENIZERS[kind]()

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    pieces = list(tokenizer.encode(_SAMPLE, add_special_tokens=False))
    rnd = random.Random(f"stop-strings/{kind}")
    stopped = spanning = 0
    cases = 400
    for case in range(cases):
        tokens = _random_tokens(rnd, tokenizer, pieces)
        stops = _random_stops(rnd, decode, tokens)
        if not stops:
            continue
        want = _full_decode_rule(decode, tokens, stops)
        assert _incremental(decode, tokens, stops) == want, (case, tokens, stops)
        if want is not None:
            stopped += 1
            k, _, text = want
            spanning += len(text) < len(decode(tokens[: k - 1]))  # starts before the last token's text
    # The cases are varied: most stop, at all sorts of points, many on a string that spans tokens.
    assert cases // 2 < stopped < cases, stopped
    assert spanning > cases // 4, spanning


# ---- through the engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine() -> Iterator[TransformersEngine]:
    eng = TransformersEngine(tiny_model_dir(), dtype="float32")
    with eng:
        yield eng


def test_engine_stops_where_the_full_decode_rule_does(engine: TransformersEngine) -> None:
    """Seeded samples (batch-invariant, so a run with stops repeats the run without them up to the stop)."""

    def decode(ids: list[int]) -> str:
        return str(engine.tokenizer.decode(ids, skip_special_tokens=True))

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
    free = [
        SamplingParams(temperature=0.0 if i % 3 == 0 else 1.3, max_new_tokens=48, ignore_eos=True, seed=i)
        for i in range(len(prompts))
    ]
    unstopped = [r.outputs[0].token_ids for r in engine.generate(prompts, free)]
    rnd = random.Random("engine-stops")
    stops = [_random_stops(rnd, decode, tokens) or ("\x00never\x00",) for tokens in unstopped]
    stops[-1] = ("\x00never\x00",)
    got = engine.generate(prompts, [dataclasses.replace(p, stop=s) for p, s in zip(free, stops, strict=True)])
    stopped = 0
    for tokens, stop, result in zip(unstopped, stops, got, strict=True):
        (out,) = result.outputs
        want = _full_decode_rule(decode, tokens, stop)
        if want is None:
            assert (out.token_ids, out.finish_reason, out.stop_reason) == (tokens, "length", None)
            assert out.text == decode(tokens)
        else:
            stopped += 1
            k, reason, text = want
            assert (out.token_ids, out.finish_reason, out.stop_reason, out.text) == (tokens[:k], "stop", reason, text)
    assert stopped >= len(prompts) // 2, stopped
