"""Our requests → SGLang's request fields, and SGLang's output dicts → ``GenerationResult``.

Pure Python: SGLang's formats are those of ``sglang/srt/managers/io_struct.py`` (``GenerateReqInput``) and
``tokenizer_manager.py`` (output dicts: ``text``, ``output_ids``, ``prompt_token_ids``, ``meta_info`` with
``finish_reason`` and ``output_token_logprobs`` as ``(logprob, token_id, text)`` triples).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from genengine.backend import FinishReason, GenerationOutput, GenerationResult, Request, SamplingParams
from genengine.errors import InvalidArgumentError
from genengine_sglang.errors import SGLangEngineError
from genengine_sglang.settings import LOGIT_PROCESSOR_PARAM

__all__ = [
    "SEEDED_TOP_K",
    "SglEntry",
    "build_entries",
    "finish_from_sglang",
    "logprobs_from_triples",
    "output_from_sglang",
    "results_from_sglang",
    "sampling_to_sglang",
    "stream_delta",
]


SEEDED_TOP_K = (1 << 30) - 1
"""Below SGLang's "whole vocabulary" marker (``TOP_K_ALL = 1 << 30``), above any vocabulary: masks nothing."""


def sampling_to_sglang(
    params: SamplingParams, *, deterministic: bool, sample: int = 0, drawn_seed: int | None = None
) -> tuple[dict[str, Any], bool]:
    """SGLang's ``sampling_params`` dict for one sample of a request, and whether it needs our filter.

    ``n`` is expanded by the caller (one SGLang request per sample, all the same prompt), so sample ``j``
    of a seeded request uses seed ``seed + j``: reproducible, and the samples differ. SGLang honours seeds
    only in deterministic mode (``enable_deterministic_inference``); otherwise they are dropped (the engine
    warns once). Top-k/top-p with a temperature go through our logit filter (SGLang's own stay off), which
    makes the returned logprobs the processed ones. SGLang's ``ignore_eos`` also disables
    ``stop_token_ids`` (``schedule_batch.py``, ``_check_token_based_finish``); the contract keeps them, so
    with ``ignore_eos`` they are not sent and ``results_from_sglang`` cuts the output at the first one.

    ``drawn_seed`` is the seed the engine drew for an unseeded sampled request in deterministic mode (only there:
    ``build_entries`` decides): SGLang gives every unseeded row seed 42 there
    (``SamplingBatchInfo.from_schedule_batch``), so a GRPO group (one prompt repeated) would sample one completion
    n times. It goes to SGLang as a seed, on SGLang's usual path.
    """
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": float(params.temperature),
        "ignore_eos": params.ignore_eos,
        "n": 1,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids and not params.ignore_eos:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None and deterministic:
        out["sampling_seed"] = params.seed + sample
        if not params.greedy:
            # SGLang samples a seeded row on one of two paths, chosen per batch: over the vocabulary when no row
            # needs top-k/top-p, over the sorted probabilities otherwise (a greedy row is top_k=1), and the same
            # seed picks different tokens on the two. A top-k that keeps every token puts the row on the sorted
            # path in every batch, so its samples no longer depend on the other requests.
            out["top_k"] = SEEDED_TOP_K
    elif drawn_seed is not None:
        out["sampling_seed"] = drawn_seed + sample
    top_k = params.top_k_or_none
    use_filter = not params.greedy and (top_k is not None or params.top_p < 1.0)
    if use_filter:
        out["custom_params"] = {LOGIT_PROCESSOR_PARAM: {"t": float(params.temperature), "k": top_k, "p": params.top_p}}
    return out, use_filter


@dataclass(frozen=True)
class SglEntry:
    """One SGLang request: sample ``sample`` of request ``request``."""

    request: int
    sample: int
    params: dict[str, Any]
    use_filter: bool
    logprobs: bool
    drawn_seed: int | None = None
    """The seed drawn for the request when it has none (``sampling_to_sglang``): a continuation keeps it."""


def build_entries(
    requests: Sequence[Request],
    *,
    deterministic: bool,
    has_tokenizer: bool,
    draw_seed: Callable[[], int] | None = None,
) -> list[SglEntry]:
    """One entry per (request, sample), in request order; checks what SGLang cannot do in this setup.
    ``draw_seed`` gives each unseeded sampled request its seed in deterministic mode (``sampling_to_sglang``)."""
    entries = []
    for req in requests:
        if not has_tokenizer:
            if req.prompt is not None:
                raise InvalidArgumentError(
                    "text prompts need the tokenizer, but the engine was created with skip_tokenizer_init=True: "
                    "pass prompt_token_ids, or create the engine with skip_tokenizer_init=False"
                )
            if req.params.stop:
                raise InvalidArgumentError(
                    f"stop={list(req.params.stop)!r}: stop strings need the tokenizer (skip_tokenizer_init=True); "
                    "use stop_token_ids"
                )
        drawn = None
        if deterministic and draw_seed is not None and req.params.seed is None and not req.params.greedy:
            drawn = draw_seed()
        for j in range(req.params.n):
            sgl, use_filter = sampling_to_sglang(req.params, deterministic=deterministic, sample=j, drawn_seed=drawn)
            entries.append(SglEntry(req.index, j, sgl, use_filter, req.params.logprobs, drawn))
    return entries


Decode = Callable[[list[int]], str]


def _cut_at_stop_id(output: GenerationOutput, params: SamplingParams, decode: Decode | None) -> GenerationOutput:
    """With ``ignore_eos``, the stop ids SGLang could not apply: cut after the first one, as SGLang would."""
    for k, token in enumerate(output.token_ids):
        if token in params.stop_token_ids:
            kept = output.token_ids[: k + 1]
            return GenerationOutput(
                token_ids=kept,
                text=decode(kept[:-1]) if decode is not None and output.text is not None else None,
                finish_reason="stop",
                logprobs=output.logprobs[: k + 1] if output.logprobs is not None else None,
                stop_reason=token,
            )
    return output


def finish_from_sglang(reason: Any, params: SamplingParams) -> tuple[FinishReason, str | int | None]:
    """SGLang's ``meta_info["finish_reason"]`` of a finished request → our finish reason and stop reason.

    An abort is SGLang's own (a request SGLang refused or failed: ours are mapped by the caller) and raises.
    """
    if not isinstance(reason, Mapping):
        raise SGLangEngineError(f"SGLang returned no finish reason for a finished request: {reason!r}")
    kind = reason.get("type")
    if kind == "length":
        return "length", None
    if kind == "stop":
        matched = reason.get("matched")
        if isinstance(matched, str):
            return "stop", matched
        if isinstance(matched, int) and matched in params.stop_token_ids:
            return "stop", matched
        return "stop", None  # EOS (not asked for by the caller) reports None
    if kind == "abort":
        message = reason.get("message") or "aborted"
        raise SGLangEngineError(f"SGLang aborted the request: {message}")
    raise SGLangEngineError(f"SGLang returned an unknown finish reason {reason!r}")


def logprobs_from_triples(triples: Any, token_ids: Sequence[int]) -> list[float]:
    """The logprobs of ``token_ids`` from SGLang's ``(logprob, token_id, text)`` triples, checked one to one."""
    if triples is None or len(triples) != len(token_ids):
        raise SGLangEngineError(
            f"SGLang returned {0 if triples is None else len(triples)} logprobs for {len(token_ids)} tokens"
        )
    for (_, tok, _), want in zip(triples, token_ids, strict=True):
        if tok != want:
            raise SGLangEngineError(f"SGLang's logprob entries name token {tok} where the output has {want}")
    return [float(lp) for lp, _, _ in triples]


def output_from_sglang(out: Mapping[str, Any], params: SamplingParams) -> GenerationOutput:
    meta = out.get("meta_info") or {}
    token_ids = [int(t) for t in out.get("output_ids") or []]
    finish, stop_reason = finish_from_sglang(meta.get("finish_reason"), params)
    logprobs = logprobs_from_triples(meta.get("output_token_logprobs"), token_ids) if params.logprobs else None
    return GenerationOutput(
        token_ids=token_ids,
        text=out.get("text"),
        finish_reason=finish,
        logprobs=logprobs,
        stop_reason=stop_reason,
    )


def stream_delta(out: Mapping[str, Any], seen: int, *, logprobs: bool) -> tuple[list[int], list[float] | None, int]:
    """The tokens (and logprobs) of a streamed chunk that are new after the ``seen`` already taken, and the
    request's token count after it.

    SGLang's chunks come in three shapes (``tokenizer_manager.py``): cumulative ``output_ids`` and logprobs
    (the default; intermediate chunks hold references to the request's growing lists, so they are read by
    position up to the chunk's own ``completion_tokens``), deltas (server option
    ``incremental_streaming_output``, several queued deltas coalesced into one), and the echo of an abort in the
    waiting queue (``_handle_abort_req``: only the last token, but the full logprob list). Reading positions
    ``seen:total``, or the last ``total - seen`` entries of a shorter list, is right for all three.
    """
    meta = out.get("meta_info") or {}
    ids = [int(t) for t in out.get("output_ids") or ()]
    total = meta.get("completion_tokens")
    if isinstance(total, bool) or not isinstance(total, int):
        total = seen + len(ids)
    count = total - seen
    if count <= 0:
        return [], [] if logprobs else None, max(total, seen)
    triples = list(meta.get("output_token_logprobs") or ()) if logprobs else []

    def take(items: list[Any]) -> list[Any] | None:
        if len(items) >= total:
            return items[seen:total]
        if len(items) >= count:
            return items[len(items) - count :]
        return None

    new_ids = take(ids)
    new_triples = take(triples) if logprobs else None
    if new_ids is None:
        if new_triples is None:
            return [], [] if logprobs else None, total  # tokens SGLang did not send: nobody saw them
        new_ids = [int(tok) for _, tok, _ in new_triples]
    if not logprobs:
        return new_ids, None, total
    return new_ids, logprobs_from_triples(new_triples, new_ids), total


def results_from_sglang(
    requests: Sequence[Request],
    entries: Sequence[SglEntry],
    outputs: Sequence[Mapping[str, Any]],
    decode: Decode | None = None,
) -> list[GenerationResult]:
    """Group SGLang's per-sample outputs back into one result per request; ``decode`` (token ids → text,
    special tokens skipped) re-derives the text of outputs cut at a stop id under ``ignore_eos``."""
    if len(outputs) != len(entries):
        raise SGLangEngineError(f"SGLang returned {len(outputs)} outputs for {len(entries)} requests")
    by_request: dict[int, list[GenerationOutput]] = {req.index: [] for req in requests}
    prompt_ids: dict[int, list[int]] = {}
    params = {req.index: req.params for req in requests}
    for entry, out in zip(entries, outputs, strict=True):
        p = params[entry.request]
        output = output_from_sglang(out, p)
        if p.ignore_eos and p.stop_token_ids:
            output = _cut_at_stop_id(output, p, decode)
        by_request[entry.request].append(output)
        if entry.request not in prompt_ids:
            ids = out.get("prompt_token_ids")
            prompt_ids[entry.request] = [int(t) for t in ids] if ids is not None else []
    results = []
    for req in requests:
        ids = prompt_ids.get(req.index) or (list(req.prompt_token_ids) if req.prompt_token_ids is not None else [])
        results.append(GenerationResult(prompt_token_ids=ids, outputs=by_request[req.index]))
    return results
