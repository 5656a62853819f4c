"""The hooks of ``EngineBase`` a backend overrides (issue 42 point 4): the documented list, and what it promises.

Plugins override only the hooks docs/plugins.md lists (``genengine.engine.hooks.HOOKS``), never the state
machine's own members (``_end_load``, ``_begin_load``); the load's mode travels on its session (an argument of
the hooks, not a field the backend sets around the call); ``_load_ended`` sees every load's end; one
``_check_consistent`` hook is where a TP backend compares each call across its ranks.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from genengine.engine.aio import AsyncEngineBase
from genengine.engine.base import EngineBase, LoadSession
from genengine.engine.hooks import HOOKS
from genengine.errors import InconsistentInputsError, InvalidArgumentError
from genengine.protocol import GenerationResult
from genengine.weights import WeightInfo

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "examples" / "genengine-backend-template" / "src"

SHIPPED = (
    "genengine.backends.transformers.engine",
    "genengine_sglang.engine",
    "genengine_sglang.lightrft",
    "genengine_vllm.engine",
    "genengine_template.engine",
)
"""Every module of a shipped backend (plugins, the built-in one, the template) that defines an engine class."""


def undocumented_overrides(cls: type) -> list[str]:
    """The private members of ``EngineBase``/``AsyncEngineBase`` that ``cls`` (or a class between it and them)
    redefines although ``HOOKS`` does not list them."""
    base = {n for n in dir(AsyncEngineBase) if n.startswith("_") and not n.startswith("__")} - {"_abc_impl"}
    core = set(EngineBase.__mro__) | set(AsyncEngineBase.__mro__)  # EngineBase's own bases (AdapterHost) too
    mine = {n for k in cls.__mro__ if k not in core for n in vars(k)}
    return sorted((mine & base) - set(HOOKS))


def _engine_classes() -> list[type]:
    if str(TEMPLATE) not in sys.path:
        sys.path.insert(0, str(TEMPLATE))
    found = []
    for name in SHIPPED:
        module = importlib.import_module(name)
        found += [
            c
            for c in vars(module).values()
            if inspect.isclass(c) and issubclass(c, EngineBase) and c.__module__ == name
        ]
    return found


def test_shipped_backends_override_only_documented_hooks() -> None:
    classes = _engine_classes()
    assert {c.__name__ for c in classes} >= {"SGLangEngine", "VLLMEngine", "TransformersEngine", "TemplateEngine"}
    assert {c.__name__: undocumented_overrides(c) for c in classes} == {c.__name__: [] for c in classes}


def test_an_override_of_the_state_machine_is_found() -> None:
    """The check above can fail: overriding ``_end_load`` (the session's end, the base's own) is named."""

    class Sneaky(_Tiny):
        def _end_load(self, session: LoadSession, exc: BaseException | None) -> None:
            super()._end_load(session, exc)

    assert undocumented_overrides(Sneaky) == ["_end_load"]
    assert undocumented_overrides(_Tiny) == []


def test_every_hook_exists_and_plugins_md_lists_it() -> None:
    """``HOOKS`` names real members of the bases, not the state machine's, and the plugin guide lists each."""
    for name in HOOKS:
        assert hasattr(AsyncEngineBase, name), name
    assert not {"_end_load", "_begin_load", "_load_weights"} & set(HOOKS)
    text = (ROOT / "docs" / "plugins.md").read_text()
    section = text[text.index("### The hooks a backend may override") :]
    section = section[: section.index("\n## ")]
    listed = set(re.findall(r"^\| `([a-z_]+)", section, flags=re.M))
    assert listed == set(HOOKS)


# ---- what the hooks promise, on a tiny engine -------------------------------------------------------------
class _Tiny(EngineBase):
    """Two weights in a dict; records what its hooks see."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = {"a": torch.zeros(2), "b": torch.zeros(3)}
        self.seen: list[tuple[str, Any]] = []
        self.peers: dict[str, Any] = {}  # a second "rank"'s value per check: the check raises when it differs

    def _generate(self, requests: list[Any]) -> list[GenerationResult]:
        raise NotImplementedError

    def _release(self, level: int) -> None:
        return

    def _resume(self, tags: tuple[str, ...]) -> None:
        return

    def _weight_spec(self) -> Mapping[str, WeightInfo]:
        return {n: WeightInfo(tuple(t.shape), "float32") for n, t in self.weights.items()}

    def _apply_weights(self, bucket: list[tuple[str, torch.Tensor]], session: LoadSession) -> None:
        self.seen.append(("apply", session.mode))
        for name, tensor in bucket:
            if name == "b" and session.mode == "fail":
                raise RuntimeError("b does not fit")
            self.weights[name].copy_(tensor)

    def _bucket_cost(self, tensor: torch.Tensor, session: LoadSession) -> int:
        self.seen.append(("cost", session.mode))
        return super()._bucket_cost(tensor, session)

    def _finish_weights(self, session: LoadSession) -> None:
        self.seen.append(("finish", session.mode))

    def _flush_cache(self) -> None:
        return

    def _shutdown(self) -> None:
        return

    def _load_ended(self, session: LoadSession, exc: BaseException | None) -> None:
        self.seen.append(("ended", (session.mode, None if exc is None else str(exc))))

    def _check_consistent(self, what: str, value: Callable[[], object]) -> None:
        self.seen.append(("consistent", what))
        peer = self.peers.get(what.split()[0])
        if peer is not None and peer != value():
            raise InconsistentInputsError(f"{what} differ across the TP group")


def test_a_hook_written_without_the_session_is_refused_when_its_class_is_defined() -> None:
    """A plugin written before the hooks took the load's session fails at import with what to change, not with a
    bare TypeError inside its first load."""
    with pytest.raises(
        TypeError, match=r"Old._apply_weights takes \(self, bucket\); .*_apply_weights\(self, bucket, session\)"
    ):

        class Old(_Tiny):
            def _apply_weights(self, bucket: Any) -> None:  # type: ignore[override]
                return

    with pytest.raises(TypeError, match=r"_finish_weights\(self, session\)"):

        class OldFinish(_Tiny):
            def _finish_weights(self) -> None:  # type: ignore[override]
                return

    class Flexible(_Tiny):
        def _apply_weights(self, *args: Any) -> None:  # type: ignore[override]
            return

    assert Flexible.__name__ == "Flexible"


def _pairs() -> list[tuple[str, torch.Tensor]]:
    return [("a", torch.ones(2)), ("b", torch.ones(3))]


def test_the_load_mode_reaches_every_hook_on_the_session() -> None:
    engine = _Tiny()
    engine._load_weights(_pairs(), bucket_bytes=None, check_finite=False, version=3, mode="mine")
    modes = {kind: mode for kind, mode in engine.seen if kind in ("apply", "cost", "finish")}
    assert modes == {"apply": "mine", "cost": "mine", "finish": "mine"}
    assert engine.seen[-1] == ("ended", ("mine", None)) and engine.weight_version == 3
    engine.seen.clear()
    engine.load_weights(_pairs())  # the protocol's call: the backend's default mode (None)
    assert {mode for kind, mode in engine.seen if kind in ("apply", "cost", "finish")} == {None}
    assert not hasattr(engine, "_load_call")


def test_load_ended_sees_the_commit_and_the_failure_once_each() -> None:
    engine = _Tiny()
    with engine.begin_load(version=1) as session:
        assert session.mode is None and session.pass_on is None
        session.write(_pairs())
        session.commit()
    assert [s for s in engine.seen if s[0] == "ended"] == [("ended", (None, None))]
    engine.seen.clear()
    with pytest.raises(RuntimeError, match="b does not fit"):
        engine._load_weights(_pairs(), bucket_bytes=None, check_finite=False, version=2, mode="fail")
    assert [s for s in engine.seen if s[0] == "ended"] == [("ended", ("fail", "b does not fit"))]
    assert engine.weight_version == 1


def test_one_consistency_hook_guards_generate_and_every_load_before_anything_runs() -> None:
    engine = _Tiny()
    engine.load_weights(_pairs())
    assert ("consistent", "a load_weights call's arguments or engine state") in engine.seen
    engine.begin_load().abort()
    assert ("consistent", "a load session's arguments or engine state") in engine.seen
    engine.peers["generate"] = ("another rank's prompts",)
    with pytest.raises(InconsistentInputsError, match="generate inputs"):
        engine.generate(["hi"])  # refused before anything else: _generate would raise NotImplementedError
    engine.peers["a"] = ("a load_weights call", None, False, None)
    with pytest.raises(InconsistentInputsError, match="load_weights call's arguments"):
        engine.load_weights(_pairs(), bucket_bytes=7)  # before the load's own checks and its session
    engine.peers.clear()
    with pytest.raises(InvalidArgumentError, match="bucket_bytes=0"):
        engine.load_weights(_pairs(), bucket_bytes=0, version=1)
    assert engine.weight_version == 0


# ---- SGLang: the load's mode is an argument, the pass-on comes with the session ---------------------------
@pytest.fixture
def sglang(monkeypatch: pytest.MonkeyPatch) -> Any:
    """An ``SGLangEngine`` whose SGLang calls are recorded instead of made (no SGLang, no process)."""
    from genengine.config import EngineConfig
    from genengine.models.tiny_model import tiny_model_dir
    from genengine_sglang import _process, _weightsync
    from genengine_sglang.engine import SGLangEngine
    from genengine_sglang.settings import resolve_settings

    calls: list[tuple[Any, ...]] = []

    def payload(mode: str, bucket: Any, device: Any, pass_on: Any = None) -> tuple[Any, list[Any]]:
        calls.append(("payload", mode, pass_on))
        return b"", []

    def apply(engine: Any, mode: str, payloads: Any, *, synced: bool, load_format: str | None = None) -> None:
        calls.append(("apply", mode, load_format))

    monkeypatch.setattr(SGLangEngine, "_start", lambda self, port: None)
    monkeypatch.setattr(_weightsync, "producer_payload", payload)
    monkeypatch.setattr(_weightsync, "apply_payloads", apply)
    monkeypatch.setattr(_weightsync, "barrier", lambda engine, tp, *, flush: calls.append(("barrier", flush)))
    for name in ("stop_sglang", "wait_processes_off_gpu", "settle_memory"):
        monkeypatch.setattr(_process, name, lambda *a, **k: None)

    class _Sgl:
        def get_all_child_pids(self) -> list[int]:
            return []

        def release_memory_occupation(self, tags: list[str]) -> None:
            calls.append(("release", tuple(tags)))

        def resume_memory_occupation(self, tags: list[str]) -> None:
            calls.append(("resume", tuple(tags)))

    def make(**options: Any) -> Any:
        config = EngineConfig(backend="sglang", model=str(tiny_model_dir()), options=options)
        engine = SGLangEngine(resolve_settings(config, environ={}))
        engine._engine = _Sgl()
        engine.calls = calls
        return engine

    made: list[Any] = []
    yield lambda **options: made.append(make(**options)) or made[-1]
    for engine in made:
        engine.shutdown()


def _all_weights(engine: Any) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.zeros(info.shape)) for n, info in engine._weight_spec().items()]


def test_sglang_declares_its_pass_on_by_mode(sglang: Any) -> None:
    assert sglang(weight_sync_mode="handles").passes_tensors_on is True
    assert sglang(weight_sync_mode="per_param").passes_tensors_on is True
    assert sglang(weight_sync_mode="flattened").passes_tensors_on is False  # packed into a buffer of its own


def test_sglang_load_calls_pass_their_mode_on_the_session(sglang: Any) -> None:
    """LightRFT's per-tensor call hands its mode, format and flush to the hooks as the session's ``mode``; the
    protocol's calls use the engine's default; nothing is kept on the engine between calls."""
    from genengine_sglang.lightrft import RLGenerationEngine

    engine = sglang(weight_sync_mode="handles")
    name, shape = next((n, i.shape) for n, i in engine._weight_spec().items())
    engine.calls.clear()
    RLGenerationEngine.update_weights_from_tensor(engine, name, torch.zeros(shape), False, "custom")
    assert [c for c in engine.calls if c[0] == "apply"] == [("apply", "per_param", "custom")]
    assert ("barrier", True) not in engine.calls  # flush_cache=False: no flush
    assert not hasattr(engine, "_load_call")
    engine.calls.clear()
    engine.load_weights(_all_weights(engine))
    assert {c[1] for c in engine.calls if c[0] == "apply"} == {"handles"} and ("barrier", True) in engine.calls


def test_sglang_hands_the_sessions_pass_on_to_its_payloads_and_waits_at_the_end(sglang: Any) -> None:
    engine = sglang(weight_sync_mode="per_param", weight_sync_barrier="loader")  # handed over unsynced
    engine.sleep(1)
    engine.wake(["weights"])  # the KV cache asleep: the commit flushes nothing, the loader barrier still runs
    engine.calls.clear()
    pass_on = object()
    session = engine.begin_load(version=4)
    session.pass_on = pass_on  # what a cuda_ipc receiver does
    session.write(_all_weights(engine))
    session.commit()
    assert [c for c in engine.calls if c[0] == "payload"] == [("payload", "per_param", pass_on)]
    assert engine.calls[-1] == ("barrier", False)  # _load_ended: the scheduler's last copies landed
    assert engine.weight_version == 4
