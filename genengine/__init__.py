"""genengine: the generation-engine layer of RL post-training.

One protocol (generate, sleep, wake, load_weights; and the async calls: stream, abort, pause, resume) over
SGLang, vLLM and an embedded CPU backend.
Importing this package loads no engine and no torch.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from genengine.config import EngineConfig
from genengine.errors import GenEngineError
from genengine.plugins.registry import available_backends, create_engine
from genengine.protocol import (
    AsyncGenerationEngine,
    EngineState,
    GenerationEngine,
    GenerationOutput,
    GenerationResult,
    GenerationStream,
    LoadReport,
    SamplingParams,
    SupportsLoadSessions,
    WeightLoadSession,
    is_async_engine,
)

try:
    __version__ = _version("genengine")  # one place for the version: pyproject.toml
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

__all__ = [
    "AsyncGenerationEngine",
    "EngineConfig",
    "EngineState",
    "GenEngineError",
    "GenerationEngine",
    "GenerationOutput",
    "GenerationResult",
    "GenerationStream",
    "LoadReport",
    "SamplingParams",
    "SupportsLoadSessions",
    "WeightLoadSession",
    "__version__",
    "available_backends",
    "create_engine",
    "is_async_engine",
]
