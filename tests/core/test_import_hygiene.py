"""``import genengine``, listing backends and ``--help`` must load no heavy package (checked in a fresh interpreter)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "sglang", "vllm")

CASES = {
    "import": "import genengine",
    "list": "import genengine; genengine.available_backends()",
    "plugins": "import genengine_sglang.plugin, genengine_vllm.plugin, genengine.backends.transformers.plugin",
    "help": "from genengine.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
    "backends-cli": "from genengine.cli import main; main(['backends'])",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_heavy_imports(case: str) -> None:
    code = CASES[case] + f"\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_every_subcommand_help_is_light() -> None:
    from genengine.cli import build_parser

    commands = list(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert "backends" in commands
    for command in commands:
        code = (
            f"from genengine.cli import main\ntry:\n    main([{command!r}, '--help'])\nexcept SystemExit:\n    pass\n"
            f"import sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.strip().splitlines()[-1] == "[]", command


# ---- the packages' shape: read from their source (no import) -------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("genengine", "genengine_sglang", "genengine_vllm")
PLUGINS = ("genengine_sglang", "genengine_vllm")
PLUGIN_CORE = {
    "genengine.backend",  # the plugin authors' face: re-exports only (test_the_facade_only_re_exports)
    "genengine.distributed",  # TP groups and topology
    "genengine.errors",  # the contract's errors
    "genengine.adapters",  # the contract's adapters: an engine that serves LoRA adapters
    "genengine.engine.checkpoint",  # an engine that reads a model directory
    "genengine.engine.environ",  # ... or runs processes: scoped environment, the CUDA allocator setting
    "genengine.engine.lifecycle",  # ... whose processes die with the trainer, and live-engine tracking
    "genengine.plugins.versions",  # the engine releases a plugin was verified with
}
"""What a backend (a plugin, or the built-in one) may import from the core: the facade, and the layer modules that
own what only some backends need."""
LIGHTRFT_CORE = "genengine.integrations.lightrft"
"""The argument checks both plugins' LightRFT faces share: imported by those faces (``<backend>.lightrft``) only."""
BACKEND_PACKAGES = ("genengine_sglang", "genengine_vllm", "genengine.backends.transformers")
FACADE = "genengine/backend.py"
FACADE_MAX_NAMES = 35
MAX_LINES = 600
LONG_ALLOWED: set[str] = set()  # and the conformance suite (genengine/testing/conformance/), which the issue exempts
CONFORMANCE = "genengine/testing/conformance/"


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import a module runs, at any depth (functions too), ``if TYPE_CHECKING`` ones included: a circle
    through a type hint is still a circle for the reader."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _targets(node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The modules of ours an import loads by name (``from pkg import sub`` is ``pkg.sub``)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    assert node.level == 0, "relative imports are not used in this project"
    base = node.module or ""
    out = {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in out if m in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            edges |= _targets(node, modules)
        graph[name] = edges - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), i.e. the import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package_of(module: str) -> str | None:
    return next((p for p in BACKEND_PACKAGES if module == p or module.startswith(p + ".")), None)


def _backend_core_imports(modules: dict[str, Path]) -> list[str]:
    """A backend's imports of ``genengine`` (type hints included) outside its own package that are neither
    ``PLUGIN_CORE`` nor, from its LightRFT face, ``LIGHTRFT_CORE``; and private names imported from a module."""
    bad: list[str] = []
    for name, path in modules.items():
        package = _package_of(name)
        if package is None:
            continue
        allowed = PLUGIN_CORE | ({LIGHTRFT_CORE} if name == f"{package}.lightrft" else set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bad += [f"{name}: import {a.name}" for a in node.names if a.name.split(".")[0] == "genengine"]
            elif isinstance(node, ast.ImportFrom) and node.module:
                top = node.module.split(".")[0]
                own = node.module == package or node.module.startswith(package + ".")
                if top == "genengine" and not own and node.module not in allowed:
                    bad.append(f"{name}: from {node.module} import ...")
                if top in PACKAGES:  # a private module (``_process``) is fine, a private name in one is not
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    bad += [
                        f"{name}: from {node.module} import {n}" for n in private if f"{node.module}.{n}" not in modules
                    ]
    return bad


def test_plugins_import_the_core_only_through_genengine_backend() -> None:
    """A backend (the plugins and the built-in one) imports the core only from the facade and ``PLUGIN_CORE``'s
    layer modules, the LightRFT checks only from its LightRFT face, and no other module's private name."""
    bad = _backend_core_imports(_modules())
    assert not bad, "backends import the core only from PLUGIN_CORE (see docs/plugins.md):\n" + "\n".join(bad)


def test_a_backend_reaching_past_the_facade_is_found(tmp_path: Path) -> None:
    """The check above can fail: a plugin module importing the engine's base directly, or the LightRFT checks
    from outside its LightRFT face."""
    (tmp_path / "probe.py").write_text(
        "from genengine.engine.base import EngineBase\nfrom genengine.integrations.lightrft import REFERENCE_DTYPES\n"
    )
    (tmp_path / "lightrft.py").write_text("from genengine.integrations.lightrft import check_reference_args\n")
    modules = _modules() | {
        "genengine_vllm.probe": tmp_path / "probe.py",
        "genengine.backends.transformers.lightrft": tmp_path / "lightrft.py",
    }
    assert sorted(
        line for line in _backend_core_imports(modules) if "probe" in line or "transformers.lightrft" in line
    ) == [
        "genengine_vllm.probe: from genengine.engine.base import ...",
        "genengine_vllm.probe: from genengine.integrations.lightrft import ...",
    ]


def _facade_logic(path: Path) -> list[str]:
    """What ``genengine/backend.py`` holds besides its docstring, imports from the core and ``__all__``; and the
    names it lists but does not import, or imports but does not list."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[str] = []
    imported: set[str] = set()
    listed: list[str] = []
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("genengine."):
            imported |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            listed = list(ast.literal_eval(node.value))
        else:
            found.append(f"line {node.lineno}: {type(node).__name__}")
    found += [f"{n} is listed but not imported" for n in listed if n not in imported]
    found += [f"{n} is imported but not listed" for n in sorted(imported - set(listed))]
    if len(listed) > FACADE_MAX_NAMES:
        found.append(f"{len(listed)} names (at most {FACADE_MAX_NAMES})")
    return found


def test_the_facade_only_re_exports() -> None:
    """``genengine.backend`` holds no logic, only re-exports, at most 35 names: each fact lives in its layer."""
    assert _facade_logic(ROOT / FACADE) == []


def test_logic_in_the_facade_is_found(tmp_path: Path) -> None:
    """The check above can fail: a helper defined in the facade, a name it lists but does not import, too many."""
    source = (ROOT / FACADE).read_text()
    probe = tmp_path / "backend.py"
    probe.write_text(source + "\n\ndef helper() -> None:\n    pass\n")
    assert [line.split(": ")[1] for line in _facade_logic(probe)] == ["FunctionDef"]
    names = "".join(f'    "N{i}",\n' for i in range(FACADE_MAX_NAMES))
    probe.write_text(source.replace("__all__ = [\n", "__all__ = [\n" + names, 1))
    found = _facade_logic(probe)
    assert "N0 is listed but not imported" in found and found[-1].endswith(f"(at most {FACADE_MAX_NAMES})")


def test_no_module_over_600_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not {p: n for p, n in long.items() if p not in LONG_ALLOWED and not p.startswith(CONFORMANCE)}, long


def test_import_graph_has_no_cycle() -> None:
    """Across genengine, genengine_sglang and genengine_vllm, counting imports inside functions and under
    ``if TYPE_CHECKING`` too."""
    graph = _graph()
    assert "genengine_sglang.engine" in graph["genengine_sglang.lightrft"]  # edges are read: the face imports its base
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_circle() -> None:
    """The check above can fail: a lazy import back from engine to the LightRFT face is a circle."""
    graph = _graph()
    graph["genengine_sglang.engine"] = graph["genengine_sglang.engine"] | {"genengine_sglang.lightrft"}
    assert ["genengine_sglang.engine", "genengine_sglang.lightrft"] in _cycles(graph)


# ---- the layers (issue 42 point 1): the folders are floors, and arrows only point down ----------------------
FLOORS: dict[str, int] = {
    # 0: the contract: the data and protocols every layer speaks; they import nothing of genengine but each other
    **dict.fromkeys(("protocol", "config", "errors", "requests", "weights", "hookspecs", "adapters"), 0),
    "engine": 1,  # the shared machinery every backend runs on
    "distributed": 1,  # TP groups and topology (a public path for torchrun users)
    "plugins": 2,  # the plugin system: registry, versions, optional extras
    "transport": 3,  # the runtimes: weight transports and the Ray pool
    "ray": 3,
    **dict.fromkeys(("integrations", "models", "testing"), 4),  # trainers' faces, model builders, conformance
    "backend": 5,  # the plugin authors' face: under the backends that import it
    "backends": 6,  # the built-in backend, laid out like the plugins (which stand on the same floor)
    "cli": 7,  # the command, its demos and benchmarks
    "": 8,  # genengine/__init__.py: the users' face
}
"""The floor of each top-level module or folder of ``genengine``."""
PLUGIN_FLOOR = 6


def floor_of(module: str) -> int:
    top, _, rest = module.partition(".")
    if top != "genengine":
        return PLUGIN_FLOOR
    return FLOORS[rest.partition(".")[0]]


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} (floor {floor_of(a)}) -> {b} (floor {floor_of(b)})"
        for a, targets in graph.items()
        for b in targets
        if floor_of(b) > floor_of(a)
    )


def test_every_core_folder_has_a_floor() -> None:
    tops = {m.split(".")[1] if "." in m else "" for m in _modules() if m.split(".")[0] == "genengine"}
    assert tops == set(FLOORS), "give each new top-level module or folder of genengine/ a floor in FLOORS"


def test_no_arrow_runs_back_up() -> None:
    """An import (type hints included) goes to the same floor or a lower one, never a higher one."""
    assert _upward(_graph()) == []


def test_an_arrow_back_up_is_found() -> None:
    """The check above can fail: the registry looking up the transports would be an arrow back up."""
    graph = _graph()
    graph["genengine.plugins.registry"] = graph["genengine.plugins.registry"] | {"genengine.transport"}
    assert "genengine.plugins.registry (floor 2) -> genengine.transport (floor 3)" in _upward(graph)


def _product_imports_of_testing(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        if not a.startswith("genengine.testing")
        for b in targets
        if b.startswith("genengine.testing")
    )


def test_product_code_does_not_import_the_test_support() -> None:
    """``genengine.testing`` (pytest classes, parity bounds) is for tests; the model builders are product code in
    ``genengine.models``."""
    graph = _graph()
    assert _product_imports_of_testing(graph) == []
    graph["genengine.cli.args"] = graph["genengine.cli.args"] | {"genengine.testing.tiny_model"}
    assert _product_imports_of_testing(graph) == ["genengine.cli.args -> genengine.testing.tiny_model"]


def _private_crossings(modules: dict[str, Path]) -> list[str]:
    """``from m import _x`` or ``m._x`` of another module of ours (a private name crossing modules), and any import
    of a private module (``pkg._x``) from outside its own package ``pkg``."""
    bad: list[str] = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # local name -> module of ours
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules:
                        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                continue
            base = node.module or ""
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in modules:
                    aliases[a.asname or a.name] = full
                elif a.name.startswith("_") and not a.name.startswith("__") and base in modules and base != name:
                    bad.append(f"{name}: from {base} import {a.name}")
            for target in _targets(node, modules):
                parent, _, leaf = target.rpartition(".")
                if (
                    leaf.startswith("_")
                    and not leaf.startswith("__")
                    and not (package == parent or package.startswith(parent + "."))
                ):
                    bad.append(f"{name}: imports the private module {target}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and f"{aliases[node.value.id]}.{node.attr}" not in modules
            ):
                bad.append(f"{name}: {aliases[node.value.id]}.{node.attr}")
    return sorted(set(bad))


def test_no_private_name_crosses_modules() -> None:
    """What a module keeps private stays in it; a private module serves its own package only."""
    modules = _modules()
    assert _private_crossings(modules) == []


def test_a_private_crossing_is_found(tmp_path: Path) -> None:
    """The check above can fail: a private name, a private attribute, a private module from outside its package."""
    source = (
        "from genengine.protocol import _scalar\n"
        "import genengine.weights as w\n"
        "w._check_finite\n"
        "from genengine.transport import _layout\n"
    )
    (tmp_path / "probe.py").write_text(source)
    modules = _modules() | {"genengine.cli.probe": tmp_path / "probe.py"}
    found = [line for line in _private_crossings(modules) if line.startswith("genengine.cli.probe")]
    assert found == [
        "genengine.cli.probe: from genengine.protocol import _scalar",
        "genengine.cli.probe: genengine.weights._check_finite",
        "genengine.cli.probe: imports the private module genengine.transport._layout",
    ]


def _drawn_floors() -> dict[str, int]:
    """docs/layout.md's picture, read back: each name in its second column (``engine/``, ``protocol.py``) with the
    floor its row (or the numbered row above it) gives."""
    text = (ROOT / "docs" / "layout.md").read_text()
    picture = text.split("```text\n", 1)[1].split("```", 1)[0]
    drawn: dict[str, int] = {}
    floor = -1
    for line in picture.splitlines()[2:]:
        number = line[:7].strip(" │")
        if number.isdigit():
            floor = int(number)
        for word in line[8:45].split():
            if word.endswith(("/", ".py")) and word[0].isalpha():
                drawn.setdefault(word.removeprefix("genengine/").removesuffix(".py").split("/")[0], floor)
    return drawn


def test_the_layout_picture_matches_the_floors() -> None:
    drawn = _drawn_floors()
    expected = {("__init__" if top == "" else top): floor for top, floor in FLOORS.items()}
    assert {name: drawn.get(name) for name in expected} == expected
