"""The embedded backend against the contract, in float32 on the CPU: exact against transformers."""

from __future__ import annotations

from typing import Any, ClassVar

from genengine import create_engine
from genengine.protocol import GenerationEngine
from genengine.testing.conformance import EngineConformance
from genengine.testing.conformance.asynchronous import AsyncTests


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


class TestTransformersConformanceKeepingPrefixCache(EngineConformance):
    """Keeps its prefix cache over a level-1 sleep, as SGLang does: the flush that a load owes while the KV
    cache sleeps is then seen, by counted cache hits, to happen as soon as the KV cache wakes."""

    prefix_cache_survives_sleep = True

    def make_engine(self, model_dir: str, **options: Any) -> GenerationEngine:
        engine: GenerationEngine = create_engine(
            backend="transformers",
            model=model_dir,
            dtype="float32",
            device="cpu",
            keep_prefix_cache_on_sleep=True,
            **options,
        )
        return engine


# The async tests run once, on the default model: they do not depend on the architecture or on what a sleep
# keeps (pytest collects only callables).
for _name in dir(AsyncTests):
    if _name.startswith("test_"):
        setattr(TestTransformersConformanceTiedLlama, _name, None)
        setattr(TestTransformersConformanceKeepingPrefixCache, _name, None)
