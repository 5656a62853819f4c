"""Registers the ``sglang`` backend; imports nothing heavy so that listing backends stays fast."""

from __future__ import annotations

from genengine.backend import RegisterBackend, hookimpl


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    # RLGenerationEngine, not the protocol class SGLangEngine it extends: create_engine's SGLang engines have
    # always answered LightRFT's calls too (tests/gpu/test_sglang_gpu.py::test_reference_face relies on it).
    register(
        "sglang",
        "genengine_sglang.lightrft:RLGenerationEngine.from_config",
        requires=("sglang",),
        install_hint="pip install 'genengine[sglang]'",
        description="SGLang 0.5.17, one engine per tensor-parallel group, owned by the group leader",
        raw_runner="genengine_sglang.raw:raw_tokens_per_second",
    )
