"""Our protocol's types ↔ vLLM's, as plain functions of plain data.

``SamplingParams`` → ``vllm.SamplingParams`` keyword arguments, ``image_data`` → vLLM's
``multi_modal_data``, vLLM's ``RequestOutput`` → ``GenerationResult``. Nothing here imports vLLM or torch,
so every mapping is checked on a CPU machine, and every bad value fails before a request is queued.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from genengine.backend import FinishReason, GenerationOutput, GenerationResult, SamplingParams
from genengine.errors import EngineStateError, InvalidArgumentError

__all__ = [
    "MIN_TEMPERATURE",
    "CompletionDelta",
    "completion_delta",
    "contract_stop_reason",
    "convert_request_output",
    "int_list",
    "load_image",
    "sampled_logprobs",
    "split_greedy_n",
    "vllm_sampling_kwargs",
]

MIN_TEMPERATURE = 1e-2
"""vLLM 0.26 silently raises any temperature in (0, 0.01) to 0.01 (``sampling_params._MAX_TEMP``)."""


# ---- sampling ----------------------------------------------------------------------------------------------
def vllm_sampling_kwargs(
    params: SamplingParams, *, seed: int, detokenize: bool, n: int | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` implementing our ``params`` (see the contract).

    ``seed`` is always explicit: vLLM draws a missing seed from the process's global numpy RNG, which a
    colocated trainer also uses, so two ranks of a TP group would sample different tokens and diverge.
    Stop strings are cut from the text (``include_stop_str_in_output=False``) while the token that
    completed one stays in ``token_ids``; stop tokens and EOS stay in ``token_ids``, not in the text.
    """
    if 0 < params.temperature < MIN_TEMPERATURE:
        raise InvalidArgumentError(
            f"temperature={params.temperature} is below vLLM's minimum {MIN_TEMPERATURE} (vLLM would silently "
            "sample at 0.01, so processed logprobs would not match your temperature); use 0 for greedy or >= 0.01"
        )
    if params.stop and not detokenize:
        raise InvalidArgumentError(
            f"stop={list(params.stop)!r} needs text, but the engine was created with skip_tokenizer_init=True; "
            "use stop_token_ids"
        )
    return {
        "n": params.n if n is None else n,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": params.top_k_or_none or 0,  # vLLM: 0 disables top-k
        "max_tokens": params.max_new_tokens,
        "stop": list(params.stop) or None,
        "stop_token_ids": list(params.stop_token_ids) or None,
        "ignore_eos": params.ignore_eos,
        "seed": seed,
        "logprobs": 0 if params.logprobs else None,  # 0: only the sampled token's logprob
        "flat_logprobs": True,
        "detokenize": detokenize,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
    }


def split_greedy_n(params: SamplingParams) -> int:
    """How many single-sample vLLM requests stand for one prompt: vLLM refuses ``n > 1`` when greedy."""
    return params.n if params.greedy and params.n > 1 else 1


# ---- inputs ------------------------------------------------------------------------------------------------
def load_image(image: Any, index: int) -> Any:
    """A PIL image (or list of them) from what ``image_data`` allows: PIL images, file paths, bytes, data URIs."""
    if isinstance(image, (list, tuple)):
        return [load_image(item, index) for item in image]
    if hasattr(image, "mode") and hasattr(image, "size"):
        return image
    import base64
    import io

    from PIL import Image

    try:
        if isinstance(image, (bytes, bytearray)):
            return Image.open(io.BytesIO(bytes(image))).convert("RGB")
        if isinstance(image, str) and image.startswith("data:image"):
            return Image.open(io.BytesIO(base64.b64decode(image.split(",", 1)[1]))).convert("RGB")
        if isinstance(image, (str, os.PathLike)) and os.path.isfile(image):
            return Image.open(image).convert("RGB")
    except Exception as exc:
        raise InvalidArgumentError(f"image_data[{index}] cannot be read as an image: {exc}") from exc
    raise InvalidArgumentError(
        f"image_data[{index}]={str(image)[:80]!r} is not an image: give a PIL image, a file path, bytes or a "
        "data:image URI (nothing is downloaded)"
    )


# ---- outputs -----------------------------------------------------------------------------------------------
def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """The logprob of each sampled token, from vLLM's ``FlatLogprobs`` or its list of ``{id: Logprob}``."""
    if logprobs is None:
        raise EngineStateError("vLLM returned no logprobs although they were requested")
    n = len(token_ids)
    if len(logprobs) != n:
        raise EngineStateError(f"vLLM returned {len(logprobs)} logprob positions for {n} tokens")
    out: list[float] = []
    flat_ids = getattr(logprobs, "token_ids", None)
    if flat_ids is not None and hasattr(logprobs, "start_indices"):
        values = logprobs.logprobs
        if (
            list(flat_ids) == list(token_ids)
            and list(logprobs.start_indices) == list(range(n))
            and list(logprobs.end_indices) == list(range(1, n + 1))
        ):  # vLLM's logprobs=0 (ours): the sampled token alone at each position, compared in C, not per token
            return list(map(float, values))
        for i, tok in enumerate(token_ids):
            for j in range(logprobs.start_indices[i], logprobs.end_indices[i]):
                if flat_ids[j] == tok:
                    out.append(float(values[j]))
                    break
            else:
                raise EngineStateError(f"vLLM's logprobs at position {i} do not include the sampled token {tok}")
        return out
    for i, (tok, position) in enumerate(zip(token_ids, logprobs, strict=True)):
        entry = position.get(tok) if position is not None else None
        if entry is None:
            raise EngineStateError(f"vLLM's logprobs at position {i} do not include the sampled token {tok}")
        out.append(float(entry.logprob))
    return out


def contract_stop_reason(stop_reason: Any, params: SamplingParams) -> str | int | None:
    """vLLM's ``stop_reason`` as the contract reports it: an EOS id that is not one of ``stop_token_ids``
    (an extra EOS id of generation_config.json) is None, like EOS itself."""
    if isinstance(stop_reason, int) and stop_reason not in params.stop_token_ids:
        return None
    return cast("str | int | None", stop_reason)


def int_list(values: Sequence[Any] | None) -> list[int]:
    """``values`` as a new list of plain ints. vLLM's token ids are ints already, which one pass in C confirms:
    ``int()`` of each token was ~40 % of the time ours spends around vLLM's call at P1's 64 x 128 tokens
    (issue 41); anything else (numpy integers, bools) is converted."""
    out = list(values or ())
    return out if set(map(type, out)) <= {int} else [int(t) for t in out]


def _completion(c: Any, params: SamplingParams, *, detokenize: bool) -> GenerationOutput:
    token_ids = int_list(c.token_ids)
    reason = c.finish_reason
    if reason not in ("stop", "length"):
        raise EngineStateError(f"vLLM finished a request with finish_reason={reason!r}; no result for it")
    return GenerationOutput(
        token_ids=token_ids,
        text=c.text if detokenize else None,
        finish_reason=reason,
        logprobs=sampled_logprobs(token_ids, c.logprobs) if params.logprobs else None,
        stop_reason=contract_stop_reason(c.stop_reason, params),
    )


def convert_request_output(outputs: Sequence[Any], params: SamplingParams, *, detokenize: bool) -> GenerationResult:
    """One prompt's result from its vLLM ``RequestOutput`` (or the n single-sample ones of a greedy n > 1)."""
    completions = [c for ro in outputs for c in sorted(ro.outputs, key=lambda c: c.index)]
    if len(completions) != params.n:
        raise EngineStateError(f"vLLM returned {len(completions)} completions for n={params.n}")
    prompt_ids = outputs[0].prompt_token_ids
    return GenerationResult(
        prompt_token_ids=int_list(prompt_ids),
        outputs=[_completion(c, params, detokenize=detokenize) for c in completions],
    )


@dataclass(frozen=True)
class CompletionDelta:
    """What one streamed ``CompletionOutput`` adds to a sample."""

    token_ids: list[int]
    logprobs: list[float] | None
    """The new tokens' processed logprobs (None when not asked for)."""
    text: str
    """The new text ("" without the tokenizer); vLLM holds back text that may start a stop string."""
    finish_reason: FinishReason | None
    stop_reason: str | int | None


def completion_delta(c: Any, params: SamplingParams, *, detokenize: bool) -> CompletionDelta:
    """One ``CompletionOutput`` of a ``RequestOutputKind.DELTA`` request as the tokens it adds.

    vLLM's output processor cuts the delta's logprobs off the end of the whole list by the number of new
    tokens, so with no new token (a last output carrying only the
    finish) its ``logprobs`` are every position's: they are read only when there are tokens.
    """
    token_ids = int_list(c.token_ids)
    logprobs: list[float] | None = None
    if params.logprobs:
        logprobs = sampled_logprobs(token_ids, c.logprobs) if token_ids else []
    reason = c.finish_reason
    if reason is not None and reason not in ("stop", "length", "abort"):
        raise EngineStateError(f"vLLM finished a request with finish_reason={reason!r}; no result for it")
    return CompletionDelta(
        token_ids=token_ids,
        logprobs=logprobs,
        text=(c.text or "") if detokenize else "",
        finish_reason=cast("FinishReason | None", reason),
        stop_reason=contract_stop_reason(c.stop_reason, params) if reason is not None else None,
    )
