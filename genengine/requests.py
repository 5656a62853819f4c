"""Turning ``generate``'s flexible arguments into one validated request list, once for every backend."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from genengine.errors import InvalidArgumentError
from genengine.protocol import SamplingParams

__all__ = ["Request", "normalize_requests"]


@dataclass(frozen=True)
class Request:
    """One prompt and how to sample it; exactly one of ``prompt`` and ``prompt_token_ids`` is set."""

    index: int
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    image: Any = None


def _as_list(name: str, value: Any) -> list[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidArgumentError(f"{name} must be a list, got {type(value).__name__}")
    return list(value)


def normalize_requests(
    prompts: str | Sequence[str] | None = None,
    sampling_params: Any = None,
    *,
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    image_data: Sequence[Any] | None = None,
    vocab_size: int | None = None,
    supports_images: bool = False,
) -> list[Request]:
    """Validate everything ``generate`` was given before any engine work starts.

    A bare string is one prompt. ``sampling_params`` is one value for all prompts or a list with one per
    prompt. Raises ``InvalidArgumentError`` naming the bad value; nothing else happens on error.
    """
    if prompts is not None and prompt_token_ids is not None:
        raise InvalidArgumentError("give either prompts (text) or prompt_token_ids, not both")
    if prompts is None and prompt_token_ids is None:
        raise InvalidArgumentError("generate needs prompts (text) or prompt_token_ids")

    texts: list[str] | None = None
    ids: list[tuple[int, ...]] | None = None
    if prompts is not None:
        texts = [prompts] if isinstance(prompts, str) else _as_list("prompts", prompts)
        if not texts:
            raise InvalidArgumentError("prompts is empty: give at least one prompt")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidArgumentError(f"prompts[{i}]={text!r} is not a string")
            if not text:
                raise InvalidArgumentError(f"prompts[{i}] is an empty string")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate: no tokenizer takes it
                raise InvalidArgumentError(
                    f"prompts[{i}] is not valid Unicode: {text[exc.start : exc.end]!r} at index {exc.start} "
                    f"({exc.reason}); prompts must be encodable as UTF-8"
                ) from None
        count = len(texts)
    else:
        raw = _as_list("prompt_token_ids", prompt_token_ids)
        if not raw:
            raise InvalidArgumentError("prompt_token_ids is empty: give at least one prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            raise InvalidArgumentError(
                "prompt_token_ids must be a list of token-id lists; wrap a single prompt as [[...]]"
            )
        ids = []
        for i, seq in enumerate(raw):
            seq = _as_list(f"prompt_token_ids[{i}]", seq)
            if not seq:
                raise InvalidArgumentError(f"prompt_token_ids[{i}] is empty")
            for tok in seq:
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                    raise InvalidArgumentError(f"prompt_token_ids[{i}] holds {tok!r}: token ids are ints >= 0")
                if vocab_size is not None and tok >= vocab_size:
                    raise InvalidArgumentError(
                        f"prompt_token_ids[{i}] holds {tok}, outside the vocabulary [0, {vocab_size})"
                    )
            ids.append(tuple(seq))
        count = len(ids)

    if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, bytes, Mapping)):
        if len(sampling_params) != count:
            raise InvalidArgumentError(
                f"sampling_params has {len(sampling_params)} entries for {count} prompts: give one, or one each"
            )
        params = [SamplingParams.coerce(p) for p in sampling_params]
    else:
        params = [SamplingParams.coerce(sampling_params)] * count

    images: list[Any] = [None] * count
    if image_data is not None:
        if not supports_images:
            raise InvalidArgumentError("this backend does not take image_data")
        images = _as_list("image_data", image_data)
        if len(images) != count:
            raise InvalidArgumentError(f"image_data has {len(images)} entries for {count} prompts")

    return [
        Request(
            index=i,
            params=params[i],
            prompt=texts[i] if texts is not None else None,
            prompt_token_ids=ids[i] if ids is not None else None,
            image=images[i],
        )
        for i in range(count)
    ]
