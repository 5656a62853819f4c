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
ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("genengine", "genengine_sglang", "genengine_vllm")
PLUGINS = ("genengine_sglang", "genengine_vllm")
PLUGIN_CORE = {"genengine.backend", "genengine.distributed"}
"""What a backend plugin may import from the core: the one import for backend authors, and TP groups."""
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


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import a module runs, at any depth (functions too), but not those under ``if TYPE_CHECKING``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for other in node.orelse:
                yield from _imports(ast.Module(body=[other], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


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


def test_plugins_import_the_core_only_through_genengine_backend() -> None:
    """A plugin's every import from ``genengine`` (type hints included) is ``genengine.backend`` or
    ``genengine.distributed``, and no plugin module imports another module's private (``_``-prefixed) name."""
    bad: list[str] = []
    modules = _modules()
    for name, path in modules.items():
        if name.split(".")[0] not in PLUGINS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bad += [f"{name}: import {a.name}" for a in node.names if a.name.split(".")[0] == "genengine"]
            elif isinstance(node, ast.ImportFrom) and node.module:
                top = node.module.split(".")[0]
                if top == "genengine" and node.module not in PLUGIN_CORE:
                    bad.append(f"{name}: from {node.module} import ...")
                if top in PACKAGES:  # a private module (``_process``) is fine, a private name in one is not
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    bad += [
                        f"{name}: from {node.module} import {n}" for n in private if f"{node.module}.{n}" not in modules
                    ]
    assert not bad, "plugins must import the core only from genengine.backend / genengine.distributed:\n" + "\n".join(
        bad
    )


def test_no_module_over_600_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not {p: n for p, n in long.items() if p not in LONG_ALLOWED and not p.startswith(CONFORMANCE)}, long


def test_import_graph_has_no_cycle() -> None:
    """Across genengine, genengine_sglang and genengine_vllm, counting imports inside functions too; only
    ``if TYPE_CHECKING`` imports (type hints) may point back."""
    graph = _graph()
    assert "genengine_sglang.engine" in graph["genengine_sglang.lightrft"]  # edges are read: the face imports its base
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_circle() -> None:
    """The check above can fail: a lazy import back from engine to the LightRFT face is a circle."""
    graph = _graph()
    graph["genengine_sglang.engine"] = graph["genengine_sglang.engine"] | {"genengine_sglang.lightrft"}
    assert ["genengine_sglang.engine", "genengine_sglang.lightrft"] in _cycles(graph)
