"""The docs cover the code, by introspection (as datasette checks its plugin hooks), and they build.

Every hook in ``genengine.hookspecs`` and every member of the ``GenerationEngine`` protocol has a
section; every ``::: dotted.path`` the API pages render exists; every page is in the nav; every error
class and every ``genengine bench`` option is documented; the Python snippets of the guides run; and
``mkdocs build --strict`` passes (skipped where mkdocs is not installed).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.doc_recipes import python_blocks, run_recipe, section

from genengine import errors, hookspecs
from genengine.protocol import GenerationEngine

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.MULTILINE)
DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)


def _text(page: str) -> str:
    return (DOCS / page).read_text(encoding="utf-8")


def _sections(page: str) -> set[str]:
    """Names a page gives a section: its markdown headings (code marks stripped) and the objects its
    ``:::`` directives render with their own heading."""
    text = _text(page)
    names = {h.strip("`").strip() for h in HEADING.findall(text)}
    names |= {d.rsplit(".", 1)[-1] for d in DIRECTIVE.findall(text)}
    return names


def _hooks() -> list[str]:
    return sorted(n for n, obj in vars(hookspecs).items() if callable(obj) and hasattr(obj, "genengine_spec"))


def _protocol_members() -> list[str]:
    own = [n for n in vars(GenerationEngine) if not n.startswith("_")]
    return sorted(n for n in own if n not in vars(object))


def test_introspection_finds_the_api() -> None:
    assert _hooks() == ["register_backends", "register_weight_transports"]
    assert {"generate", "sleep", "wake", "load_weights", "flush_cache", "shutdown"} <= set(_protocol_members())


@pytest.mark.parametrize("hook", _hooks())
def test_every_hook_has_a_section(hook: str) -> None:
    assert hook in _sections("reference/hookspecs.md"), f"docs/reference/hookspecs.md has no section for {hook}"
    assert hook in _sections("plugins.md"), f"docs/plugins.md has no section for the {hook} hook"


@pytest.mark.parametrize("member", _protocol_members())
def test_every_protocol_member_has_a_section(member: str) -> None:
    assert member in _sections("reference/protocol.md"), f"docs/reference/protocol.md has no section for {member}"


def test_protocol_context_manager_has_a_section() -> None:
    assert "__enter__" in vars(GenerationEngine) and "__exit__" in vars(GenerationEngine)
    assert "Context manager" in _sections("reference/protocol.md")


def test_documented_protocol_members_and_hooks_exist() -> None:
    """The reverse direction: no section for a method or hook that is gone."""
    for d in DIRECTIVE.findall(_text("reference/protocol.md")):
        if d.startswith("genengine.protocol.GenerationEngine."):
            assert d.rsplit(".", 1)[1] in _protocol_members(), d
    plugin_hooks = _text("plugins.md").split("\n## Hooks", 1)[1]
    for name in re.findall(r"^### (\S+)\s*$", plugin_hooks, re.MULTILINE):
        assert name in _hooks(), f"docs/plugins.md documents a hook {name!r} that hookspecs does not define"


def _resolve(path: str) -> Any:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


def test_every_rendered_object_exists() -> None:
    found = 0
    for page in sorted(DOCS.rglob("*.md")):
        for path in DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            _resolve(path)  # raises if the object was renamed or removed
            found += 1
    assert found > 30


def _nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return []


def test_nav_lists_every_page_and_only_pages_that_exist() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages
    for required in ("contract.md", "distributed.md", "benchmarks.md"):
        assert required in nav


def _first_table_names(text: str, column: int) -> list[str]:
    """The code-marked names in one column of the first markdown table of ``text`` (header row left out; in a
    cell, what comes before a colon)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        table.append(line)
    cells = [row.split(" | ")[column] for row in table]
    return [name for cell in cells for name in re.findall(r"`(\w+)`", cell.split(":")[0])]


def test_the_facade_is_listed_as_it_is() -> None:
    """docs/plugins.md's table of ``genengine.backend`` and its API page list exactly what it exports."""
    import genengine.backend

    exported = sorted(genengine.backend.__all__)
    one_import = _text("plugins.md").split("## The one import", 1)[1]
    assert sorted(_first_table_names(one_import, 1)) == exported
    assert sorted(_first_table_names(_text("reference/backend.md"), 0)) == exported


def test_every_error_class_is_in_the_troubleshooting_table() -> None:
    table = _text("troubleshooting.md").split("## Errors at a glance", 1)[1]
    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type) and obj is not errors.GenEngineError:
            assert f"`{name}`" in table, f"{name} is missing from the troubleshooting error table"


def test_every_bench_option_is_documented() -> None:
    from genengine.cli.bench.command import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    bench = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    page = _text("bench.md")
    options = [s for a in bench._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    assert len(options) > 10
    for option in options:
        assert f"`{option}" in page or f"{option}`" in page, f"genengine bench {option} is not in docs/bench.md"


def _python_blocks(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", _text(page), re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize(("page", "cwd"), [("getting-started.md", "tmp"), ("config.md", "root"), ("async.md", "tmp")])
def test_guide_snippets_run(page: str, cwd: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each guide's Python blocks run in order, in one namespace, as a reader would paste them."""
    monkeypatch.chdir(tmp_path if cwd == "tmp" else ROOT)
    blocks = _python_blocks(page)
    assert blocks
    module = types.ModuleType("docs_" + page.replace("-", "_").removesuffix(".md"))
    monkeypatch.setitem(sys.modules, module.__name__, module)  # dataclasses look their module up
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"docs/{page} block {i + 1}", "exec"), module.__dict__)
        except Exception as exc:
            raise AssertionError(f"docs/{page}, python block {i + 1} failed:\n{block}") from exc


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (the dev extra installs it)")
def test_trl_cpu_recipe_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/trl.md's CPU recipe runs as written (a real two-step GRPO run on the embedded engine, a tiny model built
    in place); its GPU recipe, which needs a GPU and a model, at least compiles and names the engine."""
    monkeypatch.chdir(tmp_path)
    (cpu,) = python_blocks(section("trl.md", "On a CPU: a recipe that runs as written"))
    (gpu,) = python_blocks(section("trl.md", "On a GPU: the same two lines"))
    compile(gpu, "docs/trl.md GPU recipe", "exec")
    assert "genengine=" in gpu and "use_cpu" not in gpu
    namespace = run_recipe(cpu, "docs/trl.md CPU recipe", "docs_trl")
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 2 and trainer.vllm_generation.engine is None  # trained, then shut down
    key = "sampling/sampling_logp_difference/max"  # TRL's check of the rollouts' logprobs against the policy's
    gaps = [h[key] for h in trainer.state.log_history if key in h]
    assert gaps and max(gaps) < 1e-4, "the engine made the rollouts, in float32 as the policy"


@pytest.mark.skipif(
    importlib.util.find_spec("trl") is None or importlib.util.find_spec("peft") is None,
    reason="trl and peft are not installed (the dev extra installs them)",
)
def test_trl_lora_recipe_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/trl.md's LoRA recipe runs as written: two GRPO steps of a PEFT policy, each sync sending only the
    adapter."""
    monkeypatch.chdir(tmp_path)
    (block,) = python_blocks(section("trl.md", "LoRA: adapter-only sync"))
    namespace = run_recipe(block, "docs/trl.md LoRA recipe", "docs_trl_lora")
    generation = namespace["trainer"].vllm_generation
    assert generation.sync_mode == "adapter" and generation.last_adapter.version == 1
    assert generation.engine is None


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (extra 'docs')")
def test_docs_build_strict(tmp_path: Path) -> None:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        # No -q: in mkdocs 1.6 it hides the warnings from --strict too, and the build "passes".
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for page in ("reference/protocol/index.html", "reference/hookspecs/index.html", "plugins/index.html"):
        assert (tmp_path / "site" / page).is_file()
    html = (tmp_path / "site" / "reference" / "protocol" / "index.html").read_text(encoding="utf-8")
    for member in _protocol_members():
        assert f'id="genengine.protocol.GenerationEngine.{member}"' in html, member
