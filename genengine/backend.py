"""The plugin author's face: what every backend needs from genengine, in one import (as ``import llm`` is for
llm's plugins).

``from genengine import backend`` gives the base classes an adapter subclasses, the hook that registers it, the
data its methods deal in, and the helpers every adapter otherwise writes again (the ``from_config`` factory, the
weight list of a loaded model, the stop/EOS rules, seeds, option checks). This module only re-exports: each name
lives in the layer module that owns it, and tests/core/test_import_hygiene.py keeps it so (no logic, at most 35 names).

The rest of what a plugin may import from the core, each from the module that owns it: every error from
:mod:`genengine.errors` (the contract's); for an engine that reads a checkpoint or runs its own processes,
:mod:`genengine.engine.checkpoint`, :mod:`genengine.engine.environ` and :mod:`genengine.engine.lifecycle`; engine
release checks from :mod:`genengine.plugins.versions`; TP groups from :mod:`genengine.distributed`; and, from a
plugin's LightRFT face only, :mod:`genengine.integrations.lightrft`. Imports no torch.
"""

from __future__ import annotations

from genengine.config import EngineConfig, check_options, option_bool, option_int, option_number
from genengine.engine.aio import AsyncEngineBase, AsyncRequest, DriverLock
from genengine.engine.base import EngineBase, LoadSession
from genengine.engine.checkpoint import module_weight_spec, torch_dtype
from genengine.engine.completion import Completion, Seeds, complete, text_decoder
from genengine.engine.factory import FromConfig, check_device
from genengine.engine.ipc import PassOn
from genengine.engine.ipc import dumps as ipc_dumps
from genengine.hookspecs import RegisterBackend, hookimpl
from genengine.plugins.versions import VerifiedRange
from genengine.protocol import (
    TAG_KV_CACHE,
    TAG_WEIGHTS,
    EngineState,
    FinishReason,
    GenerationOutput,
    GenerationResult,
    LoadReport,
    SamplingParams,
)
from genengine.requests import Request
from genengine.weights import DEFAULT_BUCKET_BYTES, WeightInfo

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "TAG_KV_CACHE",
    "TAG_WEIGHTS",
    "AsyncEngineBase",
    "AsyncRequest",
    "Completion",
    "DriverLock",
    "EngineBase",
    "EngineConfig",
    "EngineState",
    "FinishReason",
    "FromConfig",
    "GenerationOutput",
    "GenerationResult",
    "LoadReport",
    "LoadSession",
    "PassOn",
    "RegisterBackend",
    "Request",
    "SamplingParams",
    "Seeds",
    "VerifiedRange",
    "WeightInfo",
    "check_device",
    "check_options",
    "complete",
    "hookimpl",
    "ipc_dumps",
    "module_weight_spec",
    "option_bool",
    "option_int",
    "option_number",
    "text_decoder",
    "torch_dtype",
]
