"""The contract as a pytest suite: every backend subclasses ``EngineConformance`` and must pass it.

Usage, in a test module::

    class TestMyEngine(EngineConformance):
        greedy_matches_hf = False            # flags: what the engine can promise
        logprob_tolerance = 0.1

        def make_engine(self, model_dir, **options):
            return create_engine(backend="mine", model=model_dir, **options)

One engine serves a whole class (class-scoped fixtures); every test leaves it awake with the original
weights. Besides it, one fresh engine is built on a second model (other random weights, same tokenizer)
and shut down *before* the class engine starts, so at most one engine is alive at a time; its outputs are
the reference for ``load_weights`` and its shutdown is what the shutdown tests check. The reference for
logprobs and greedy decoding is transformers itself, run on the CPU in float32 from the model directory.

Importable without a GPU; imports torch and transformers only inside fixtures and tests.
"""

import pytest

# pytest rewrites the asserts of test files only, not of an installed package: registered before they are
# imported, the suite's modules are rewritten too, so that a failed check shows its values (with pytest's
# default --assert=rewrite; outside pytest this does nothing).
pytest.register_assert_rewrite(
    *(
        f"genengine.testing.conformance.{name}"
        for name in ("base", "generate", "sleep_wake", "weights", "asynchronous", "adapters", "suite", "transport")
    )
)

from genengine.testing.conformance.base import (  # noqa: E402
    GREEDY,
    PROMPTS,
    ConformanceWarning,
    EngineSlot,
    load_checkpoint,
    reference_logprobs,
)
from genengine.testing.conformance.suite import EngineConformance  # noqa: E402

__all__ = [
    "GREEDY",
    "PROMPTS",
    "ConformanceWarning",
    "EngineConformance",
    "EngineSlot",
    "load_checkpoint",
    "reference_logprobs",
]
