"""Registers the ``vllm`` backend; imports nothing heavy so that listing backends stays fast."""

from __future__ import annotations

from genengine.backend import RegisterBackend, hookimpl
from genengine_vllm.compat import VERIFIED


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    register(
        "vllm",
        "genengine_vllm.engine:VLLMEngine.from_config",
        requires=("vllm",),
        install_hint="pip install 'genengine[vllm]'",
        description="vLLM, colocated in the trainer's processes (external_launcher)",
        raw_runner="genengine_vllm.raw:raw_tokens_per_second",
        raw_engine="genengine_vllm.raw:RawVLLMEngine",
        verified=VERIFIED,
    )
