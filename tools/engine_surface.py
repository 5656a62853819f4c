"""Record the API surface a plugin uses of each engine release, from the release's wheel, without importing it.

    python tools/engine_surface.py vllm 0.24.0 0.25.0 0.25.1 0.26.0 [--wheels /tmp/wheels]
    python tools/engine_surface.py sglang 0.5.12 ... 0.5.17

For every name the plugin declares it touches (``genengine_ENGINE/upstream.py``: ``USES``, ``FIELDS``) this reads
the wheel's sources by AST and writes ``genengine_ENGINE/surfaces/VERSION.json``: the top-level names of each
module named there, the members (methods with their parameter names, class attributes, instance attributes
assigned in methods, inherited ones too) of each class named there, the parameters of each function named
there, and the field lists of the classes in ``FIELDS`` (``EngineArgs``, ``ServerArgs``: what the settings
layer accepts as pass-through options where the engine is not installed). ``tests/plugins/test_engine_surfaces.py``
checks the plugin's uses against every supported release's file, on the CPU, with no wheel.

A wheel missing from ``--wheels`` (default ``$WHEELS`` or /tmp/wheels) is fetched with
``pip download --no-deps`` (a few hundred MB for vLLM: keep the folder between runs).
"""

from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import importlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENGINES = {"vllm": "genengine_vllm", "sglang": "genengine_sglang"}
_USE = re.compile(r"^\??(?P<module>[\w.]+):(?P<path>[\w.]+)(?:\((?P<args>[\w, ]*)\))?$")


def parse_use(use: str) -> tuple[str, list[str], list[str] | None]:
    """``"mod:Class.member(a, b)"`` → ``("mod", ["Class", "member"], ["a", "b"])`` (args None: no call)."""
    m = _USE.match(use)
    if m is None:
        raise ValueError(f"bad use {use!r}: expected 'module:Name[.member][(arg, ...)]', optional leading '?'")
    args = m.group("args")
    names = None if args is None else [a.strip() for a in args.split(",") if a.strip()]
    return m.group("module"), m.group("path").split("."), names


class Wheel:
    """The Python sources of one wheel, parsed on demand; names resolved through imports and lazy tables."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path)
        self._files = {n for n in self._zip.namelist() if n.endswith(".py")}
        self._trees: dict[str, ast.Module | None] = {}

    def source(self, module: str) -> tuple[str, bool] | None:
        """The file of ``module`` and whether it is a package."""
        base = module.replace(".", "/")
        if f"{base}/__init__.py" in self._files:
            return f"{base}/__init__.py", True
        if f"{base}.py" in self._files:
            return f"{base}.py", False
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            src = self.source(module)
            self._trees[module] = None if src is None else ast.parse(self._zip.read(src[0]))
        return self._trees[module]

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        src = self.source(module)
        parts = module.split(".")
        if not (src and src[1]):
            parts = parts[:-1]
        parts = parts[: len(parts) - node.level + 1]
        return ".".join(parts + ([node.module] if node.module else []))

    def _top_nodes(self, tree: ast.Module) -> list[ast.stmt]:
        """Top-level statements, including those inside ``if``/``try`` blocks (TYPE_CHECKING, fallbacks)."""
        out: list[ast.stmt] = []
        todo = list(tree.body)
        while todo:
            node = todo.pop(0)
            out.append(node)
            if isinstance(node, ast.If):
                todo[:0] = node.body + node.orelse
            elif isinstance(node, ast.Try):
                todo[:0] = node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        return out

    def _lazy_table(self, tree: ast.Module) -> dict[str, str]:
        """A module ``__getattr__``'s table of ``name: "relative.module:attr"`` (vLLM's ``MODULE_ATTRS``)."""
        table: dict[str, str] = {}
        for node in self._top_nodes(tree):
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Dict):
                for k, v in zip(value.keys, value.values, strict=False):
                    if not (isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and isinstance(v.value, str)):
                        continue
                    if ":" in v.value or v.value.startswith("."):
                        table[str(k.value)] = v.value
        return table

    def top_names(self, module: str, depth: int = 0) -> list[str]:
        tree = self.tree(module)
        if tree is None:
            return []
        names: set[str] = set()
        for node in self._top_nodes(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.ImportFrom):
                names |= {a.asname or a.name for a in node.names if a.name != "*"}
                if any(a.name == "*" for a in node.names) and depth < 10:  # ``from .common import *``
                    origin = self._absolute(module, node)
                    names |= {n for n in self.top_names(origin, depth + 1) if not n.startswith("_")}
            elif isinstance(node, ast.Import):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
            names |= set(self._lazy_table(tree))
        return sorted(names)

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST | None] | None:
        """Where ``module.name`` is defined: ``(module, node)``; a submodule gives ``(submodule, None)``."""
        tree = self.tree(module)
        if tree is None or depth > 20:
            return None
        found: tuple[str, ast.AST | None] | None = None
        for node in self._top_nodes(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found = (module, node)  # the last definition wins, as at run time
            elif _assigns(node, name):
                found = (module, node)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        origin = self._absolute(module, node)
                        sub = f"{origin}.{alias.name}"
                        if self.source(sub) is not None and self.resolve(origin, alias.name, depth + 1) is None:
                            return sub, None
                        hit = self.resolve(origin, alias.name, depth + 1)
                        if hit is not None:
                            return hit
                    elif alias.name == "*" and not name.startswith("_"):
                        hit = self.resolve(self._absolute(module, node), name, depth + 1)
                        if hit is not None:
                            found = hit
        if found is not None:
            return found
        lazy = self._lazy_table(tree).get(name)
        if lazy is not None:
            target, _, attr = lazy.partition(":")
            src = self.source(module)
            pkg = module if src and src[1] else module.rpartition(".")[0]
            target = pkg + target if target.startswith(".") else target
            return self.resolve(target, attr or name, depth + 1)
        if self.source(f"{module}.{name}") is not None:
            return f"{module}.{name}", None
        return None

    def _base_refs(self, module: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        out = []
        for base in cls.bases:
            hit = None
            if isinstance(base, ast.Name):
                hit = self.resolve(module, base.id)
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                mod = self.resolve(module, base.value.id)
                if mod is not None and mod[1] is None:
                    hit = self.resolve(mod[0], base.attr)
            if hit is not None and isinstance(hit[1], ast.ClassDef):
                out.append((hit[0], hit[1]))
        return out

    def class_surface(self, module: str, cls: ast.ClassDef, depth: int = 0) -> dict[str, Any]:
        """Members (name → parameter names, or None for an attribute) and fields, bases' included."""
        members: dict[str, list[str] | None] = {}
        fields: list[str] = []
        if depth < 15:
            for base_module, base in reversed(self._base_refs(module, cls)):
                inherited = self.class_surface(base_module, base, depth + 1)
                members.update(inherited["members"])
                fields += [f for f in inherited["fields"] if f not in fields]
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                is_property = any(
                    (isinstance(d, ast.Name) and d.id in ("property", "cached_property"))
                    or (isinstance(d, ast.Attribute) and d.attr in ("setter", "cached_property"))
                    for d in node.decorator_list
                )
                members[node.name] = None if is_property else params(node)
                for sub in ast.walk(node):
                    targets = (
                        sub.targets
                        if isinstance(sub, ast.Assign)
                        else [sub.target]
                        if isinstance(sub, ast.AnnAssign)
                        else []
                    )
                    for t in targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            members.setdefault(t.attr, None)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        members[t.id] = None
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                members[node.target.id] = None
                annotation = ast.unparse(node.annotation)
                if "ClassVar" not in annotation and "InitVar" not in annotation and node.target.id not in fields:
                    fields.append(node.target.id)
            elif isinstance(node, ast.ClassDef):
                members[node.name] = None
        return {"members": members, "fields": fields}


def _assigns(node: ast.stmt, name: str) -> bool:
    """Whether ``node`` is a module-level ``name = ...`` or ``name: T = ...``."""
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    return isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name


def _public(names: list[str] | None, used: set[str]) -> list[str] | None:
    """Public names, and the private ones a use names (``LLM._preprocess_cmpl_one``), dunders kept."""
    if names is None:
        return None
    return [n for n in names if not n.startswith("_") or n.startswith("__") or n in used]


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameter names; ``*args``/``**kwargs`` as ``*``/``**``."""
    a = fn.args
    out = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    if a.vararg:
        out.append("*")
    if a.kwarg:
        out.append("**")
    return out


def missing(use: str, surface: dict[str, Any]) -> str | None:
    """Why ``use`` is not in ``surface`` (a recorded release), or None when it is there.

    A use whose module the surface never looked at raises ``LookupError``: the file predates the use and must
    be regenerated (this script), which is a different fault from the release lacking the name.
    """
    module, path, args = parse_use(use)
    modules = surface["modules"]
    if module not in modules:
        raise LookupError(f"{use}: module {module} is not recorded; rerun tools/engine_surface.py")
    names = modules[module]
    if names is None:
        return f"no module {module}"
    if path[0] not in names:
        return f"{module} has no {path[0]}"
    key = f"{module}:{path[0]}"
    home = surface["aliases"].get(key, key)
    cls = surface["classes"].get(home)
    if len(path) == 1 and args is None:
        return None
    if cls is None and len(path) > 1:
        if home in surface["functions"]:
            return f"{key} is not a class"
        raise LookupError(f"{use}: class {home} is not recorded; rerun tools/engine_surface.py")
    member = path[1] if len(path) > 1 else "__init__"
    fields = surface["fields"].get(key) or surface["fields"].get(home) or (cls or {}).get("fields") or []
    if len(path) > 1 and path[1] not in cls["members"] and path[1] not in fields:  # type: ignore[index]
        return f"{home} has no member {path[1]}"
    if len(path) > 2:
        raise ValueError(f"{use}: at most Class.member")
    if not args:
        return None
    if cls is None:
        accepted = surface["functions"].get(key)
        if accepted is None:
            return f"{key} is not a recorded callable"
    elif member in cls["params"]:
        accepted = cls["params"][member]
    elif member == "__init__" and fields:
        accepted = fields
    else:
        raise LookupError(f"{use}: the parameters of {home}.{member} are not recorded; rerun tools/engine_surface.py")
    if "**" in accepted:
        return None
    absent = [a for a in args if a not in accepted]
    return f"{home}.{member} takes no {', '.join(absent)}" if absent else None


def find_wheel(engine: str, version: str, wheels: str) -> str:
    pattern = os.path.join(wheels, f"{engine.replace('-', '_')}-{version}-*.whl")
    hits = glob.glob(pattern)
    if not hits:
        os.makedirs(wheels, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", "3.12", "--implementation", "cp",
             "--platform", "manylinux_2_34_x86_64", "--platform", "manylinux_2_28_x86_64",
             "--platform", "manylinux_2_17_x86_64", "-d", wheels, f"{engine}=={version}"],
            check=True,
        )  # fmt: skip
        hits = glob.glob(pattern)
    if len(hits) != 1:
        raise SystemExit(f"expected one wheel {pattern}, found {hits}")
    return hits[0]


def surface(engine: str, version: str, wheel_path: str) -> dict[str, Any]:
    """The JSON-ready surface of ``wheel_path`` for what ``genengine_ENGINE.upstream`` declares."""
    sys.path.insert(0, str(ROOT))
    upstream = importlib.import_module(f"{ENGINES[engine]}.upstream")
    wheel = Wheel(wheel_path)
    modules: dict[str, list[str] | None] = {}
    classes: dict[str, Any] = {}
    functions: dict[str, list[str] | None] = {}
    aliases: dict[str, str] = {}
    called: dict[str, set[str]] = {}  # class key -> members whose parameters a use names
    used: set[str] = set()  # private names a use names: recorded although private
    for use in [*upstream.USES, *upstream.FIELDS]:
        module, path, args = parse_use(use)
        used.update(path)
        modules.setdefault(module, wheel.top_names(module) if wheel.tree(module) is not None else None)
        hit = wheel.resolve(module, path[0])
        key = f"{module}:{path[0]}"
        if hit is None or hit[1] is None:
            continue
        node = hit[1]
        home = f"{hit[0]}:{path[0]}"
        if home != key and home not in classes:
            aliases[key] = home
        if isinstance(node, ast.ClassDef):
            if args is not None:
                called.setdefault(home, set()).add(path[1] if len(path) > 1 else "__init__")
            if home not in classes:
                classes[home] = wheel.class_surface(hit[0], node)
            if home != key:
                aliases[key] = home
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.setdefault(key, params(node))
        else:
            functions.setdefault(key, None)  # a module-level value: present, not callable as far as we know
    digest = hashlib.sha256(Path(wheel_path).read_bytes()).hexdigest()
    # The release's exact pins (``Requires-Dist: name==version``, no extra): what tools/gpu/prepare.sh must
    # carry at those versions, and torch's, which says the torch line the release belongs to.
    metadata = next(n for n in wheel._zip.namelist() if n.endswith(".dist-info/METADATA"))
    pinned: dict[str, str] = {}
    for line in wheel._zip.read(metadata).decode().splitlines():
        m = re.match(r"Requires-Dist: ([A-Za-z0-9_.\-]+)(\[[^]]*\])? ?==([^,;\s]+)\s*(;.*)?$", line)
        if m and "extra ==" not in (m.group(4) or ""):
            pinned[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(3)
    fields = {key: classes[aliases.get(key, key)]["fields"] for key in upstream.FIELDS}
    fields_of = {aliases.get(key, key) for key in upstream.FIELDS}  # their fields are in "fields" already
    return {
        "distribution": engine,
        "version": version,
        "wheel": os.path.basename(wheel_path),
        "wheel_sha256": digest,
        "generated_by": "tools/engine_surface.py",
        "requires_exact": dict(sorted(pinned.items())),
        "modules": {m: _public(modules[m], used) for m in sorted(modules)},
        "aliases": dict(sorted(aliases.items())),
        "functions": {f: functions[f] for f in sorted(functions)},
        "classes": {
            c: {
                "members": _public(sorted(set(v["members"]) - set(v["fields"] if c in fields_of else ())), used),
                "params": {m: v["members"][m] for m in sorted(called.get(c, ())) if v["members"].get(m) is not None},
                **({"fields": v["fields"]} if "__init__" in called.get(c, ()) and c not in fields_of else {}),
            }
            for c, v in sorted(classes.items())
        },
        "fields": fields,
    }


def dump(data: dict[str, Any]) -> str:
    """One line per module, class and field list: small, and a new release's diff reads per entry."""
    lines = ["{"]
    items = list(data.items())
    for i, (key, value) in enumerate(items):
        end = "," if i < len(items) - 1 else ""
        if isinstance(value, dict) and value:
            lines.append(f"{json.dumps(key)}: {{")
            sub = list(value.items())
            for j, (k, v) in enumerate(sub):
                lines.append(f"  {json.dumps(k)}: {json.dumps(v)}" + ("," if j < len(sub) - 1 else ""))
            lines.append("}" + end)
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value)}{end}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=sorted(ENGINES))
    parser.add_argument("versions", nargs="+")
    parser.add_argument("--wheels", default=os.environ.get("WHEELS", "/tmp/wheels"))
    args = parser.parse_args(argv)
    out_dir = ROOT / ENGINES[args.engine] / "surfaces"
    out_dir.mkdir(exist_ok=True)
    for version in args.versions:
        data = surface(args.engine, version, find_wheel(args.engine, version, args.wheels))
        path = out_dir / f"{version}.json"
        path.write_text(dump(data))
        print(f"{path.relative_to(ROOT)}: {len(data['classes'])} classes, {len(data['modules'])} modules")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
