"""The embedded backend against the contract, in float32 on the CPU: exact against transformers."""

from __future__ import annotations

from typing import Any, ClassVar

from genengine import create_engine
from genengine.protocol import GenerationEngine
from genengine.testing.conformance import EngineConformance


class TestTransformersConformance(EngineConformance):
    def make_engine(self, model_dir: str, **options: Any) -> GenerationEngine:
        options.setdefault("device", "cpu")
        engine: GenerationEngine = create_engine(backend="transformers", model=model_dir, dtype="float32", **options)
        return engine


class TestTransformersConformanceTiedLlama(EngineConformance):
    """A second architecture with tied embeddings: a tied lm_head is optional in load_weights."""

    model_kwargs: ClassVar[dict[str, Any]] = {
        "arch": "llama",
        "tie_word_embeddings": True,
        "hidden_size": 128,
        "num_heads": 2,
        "num_kv_heads": 1,
    }

    def make_engine(self, model_dir: str, **options: Any) -> GenerationEngine:
        engine: GenerationEngine = create_engine(
            backend="transformers", model=model_dir, dtype="float32", device="cpu", **options
        )
        return engine
