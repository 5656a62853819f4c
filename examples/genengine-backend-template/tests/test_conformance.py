"""The template against genengine's conformance suite: the same tests every shipped backend passes."""

from __future__ import annotations

from typing import Any

from genengine import create_engine
from genengine.protocol import GenerationEngine
from genengine.testing.conformance import EngineConformance


class TestTemplateConformance(EngineConformance):
    # Capability flags: say what the engine cannot promise and the suite skips (only) those checks.
    supports_images = False  # text-only loop
    supports_sleep_level_2 = True
    supports_seed = True  # one torch.Generator per request
    greedy_matches_hf = True  # float32 on the CPU, the same forward as transformers
    logprob_tolerance = 1e-4

    def make_engine(self, model_dir: str, **options: Any) -> GenerationEngine:
        # Through the registry, by name: proves the entry point of the installed package works.
        engine: GenerationEngine = create_engine(
            backend="template", model=model_dir, dtype="float32", device="cpu", **options
        )
        return engine
