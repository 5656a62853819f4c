"""The sglang plugin on a CPU machine without SGLang: the package stays light, its names resolve, and a
missing SGLang is a clear error.

The plugin's CPU tests are split by topic in tests/sglang_plugin/ (package, lightrft, settings, mapping, loop,
process); the parts that need a GPU and SGLang are in tests/gpu/test_sglang_gpu.py and tests/gpu/tp2_sglang.py.
"""

from __future__ import annotations

import importlib.util
import inspect
import multiprocessing as mp
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.ports import free_port

from genengine.config import EngineConfig
from genengine.errors import (
    BackendImportError,
    GenEngineError,
)
from genengine_sglang.engine import SGLangEngine
from genengine_sglang.errors import SGLangEngineError
from genengine_sglang.lightrft import RLGenerationEngine

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
needs_no_sglang = pytest.mark.skipif(HAS_SGLANG, reason="checks what happens when SGLang is missing")


# ---- the package stays light ---------------------------------------------------------------------------------
def test_imports_load_neither_torch_nor_sglang() -> None:
    code = (
        "import genengine_sglang, genengine_sglang.plugin, genengine_sglang.engine, genengine_sglang.sgl_model_saver\n"
        "import genengine_sglang.lightrft, genengine_sglang.raw, genengine_sglang._weightsync\n"
        "import genengine_sglang._process, genengine_sglang.settings, genengine_sglang.mapping\n"
        "import genengine_sglang._async, genengine_sglang._loop, genengine_sglang._group\n"
        "import sys; print(sorted(m for m in ('torch', 'sglang', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_lazy_exports() -> None:
    import genengine_sglang
    from genengine_sglang import engine, lightrft

    assert genengine_sglang.get_sglang_engine is lightrft.get_sglang_engine
    assert genengine_sglang.RLGenerationEngine is lightrft.RLGenerationEngine
    assert genengine_sglang.get_sglang_engine_for_rollout is lightrft.get_sglang_engine_for_rollout
    assert genengine_sglang.SGLangEngine is engine.SGLangEngine
    with pytest.raises(AttributeError):
        genengine_sglang.no_such_thing  # noqa: B018
    # The protocol module does not reach up to LightRFT's face (which imports it): the names live in lightrft.
    for name in ("RLGenerationEngine", "get_sglang_engine", "get_sglang_engine_for_rollout"):
        assert not hasattr(engine, name) and callable(getattr(lightrft, name))
    with pytest.raises(AttributeError):
        engine.no_such_thing  # noqa: B018


def test_plugin_targets_resolve() -> None:
    """The strings the plugin registers name real attributes (imported lazily by the registry)."""
    from genengine_sglang import plugin

    seen: dict[str, Any] = {}
    plugin.register_backends(register=lambda name, factory, **kw: seen.update(name=name, factory=factory, **kw))
    assert seen["name"] == "sglang" and seen["requires"] == ("sglang",)
    for ref in (seen["factory"], seen["raw_runner"], seen["raw_engine"]):
        module, _, attr = ref.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        assert callable(obj), ref
    # The protocol class is the backend, as in the vLLM plugin; LightRFT's face is a subclass on top of it.
    assert seen["factory"] == "genengine_sglang.engine:SGLangEngine.from_config"
    assert inspect.ismethod(RLGenerationEngine.from_config)
    assert issubclass(RLGenerationEngine, SGLangEngine)


@needs_no_sglang
def test_missing_sglang_is_a_backend_import_error(model_dir: Path) -> None:
    config = EngineConfig(backend="sglang", model=str(model_dir), options={"base_port": free_port()})
    with pytest.raises(BackendImportError, match="genengine\\[sglang\\]"):
        RLGenerationEngine.from_config(config)
    assert not mp.active_children()
    with pytest.raises(BackendImportError):
        RLGenerationEngine(model_path=str(model_dir), base_port=free_port())


@needs_no_sglang
def test_create_engine_names_the_missing_engine(model_dir: Path) -> None:
    import genengine

    with pytest.raises(BackendImportError, match="sglang"):
        genengine.create_engine(backend="sglang", model=str(model_dir))


def test_errors_are_genengine_errors() -> None:
    assert issubclass(SGLangEngineError, GenEngineError) and issubclass(SGLangEngineError, RuntimeError)
