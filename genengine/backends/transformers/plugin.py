"""Registers the embedded ``transformers`` backend the same way a third-party plugin would."""

from __future__ import annotations

from genengine.backend import RegisterBackend, hookimpl


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    register(
        "transformers",
        "genengine.backends.transformers.engine:TransformersEngine.from_config",
        requires=("torch", "transformers"),
        install_hint="pip install genengine",
        description="embedded PyTorch + transformers engine (CPU or one CUDA device)",
        raw_runner="genengine.backends.transformers.engine:hf_generate_tokens_per_second",
        raw_engine="genengine.backends.transformers.engine:HFRawEngine",
    )
