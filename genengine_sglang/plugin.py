"""Registers the ``sglang`` backend; imports nothing heavy so that listing backends stays fast."""

from __future__ import annotations

from genengine.backend import RegisterBackend, hookimpl
from genengine_sglang.compat import VERIFIED


@hookimpl
def register_backends(register: RegisterBackend) -> None:
    # The protocol class, as the vLLM plugin registers its own. LightRFT's face (RLGenerationEngine) sits on
    # top of it: create_engine(backend=RLGenerationEngine, ...) or genengine_sglang.get_sglang_engine.
    register(
        "sglang",
        "genengine_sglang.engine:SGLangEngine.from_config",
        requires=("sglang",),
        install_hint="pip install 'genengine[sglang]'",
        description="SGLang, one engine per tensor-parallel group, owned by the group leader",
        raw_runner="genengine_sglang.raw:raw_tokens_per_second",
        raw_engine="genengine_sglang.raw:RawSGLangEngine",
        verified=VERIFIED,
    )
