"""The SGLang releases this plugin supports and was verified against, and where they differ: the one place.

``SUPPORTED`` are the releases the code is written for: each has a recorded API surface
(``surfaces/VERSION.json``, made by ``tools/engine_surface.py`` from the release's wheel) that
``tests/plugins/test_engine_surfaces.py`` checks the plugin's uses (``genengine_sglang.upstream``) against on the CPU.
``VERIFIED`` is the part of them run on the H200 (GPU suite and ``verify.sh``); pyproject's ``sglang`` extra
declares exactly that range (tests/plugins/test_engine_versions.py holds them equal); widen it only after both ends
have passed (docs/deployment.md's matrix). Where releases differ in what the plugin uses, a function here
branches on the feature (the field or module exists), not on the version string, and ``BRANCHES`` names the
use and the releases that lack it (the surface test holds that list exact).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from genengine.backend import VerifiedRange
from genengine.plugins.versions import VersionStatus, check_engine_version, installed_surface, recorded_surface

__all__ = [
    "BRANCHES",
    "SUPPORTED",
    "VERIFIED",
    "check_installed",
    "graph_options",
    "graphs_off",
    "incremental_streaming",
    "local_serialized_tensor",
    "lora_tensors_per_rank",
    "prompt_ids_returned",
    "recorded_server_args",
    "request_prompt_ids",
    "split_graph_options",
    "surface",
    "with_prompt_ids",
]

VERIFIED = VerifiedRange("sglang", minimum="0.5.12", maximum="0.5.17")
"""Both ends verified on the H200 with torch 2.11 (0.5.17 2026-12-03, 0.5.12 2026-12-04; docs/deployment.md,
"Supported engine versions")."""

SUPPORTED: tuple[str, ...] = (
    "0.5.12",
    "0.5.12.post1",
    "0.5.13",
    "0.5.13.post1",
    "0.5.14",
    "0.5.15",
    "0.5.15.post1",
    "0.5.16",
    "0.5.17",
)
"""Every release from 0.5.12 to 0.5.17 on the index (all pin torch 2.11.0), each with a recorded surface."""

_PROMPT_IDS = "sglang.srt.managers.io_struct:GenerateReqInput(return_prompt_token_ids)"
_LST_NEW = "sglang.srt.model_executor.model_runner_components.weight_updater:LocalSerializedTensor(values)"
_LST_OLD = "sglang.srt.model_executor.model_runner:LocalSerializedTensor(values)"
_GRAPHS_SPLIT = "sglang.srt.server_args:ServerArgs(cuda_graph_max_bs_decode, disable_prefill_cuda_graph)"
_GRAPHS_ONE = "sglang.srt.server_args:ServerArgs(cuda_graph_max_bs, disable_piecewise_cuda_graph)"
_GRAPH_BACKENDS = (
    "sglang.srt.server_args:ServerArgs(cuda_graph_backend_prefill, cuda_graph_backend_decode, cuda_graph_config)"
)
_OLDER_THAN_0514 = ("0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1")
_LORA_TENSORS = "sglang.srt.managers.io_struct:LoadLoRAAdapterFromTensorsReqInput.serialized_named_tensors"
_TM_INCREMENTAL = "sglang.srt.managers.tokenizer_manager:TokenizerManager.incremental_streaming_output"

BRANCHES: Mapping[str, tuple[str, ...]] = {
    # prompt_ids_returned / request_prompt_ids: GenerateReqInput.return_prompt_token_ids came in 0.5.13.
    _PROMPT_IDS: ("0.5.12", "0.5.12.post1"),
    # local_serialized_tensor: the class moved to model_runner_components.weight_updater in 0.5.16.
    _LST_NEW: ("0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1"),
    _LST_OLD: ("0.5.16", "0.5.17"),
    # split_graph_options / graph_options / graphs_off: per-phase CUDA-graph options (decode, prefill) came in
    # 0.5.14; before, disable_cuda_graph left the (piecewise) prefill graphs on.
    _GRAPHS_SPLIT: _OLDER_THAN_0514,
    _GRAPH_BACKENDS: _OLDER_THAN_0514,
    _GRAPHS_ONE: ("0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17"),
    # lora_tensors_per_rank (adapters.py, _process.launch): adapters from tensors one payload per TP rank (the
    # field genengine sends) in 0.5.17; before, one payload for every rank (serialized_tensors), which genengine
    # does not send: enable_lora is refused there.
    _LORA_TENSORS: (*_OLDER_THAN_0514, "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16"),
    # incremental_streaming: the tokenizer manager copies the server argument onto itself from 0.5.16.
    _TM_INCREMENTAL: (*_OLDER_THAN_0514, "0.5.14", "0.5.15", "0.5.15.post1"),
}
"""Each use of ``genengine_sglang.upstream.USES`` that some supported releases lack → those releases."""


def check_installed(options: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> VersionStatus:
    """Refuse an installed SGLang outside ``VERIFIED`` unless the user allows it (see ``check_engine_version``)."""
    return check_engine_version(VERIFIED, options, backend="sglang", environ=environ)


def surface(version: str) -> dict[str, Any] | None:
    """The recorded surface of ``version`` (``surfaces/VERSION.json``), or None when none was recorded."""
    return recorded_surface("genengine_sglang", version)


@functools.cache
def recorded_server_args() -> tuple[str, ...]:
    """``ServerArgs``' field names where SGLang cannot be imported: the installed release's recorded ones
    (read from its metadata, SGLang not imported), else those of the newest verified release."""
    data = installed_surface("genengine_sglang", VERIFIED)
    return tuple(data["fields"]["sglang.srt.server_args:ServerArgs"])


@functools.cache
def prompt_ids_returned() -> bool:
    """Whether SGLang returns each request's prompt token ids when asked (``return_prompt_token_ids``)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    if dataclasses.is_dataclass(GenerateReqInput):
        return "return_prompt_token_ids" in {f.name for f in dataclasses.fields(GenerateReqInput)}
    try:  # not a dataclass (a stand-in): whatever its signature accepts
        parameters = inspect.signature(GenerateReqInput).parameters
    except (TypeError, ValueError):
        return True
    return "return_prompt_token_ids" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def request_prompt_ids(kwargs: dict[str, Any], tokenizer: Any) -> list[Any] | None:
    """Make ``GenerateReqInput(**kwargs)`` give back the prompt's token ids: SGLang's own flag where it has
    one (0.5.13 on); before it, text prompts are tokenized here as SGLang's tokenizer manager does
    (``tokenizer(texts)["input_ids"]``) and sent as ``input_ids``, and those ids are returned (per prompt,
    as ``kwargs["text"]`` was a list or one string), for the caller to put in the outputs. Prompts with
    images stay text (SGLang's processor expands the image tokens): their prompt ids stay unknown."""
    if prompt_ids_returned():
        kwargs["return_prompt_token_ids"] = True
        return None
    text = kwargs.get("text")
    if text is None or tokenizer is None or kwargs.get("image_data") is not None:
        return None
    single = isinstance(text, str)
    ids = [list(map(int, row)) for row in tokenizer([text] if single else list(text))["input_ids"]]
    del kwargs["text"]
    kwargs["input_ids"] = ids[0] if single else ids
    return ids


def with_prompt_ids(outputs: Sequence[Mapping[str, Any]], ids: list[Any] | None) -> list[Mapping[str, Any]]:
    """``outputs`` (one per prompt) with ``prompt_token_ids`` from ``request_prompt_ids`` where SGLang gave none."""
    if ids is None:
        return list(outputs)
    return [
        out if out.get("prompt_token_ids") is not None else {**out, "prompt_token_ids": row}
        for out, row in zip(outputs, ids, strict=True)
    ]


def split_graph_options(server_args: Iterable[str]) -> bool:
    """Whether these ``ServerArgs`` fields set CUDA graphs per phase (0.5.14 on: ``cuda_graph_max_bs_decode``,
    ``disable_prefill_cuda_graph``, ``cuda_graph_backend_prefill``) rather than for all (``cuda_graph_max_bs``,
    ``disable_piecewise_cuda_graph``, breakable graphs off unless ``enable_breakable_cuda_graph``)."""
    return "cuda_graph_max_bs_decode" in set(server_args)


def graph_options(max_bs: int, server_args: Iterable[str] | None = None) -> dict[str, Any]:
    """Server arguments for decode CUDA graphs up to batch ``max_bs`` and no prefill graphs, in the installed
    release's terms (``server_args``: its ``ServerArgs`` fields, by default the installed or recorded ones)."""
    if split_graph_options(recorded_server_args() if server_args is None else server_args):
        return {"cuda_graph_max_bs_decode": max_bs, "disable_prefill_cuda_graph": True}
    return {"cuda_graph_max_bs": max_bs, "disable_piecewise_cuda_graph": True}


def incremental_streaming(tokenizer_manager: Any) -> bool:
    """Whether SGLang's streamed chunks are deltas (``incremental_streaming_output``) rather than cumulative.

    The tokenizer manager holds its own copy from 0.5.16; before (0.5.12 - 0.5.15.post1) only its
    ``server_args`` has it, and reading the manager's attribute there fails every stream at its last chunk."""
    value = getattr(tokenizer_manager, "incremental_streaming_output", None)
    if value is None:
        value = tokenizer_manager.server_args.incremental_streaming_output
    return bool(value)


def graphs_off(kwargs: Mapping[str, Any], server_args: Iterable[str]) -> dict[str, Any]:
    """What to add to ``sglang.Engine(**kwargs)`` so that ``disable_cuda_graph=True`` means no CUDA graphs on
    this release too (``server_args``: its ``ServerArgs`` fields).

    From 0.5.14 it switches off both phases (``ServerArgs`` resolves it into the per-phase graph config).
    Before (0.5.12 - 0.5.13.post1) it stopped the decode graphs only: ``ModelRunner`` still captured the
    piecewise prefill graphs, compiling the model with torch.compile at every start, in memory outside the
    memory saver, unless ``disable_piecewise_cuda_graph``. A value the caller set for that wins."""
    if not kwargs.get("disable_cuda_graph") or split_graph_options(server_args):
        return {}
    if "disable_piecewise_cuda_graph" in kwargs:
        return {}
    return {"disable_piecewise_cuda_graph": True}


def lora_tensors_per_rank(engine: Any = None) -> bool:
    """Whether SGLang takes LoRA adapters from tensors as genengine sends them: one payload per TP rank
    (``LoadLoRAAdapterFromTensorsReqInput.serialized_named_tensors``, ``Engine._serialize_tensors_per_rank``),
    0.5.17 on; ``engine``: the started ``sglang.Engine``, whose serializer is checked too."""
    from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput

    if "serialized_named_tensors" not in inspect.signature(LoadLoRAAdapterFromTensorsReqInput).parameters:
        return False
    return engine is None or getattr(engine, "_serialize_tensors_per_rank", None) is not None


def local_serialized_tensor() -> Any:
    """SGLang's ``LocalSerializedTensor`` (one serialised tensor per TP rank), wherever this release has it."""
    try:
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
    except ImportError:  # 0.5.12 - 0.5.15.post1
        from sglang.srt.model_executor.model_runner import LocalSerializedTensor  # type: ignore[no-redef]
    return LocalSerializedTensor
