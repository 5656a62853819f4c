"""The plugin module the ``genengine.backends`` entry point names.

It is imported whenever anyone lists backends, so it imports nothing heavy: the factory is a
``"module:attribute"`` string that genengine imports only when someone creates a ``template`` engine.
"""

from __future__ import annotations

from genengine.backend import RegisterBackend, hookimpl


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    register(
        "template",
        "genengine_template.engine:TemplateEngine.from_config",
        requires=("torch", "transformers"),
        install_hint="pip install genengine-backend-template",
        description="template plugin: a tiny no-KV-cache sampling loop over a Hugging Face model",
        raw_runner="genengine_template.raw:raw_tokens_per_second",
    )
