"""Every upstream name, member and keyword each plugin uses exists in every engine release it supports.

The surfaces (``genengine_ENGINE/surfaces/VERSION.json``) are read from each release's wheel by
``tools/engine_surface.py``; this checks the plugin's declared uses (``genengine_ENGINE.upstream``) against
each of them on the CPU, with no wheel and no engine installed: "works on 0.26, breaks on 0.24" fails here.
A use some releases lack must be behind a feature branch in the plugin's ``compat`` module, which names it
and exactly those releases in ``compat.BRANCHES``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = {"vllm": "genengine_vllm", "sglang": "genengine_sglang"}


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("engine_surface", ROOT / "tools" / "engine_surface.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL = _tool()


def _surface(engine: str, version: str) -> dict[str, Any]:
    path = ROOT / PLUGINS[engine] / "surfaces" / f"{version}.json"
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing: python tools/engine_surface.py {engine} {version}"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _plugin(engine: str) -> tuple[ModuleType, ModuleType]:
    return (
        importlib.import_module(f"{PLUGINS[engine]}.upstream"),
        importlib.import_module(f"{PLUGINS[engine]}.compat"),
    )


def lacking(engine: str, uses: tuple[str, ...], versions: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """``{use: {version: why}}`` for every required use some of ``versions`` lack (``?`` uses excepted)."""
    out: dict[str, dict[str, str]] = {}
    for version in versions:
        surface = _surface(engine, version)
        for use in uses:
            if use.startswith("?"):
                continue
            why = TOOL.missing(use, surface)
            if why is not None:
                out.setdefault(use, {})[version] = why
    return out


@pytest.mark.parametrize("engine", sorted(PLUGINS))
def test_every_use_exists_in_every_supported_release_or_is_behind_a_branch(engine: str) -> None:
    upstream, compat = _plugin(engine)
    missing = lacking(engine, upstream.USES, compat.SUPPORTED)
    unbranched = {
        use: {v: why for v, why in by_version.items() if v not in compat.BRANCHES.get(use, ())}
        for use, by_version in missing.items()
    }
    unbranched = {use: by_version for use, by_version in unbranched.items() if by_version}
    assert not unbranched, f"{engine}: uses some supported releases lack, without a compat branch: {unbranched}"
    # BRANCHES is exact: each names only releases that really lack the use (a stale branch fails too).
    for use, versions in compat.BRANCHES.items():
        assert use in upstream.USES, f"compat.BRANCHES names {use!r}, which upstream.USES does not declare"
        assert set(versions) <= set(compat.SUPPORTED), f"{use}: {versions} not all in SUPPORTED"
        assert set(versions) == set(missing.get(use, {})), (
            f"{engine} {use}: BRANCHES says {sorted(versions)} lack it, the surfaces say {sorted(missing.get(use, {}))}"
        )


@pytest.mark.parametrize("engine", sorted(PLUGINS))
def test_supported_releases_have_surfaces_and_contain_the_verified_range(engine: str) -> None:
    from packaging.version import Version

    _, compat = _plugin(engine)
    versions = [Version(v) for v in compat.SUPPORTED]
    assert versions == sorted(versions), "SUPPORTED is oldest first"
    for version in compat.SUPPORTED:
        surface = _surface(engine, version)
        assert (surface["distribution"], surface["version"]) == (engine, version)
    assert compat.VERIFIED.minimum in compat.SUPPORTED and compat.VERIFIED.maximum in compat.SUPPORTED
    recorded = sorted(p.stem for p in (ROOT / PLUGINS[engine] / "surfaces").glob("*.json"))
    assert sorted(compat.SUPPORTED) == recorded, "a surface file for each supported release, and no other"


@pytest.mark.parametrize("engine", sorted(PLUGINS))
def test_every_engine_import_in_the_plugin_is_a_declared_use(engine: str) -> None:
    """A new ``from vllm.x import Y`` (or ``sglang``) in the plugin must be declared, so the check sees it."""
    upstream, _ = _plugin(engine)
    declared = set()
    for use in upstream.USES:
        module, path, _ = TOOL.parse_use(use)
        declared.add(f"{module}:{path[0]}")
    undeclared = []
    for path in sorted((ROOT / PLUGINS[engine]).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == engine:
                for alias in node.names:
                    if f"{node.module}:{alias.name}" not in declared:
                        undeclared.append(f"{path.name}: from {node.module} import {alias.name}")
    assert not undeclared, f"declare these in {PLUGINS[engine]}/upstream.py: {undeclared}"


def test_the_check_catches_a_name_the_oldest_release_lacks() -> None:
    """'Works on 0.26, breaks on 0.24': uses only newer releases have are reported for the older ones alone,
    for a method, a constructor keyword (a field) and a module-level name."""
    newer_only = (
        "vllm.entrypoints.llm:LLM.start_draft_weight_update",  # a method new in 0.26.0
        "vllm.engine.arg_utils:EngineArgs(jit_monitor_mode)",  # an EngineArgs field (keyword) new in 0.25.0
        "vllm.device_allocator.cumem:CuMemAllocator.release_pools",
    )
    found = lacking("vllm", newer_only, ("0.24.0", "0.25.1", "0.26.0"))
    assert set(found) == set(newer_only)
    assert all("0.24.0" in by_version and "0.26.0" not in by_version for by_version in found.values())
    assert "0.25.1" in found[newer_only[0]] and "0.25.1" not in found[newer_only[1]]
    # SGLang: return_prompt_token_ids came in 0.5.13, which is why compat branches on it.
    prompt_ids = "sglang.srt.managers.io_struct:GenerateReqInput(return_prompt_token_ids)"
    assert set(lacking("sglang", (prompt_ids,), ("0.5.12", "0.5.13", "0.5.17"))[prompt_ids]) == {"0.5.12"}


def test_a_use_the_surface_never_recorded_asks_for_a_regeneration() -> None:
    surface = _surface("vllm", "0.26.0")
    with pytest.raises(LookupError, match=r"rerun tools/engine_surface\.py"):
        TOOL.missing("vllm.v1.worker.cpu_worker:CPUWorker.load_model", surface)
    assert TOOL.missing("vllm.sampling_params:SamplingParams(no_such_keyword)", surface) is not None
    assert TOOL.missing("vllm:NoSuchName", surface) == "vllm has no NoSuchName"


@pytest.mark.parametrize("engine", sorted(PLUGINS))
def test_recorded_fields_stand_in_where_the_engine_is_not_installed(engine: str) -> None:
    """The settings' pass-through option names without the engine: the newest verified release's recorded
    field list (and each release's list is its own: they differ between releases)."""
    _, compat = _plugin(engine)
    key = {"vllm": "vllm.engine.arg_utils:EngineArgs", "sglang": "sglang.srt.server_args:ServerArgs"}[engine]
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed")
    newest = _surface(engine, compat.VERIFIED.maximum)["fields"][key]
    recorded = compat.recorded_engine_args() if engine == "vllm" else compat.recorded_server_args()
    assert set(recorded) == {f for f in newest if not f.startswith("_")}
    oldest = _surface(engine, compat.SUPPORTED[0])["fields"][key]
    assert set(oldest) != set(newest)


@pytest.mark.parametrize("engine", sorted(PLUGINS))
def test_compat_reads_its_own_recorded_surfaces(engine: str) -> None:
    """Each plugin's ``compat.surface`` reads its own package's file (one reader, genengine.plugins.versions);
    a release without one is None."""
    _, compat = _plugin(engine)
    for version in (compat.SUPPORTED[0], compat.VERIFIED.maximum):
        assert compat.surface(version) == _surface(engine, version)
    assert compat.surface("0.0.0") is None


@pytest.mark.parametrize("engine", sorted(PLUGINS))
def test_the_installed_release_surface_else_the_newest_verified(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What compat's recorded field lists read: the installed release's surface (by metadata, local label and
    all), else (not installed, or a release with none recorded) the newest verified release's."""
    from genengine.plugins.versions import installed_surface

    _, compat = _plugin(engine)
    installed: dict[str, str] = {}

    def version(name: str) -> str:
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    newest = _surface(engine, compat.VERIFIED.maximum)
    assert installed_surface(PLUGINS[engine], compat.VERIFIED) == newest
    installed[engine] = compat.SUPPORTED[0]
    assert installed_surface(PLUGINS[engine], compat.VERIFIED) == _surface(engine, compat.SUPPORTED[0]) != newest
    installed[engine] = "0.0.1"
    assert installed_surface(PLUGINS[engine], compat.VERIFIED) == newest


def _fake(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> None:
    import sys

    module = ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)


def test_sglang_prompt_ids_branch_follows_the_feature(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before 0.5.13 (no ``return_prompt_token_ids``) text prompts are tokenized as SGLang's tokenizer manager
    does and sent as ids, which the outputs then carry; with the field, SGLang's flag is set and text stays."""
    import dataclasses

    from genengine_sglang import compat

    @dataclasses.dataclass
    class Old:  # 0.5.12's GenerateReqInput, in the part that matters
        text: Any = None
        input_ids: Any = None

    @dataclasses.dataclass
    class New(Old):
        return_prompt_token_ids: bool = False

    def tokenizer(texts: list[str]) -> dict[str, list[list[int]]]:
        return {"input_ids": [[len(t), 7] for t in texts]}

    for cls, flagged in ((Old, False), (New, True)):
        _fake(monkeypatch, "sglang.srt.managers.io_struct", GenerateReqInput=cls)
        compat.prompt_ids_returned.cache_clear()
        batch: dict[str, Any] = {"text": ["ab", "abc"], "sampling_params": [{}, {}]}
        ids = compat.request_prompt_ids(batch, tokenizer)
        one: dict[str, Any] = {"text": "abcd"}
        one_ids = compat.request_prompt_ids(one, tokenizer)
        image: dict[str, Any] = {"text": "x", "image_data": "img"}
        assert compat.request_prompt_ids(image, tokenizer) is None and "text" in image
        if flagged:
            assert ids is None and batch["return_prompt_token_ids"] is True and batch["text"] == ["ab", "abc"]
            assert one == {"text": "abcd", "return_prompt_token_ids": True}
        else:
            assert ids == [[2, 7], [3, 7]] and batch == {"input_ids": [[2, 7], [3, 7]], "sampling_params": [{}, {}]}
            assert one_ids == [[4, 7]] and one == {"input_ids": [4, 7]}
            outputs = compat.with_prompt_ids([{"text": "a"}, {"text": "b", "prompt_token_ids": [9]}], ids)
            assert [o["prompt_token_ids"] for o in outputs] == [[2, 7], [9]]
    compat.prompt_ids_returned.cache_clear()


def test_sglang_local_serialized_tensor_is_found_where_the_release_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from genengine_sglang import compat

    old, new = type("OldLST", (), {}), type("NewLST", (), {})
    _fake(monkeypatch, "sglang.srt.model_executor.model_runner", LocalSerializedTensor=old)
    monkeypatch.setitem(sys.modules, "sglang.srt.model_executor.model_runner_components.weight_updater", None)
    assert compat.local_serialized_tensor() is old  # 0.5.12 - 0.5.15.post1
    _fake(monkeypatch, "sglang.srt.model_executor.model_runner_components.weight_updater", LocalSerializedTensor=new)
    assert compat.local_serialized_tensor() is new  # 0.5.16 on


def test_sglang_graph_options_follow_the_release() -> None:
    """CUDA-graph options are per phase from 0.5.14 (``cuda_graph_max_bs_decode``, ``disable_prefill_cuda_graph``),
    for all phases before (``cuda_graph_max_bs``, ``disable_piecewise_cuda_graph``): each release gets its own
    names, which its recorded ``ServerArgs`` has; and the graph-saver refusal follows the same split."""
    from genengine.errors import ConfigError
    from genengine_sglang import compat
    from genengine_sglang.settings import check_graph_memory_saver

    key = "sglang.srt.server_args:ServerArgs"
    for version in compat.SUPPORTED:
        fields = _surface("sglang", version)["fields"][key]
        options = compat.graph_options(64, fields)
        assert set(options) <= set(fields), (version, options)
        assert compat.split_graph_options(fields) == (
            version not in ("0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1")
        )
    old = _surface("sglang", "0.5.12")["fields"][key]
    new = _surface("sglang", "0.5.17")["fields"][key]
    on, env = {"enable_memory_saver": True}, {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}
    check_graph_memory_saver(on, env, old)  # breakable graphs are off by default before 0.5.14
    with pytest.raises(ConfigError, match="enable_breakable_cuda_graph=True"):
        check_graph_memory_saver({**on, "enable_breakable_cuda_graph": True}, env, old)
    with pytest.raises(ConfigError, match="prefill, its default"):
        check_graph_memory_saver(on, env, new)


def test_vllm_sleep_pools_are_released_before_finalization_where_vllm_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.24.0 leaves its sleep allocator's ``(MemPool, allocator)`` pairs to interpreter finalization (an
    abort when GC frees an allocator before its pool): compat registers 0.26.0's release at exit, pools first,
    then allocators, and releases them the same way at an engine's shutdown (0.24.0 keeps them, with the engine's
    memory, after it); a release with ``release_pools`` (0.25.0 on) does both itself, and compat nothing."""
    import atexit
    import weakref

    from genengine_vllm import compat

    freed: list[str] = []

    class Pool:
        pass

    class Allocator:
        pass

    def pair(tag: str) -> tuple[Pool, Allocator]:
        pool, allocator = Pool(), Allocator()
        weakref.finalize(pool, freed.append, f"pool:{tag}")
        weakref.finalize(allocator, freed.append, f"allocator:{tag}")
        return pool, allocator

    class Old:  # 0.24.0's CuMemAllocator, in the part that matters
        instance: Any = None

        def __init__(self) -> None:
            self.allocator_and_pools = {"weights": pair("weights"), "kv_cache": pair("kv_cache")}

    class New(Old):
        def release_pools(self) -> None: ...

    registered: list[Any] = []
    monkeypatch.setattr(atexit, "register", lambda fn, *args: registered.append((fn, args)))
    monkeypatch.setattr(compat, "_CUMEM_EXIT_REGISTERED", False)
    _fake(monkeypatch, "vllm.device_allocator.cumem", CuMemAllocator=New)
    assert compat.release_cumem_pools_at_exit() is False and registered == []
    _fake(monkeypatch, "vllm.device_allocator.cumem", CuMemAllocator=Old)
    Old.instance = Old()
    try:
        assert compat.release_cumem_pools_at_exit() is True
        assert compat.release_cumem_pools_at_exit() is False and len(registered) == 1  # once per process
        fn, args = registered[0]
        assert freed == []
        fn(*args)
        assert Old.instance.allocator_and_pools == {}
        assert sorted(freed[:2]) == ["pool:kv_cache", "pool:weights"]
        assert sorted(freed[2:]) == ["allocator:kv_cache", "allocator:weights"]
        # At an engine's shutdown (0.25.0 on: Worker.shutdown does it), pools first, then their allocators.
        freed.clear()
        Old.instance = Old()
        assert compat.release_cumem_pools() is True
        assert Old.instance.allocator_and_pools == {}
        assert sorted(freed[:2]) == ["pool:kv_cache", "pool:weights"] and len(freed) == 4
        _fake(monkeypatch, "vllm.device_allocator.cumem", CuMemAllocator=New)
        New.instance = New()
        assert compat.release_cumem_pools() is False and len(New.instance.allocator_and_pools) == 2
    finally:
        Old.instance = New.instance = None
