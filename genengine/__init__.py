"""genengine: the generation-engine layer of RL post-training.

One protocol (generate, sleep, wake, load_weights; and the async calls: stream, abort, pause, resume) over
SGLang, vLLM and an embedded CPU backend.
Importing this package loads no engine and no torch.
"""

from genengine.config import EngineConfig
from genengine.errors import GenEngineError
from genengine.plugins.registry import available_backends, create_engine
from genengine.plugins.versions import genengine_version
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

__version__ = genengine_version()  # one place for the version: pyproject.toml

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
