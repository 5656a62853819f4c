"""Turning ``generate``'s flexible arguments into one validated request list, once for every backend."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from genengine.adapters import Adapter
from genengine.errors import InvalidArgumentError
from genengine.protocol import SamplingParams, as_token_ids, plain_scalar

__all__ = ["Request", "normalize_requests"]


@dataclass(frozen=True)
class Request:
    """One prompt and how to sample it; exactly one of ``prompt`` and ``prompt_token_ids`` is set."""

    index: int
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    image: Any = None
    lora: Adapter | None = None
    """The adapter ``params.adapter`` names, bound by the engine when it takes the request (None: the base)."""

    @staticmethod
    def adapter_handles(requests: Sequence[Request], indices: Sequence[int]) -> list[Any] | None:
        """The engine's handle of the adapter bound to each entry (entry ``k`` belongs to the request of index
        ``indices[k]``; None for the base), or None when no request has one: what an engine's batch call takes
        (vLLM's ``lora_request`` list, SGLang's ``lora_path`` list)."""
        by_index = {r.index: r for r in requests}
        handles = [None if (lora := by_index[i].lora) is None else lora.handle for i in indices]
        return handles if any(h is not None for h in handles) else None


def _as_list(name: str, value: Any) -> list[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidArgumentError(f"{name} must be a list, got {type(value).__name__}")
    return list(value)


def _token_rows(value: Any) -> list[Any]:
    """``prompt_token_ids`` as a list of rows: a list, or a 2-D numpy/torch integer array (``.tolist()``)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None or not hasattr(value, "tolist"):
        return _as_list("prompt_token_ids", value)
    rows = value.tolist()
    if not isinstance(rows, list):
        raise InvalidArgumentError("prompt_token_ids is a 0-d array: give a list of token-id lists or a 2-D array")
    leaves = [t for row in rows for t in (row if isinstance(row, list) else [row])]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in leaves):
        raise InvalidArgumentError(
            f"prompt_token_ids is an array of dtype {dtype}: token ids must be integers (ints >= 0)"
        )
    return rows


def _is_token(value: Any) -> bool:
    plain = plain_scalar(value)
    return isinstance(plain, numbers.Integral) and not isinstance(plain, bool)


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

    A bare string is one prompt. ``prompt_token_ids`` may also be a 2-D numpy/torch integer array or a list of
    1-D ones (trainers hold token ids as tensors); they become tuples of ints. ``sampling_params`` is one value
    for all prompts or a list with one per prompt. Raises ``InvalidArgumentError`` naming the bad value;
    nothing else happens on error.
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
        raw = _token_rows(prompt_token_ids)
        if not raw:
            raise InvalidArgumentError("prompt_token_ids is empty: give at least one prompt")
        if all(_is_token(t) for t in raw):
            raise InvalidArgumentError(
                "prompt_token_ids must be a list of token-id lists; wrap a single prompt as [[...]]"
            )
        ids = []
        for i, row in enumerate(raw):
            seq = as_token_ids(f"prompt_token_ids[{i}]", row)
            if not seq:
                raise InvalidArgumentError(f"prompt_token_ids[{i}] is empty")
            if vocab_size is not None and max(seq) >= vocab_size:  # the first one out is named
                for tok in seq:
                    if tok >= vocab_size:
                        raise InvalidArgumentError(
                            f"prompt_token_ids[{i}] holds {tok}, outside the vocabulary [0, {vocab_size})"
                        )
            ids.append(seq)
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
