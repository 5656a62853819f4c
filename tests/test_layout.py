"""The tests' own layout: one folder per package or topic (tests/core, tests/ray_pool, tests/sglang_plugin, ...).

pytest imports the test files in "prepend" mode, and ``tests/`` itself is on ``sys.path`` (``support`` is imported
from there, by pytest, the GPU scripts and the benchmarks). Two rules follow:

- basenames are unique: two ``test_x.py`` in two folders would both be the module ``test_x``;
- no folder of ``tests/`` is named like a module that the code imports. A folder without ``__init__.py`` is a
  namespace package to Python: with ``tests/`` on the path, ``tests/sglang/`` made ``find_spec("sglang")`` find
  "SGLang" on a machine without it, and ``tests/genengine/`` hid the editable install's ``genengine`` from child
  processes. Hence ``sglang_plugin``, ``vllm_plugin`` and ``ray_pool``.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
_CODE = ("genengine", "genengine_sglang", "genengine_vllm", "benchmarks", "tests", "tools", "examples")
_BY_NAME = ("find_spec", "import_module", "importorskip")  # calls whose first argument is a module name


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def _imported_names() -> set[str]:
    """Every top-level module name the repository's code imports, or looks up by name in a string."""
    names: set[str] = set()
    for folder in _CODE:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module.split(".")[0])
                elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                    func = node.func
                    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                    if name in _BY_NAME and isinstance(node.args[0].value, str):
                        names.add(node.args[0].value.split(".")[0])
    return names


def test_every_test_file_is_in_a_topic_folder() -> None:
    loose = [p.name for p in TESTS.glob("test_*.py") if p.name != Path(__file__).name]
    assert not loose, f"test files directly under tests/ (put them in the folder of what they test): {loose}"


def test_test_file_basenames_are_unique() -> None:
    counts = Counter(p.name for p in _test_files())
    twice = sorted(name for name, n in counts.items() if n > 1)
    assert not twice, f"basenames used twice under tests/ (prepend imports need unique names): {twice}"


def test_no_test_folder_shadows_an_imported_module() -> None:
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not (p / "__init__.py").exists()}
    folders -= {"__pycache__"}
    shadowing = sorted(folders & (_imported_names() | {"genengine", "genengine_sglang", "genengine_vllm"}))
    assert not shadowing, (
        f"tests/ folders named like modules the code imports: {shadowing} (with tests/ on sys.path each is a "
        "namespace package that find_spec and import take for the real one); rename them"
    )
