"""The plugin author's kit works for a third party: examples/genengine-backend-template, installed into a
fresh virtual environment next to a wheel of this checkout, passes its own tests there.

The environment is really fresh (no ``--system-site-packages``), so a dependency the template forgets to
declare fails here. Dependencies are pinned to the versions this interpreter runs (the suite's tested
set); pip uses the machine's own configuration (index, find-links, cache). If the pinned set cannot be had
(an offline machine whose local index lacks one of those versions), the install is retried with only torch
pinned.

The requirements are not downloaded and unpacked by pip: the distributions they need, followed through each
one's declared requirements (markers evaluated for this interpreter, extras only where a requirement asks for
them), are hard-linked from this interpreter's installation, file by file as each RECORD lists them (compiled
bytecode included), and pip then finds them installed. Pinned to this interpreter's versions, pip would install
the same files: linking gives the same environment without unpacking and byte-compiling thousands of files
(torch alone: 266 s against 7-10 s for the links, side by side on a loaded 2-core machine; the rest, transformers
and sympy the largest, 25-30 s of CPU). What the closure leaves out (anything the template declares beyond
genengine's requirements) pip still installs from the index, so a dependency the template forgets to declare
still fails here.

The two distributions are built into wheels once, by this interpreter's pip without build isolation (its
setuptools), and the venv is made without pip: the venv's installs and ``pip check`` are this interpreter's
pip run against it (``pip --python``). That spares a copy of pip in the venv and two isolated build
environments, each of which pip fills with setuptools from the index: seconds of CPU each, and the venv
still holds only what pip installed from the declared requirements.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "examples" / "genengine-backend-template"
_SKIP = shutil.ignore_patterns(
    ".venv", ".git", "build", "dist", "site", "*.egg-info", "__pycache__", ".*_cache", "out", ".gpu", ".whl",
    ".models", "examples", "tests", "docs", "benchmarks",
)  # fmt: skip

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: int = 600) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc.stdout


def _requirement_names() -> list[str]:
    """genengine's own runtime requirements, the template's, and pytest: what the fresh venv needs."""
    names = ["pytest"]
    for req in md.requires("genengine") or []:
        if "extra ==" not in req:
            names.append(re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0])
    return sorted(set(names) | {"torch", "transformers"})


def _pins(names: list[str]) -> list[str]:
    pins = []
    for name in names:
        try:
            pins.append(f"{name}=={md.version(name)}")
        except md.PackageNotFoundError:
            continue
    return pins


def _requirement_closure(names: list[str]) -> list[str]:
    """``names`` and every installed distribution they need, following declared requirements: a requirement's
    marker is evaluated for this interpreter with the extras the requirer was asked for (none for ``names``)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, None] = {}
    seen: set[tuple[str, str]] = set()
    todo: list[tuple[str, str]] = [(name, "") for name in names]
    while todo:
        name, extra = todo.pop()
        key = canonicalize_name(name)
        if (key, extra) in seen:
            continue
        seen.add((key, extra))
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # pip installs it (or says it cannot)
        found[key] = None
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo += [(req.name, "")] + [(req.name, e) for e in sorted(req.extras)]
    return sorted(found)


def _link_installed(name: str, venv: Path) -> None:
    """Install distribution ``name`` into ``venv`` as pip would, from this interpreter's copy of it.

    Every file its RECORD lists is hard-linked (copied where links fail) to the same place under the venv's
    site-packages; its console scripts are rewritten for the venv's interpreter. Nothing is linked for a
    distribution that has no RECORD or is an editable install (this checkout's own): pip installs it then.
    """
    dist = md.distribution(name)
    if not dist.files or '"editable": true' in (dist.read_text("direct_url.json") or ""):
        return
    source = Path(str(dist.locate_file("")))
    (target,) = venv.glob("lib/python*/site-packages")
    python = venv / "bin" / "python"
    for entry in dist.files:
        src, dst = source / entry, Path(os.path.normpath(target / entry))
        if not src.is_file():
            continue  # an entry pip recorded but that is gone (never on a clean install)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.parent == venv / "bin":  # a console script: its shebang names the interpreter
            text = src.read_text().splitlines(keepends=True)
            dst.write_text("".join([f"#!{python}\n", *text[1:]]) if text[0].startswith("#!") else "".join(text))
            dst.chmod(0o755)
            continue
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


class FreshVenv:
    def __init__(self, python: Path, template: Path, env: dict[str, str]) -> None:
        self.python = python
        self.template = template
        self.env = env
        self.timings: dict[str, float] = {}

    def pip(self, *args: str) -> list[str]:
        """This interpreter's pip, run against the venv (which has none of its own)."""
        return [sys.executable, "-m", "pip", "--python", str(self.python), *args]


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> FreshVenv:
    tmp = tmp_path_factory.mktemp("template")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    # One intra-op thread: the tiny model gains nothing from more, and spinning threads crawl on a busy machine.
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")

    start = time.perf_counter()
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env=env)
    fresh = FreshVenv(venv / "bin" / "python", tmp / "genengine-backend-template", env)
    fresh.timings["venv"] = time.perf_counter() - start

    # Copies, so that the wheel builds leave nothing behind in the checkout.
    src = tmp / "genengine-src"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    shutil.copytree(TEMPLATE, fresh.template, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))

    start = time.perf_counter()
    wheels = tmp / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
         str(src), str(fresh.template)],
        env=env,
    )  # fmt: skip
    (genengine_wheel,) = wheels.glob("genengine-*.whl")
    (template_wheel,) = wheels.glob("genengine_backend_template-*.whl")
    fresh.timings["wheels"] = time.perf_counter() - start

    start = time.perf_counter()
    names = _requirement_names()
    for name in _requirement_closure(names):
        _link_installed(name, venv)
    fresh.timings["link requirements"] = time.perf_counter() - start
    start = time.perf_counter()
    constraints = tmp / "constraints.txt"
    # --no-compile: Python byte-compiles what it imports (a few hundred of transformers' thousands of modules).
    install = fresh.pip(
        "install", "-q", "--no-compile", "-c", str(constraints), str(genengine_wheel), *names, f"{template_wheel}[test]"
    )
    constraints.write_text("\n".join(_pins(names)) + "\n")
    try:
        # Short network timeouts: offline, fall back quickly instead of retrying for minutes.
        _run([*install, "--retries", "1", "--timeout", "30"], env=env)
    except AssertionError:
        constraints.write_text("\n".join(_pins(["torch"])) + "\n")
        _run(install, env=env)
    fresh.timings["install"] = time.perf_counter() - start
    return fresh


def test_fresh_venv_holds_no_checkout_code(fresh_venv: FreshVenv) -> None:
    """genengine comes from a wheel of this checkout, the template from its own distribution."""
    code = (
        "import json, genengine, genengine_template, torch, importlib.metadata as md\n"
        "print(json.dumps([genengine.__file__, genengine_template.__file__, torch.__file__,"
        " md.version('genengine'), md.version('genengine-backend-template')]))"
    )
    gen_file, tpl_file, torch_file, gen_version, tpl_version = json.loads(
        _run([str(fresh_venv.python), "-c", code], cwd=fresh_venv.template.parent, env=fresh_venv.env)
    )
    site = str(fresh_venv.python.parents[1])
    assert gen_file.startswith(site) and tpl_file.startswith(site) and torch_file.startswith(site)
    assert gen_version == md.version("genengine") and tpl_version == "0.1.0"
    # The linked torch is an installation pip accepts: its own dependencies were installed next to it.
    assert "No broken requirements" in _run(fresh_venv.pip("check"), env=fresh_venv.env)


def test_installed_template_is_listed_as_a_backend(fresh_venv: FreshVenv) -> None:
    genengine = str(fresh_venv.python.parent / "genengine")
    rows = json.loads(_run([genengine, "backends", "--json"], env=fresh_venv.env))
    by_name = {r["name"]: r for r in rows}
    assert by_name["template"]["distribution"] == "genengine-backend-template"
    assert by_name["template"]["status"] == "loadable"
    assert by_name["transformers"]["status"] == "loadable"


def test_template_passes_its_own_tests_in_the_fresh_venv(fresh_venv: FreshVenv) -> None:
    start = time.perf_counter()
    out = _run(
        [str(fresh_venv.python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=fresh_venv.template,
        env=fresh_venv.env,
    )
    fresh_venv.timings["template tests"] = time.perf_counter() - start
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\b\d+ passed\b", summary) and "failed" not in summary and "error" not in summary, out[-3000:]
    # The conformance suite really ran through the installed entry point (not skipped wholesale).
    assert int(re.search(r"(\d+) passed", summary).group(1)) >= 50, summary  # type: ignore[union-attr]
    print("fresh-venv timings (s):", {k: round(v, 1) for k, v in fresh_venv.timings.items()})


_SHOUTY = '''
from typing import Any

from genengine_template.engine import TemplateEngine
from genengine.testing.conformance import EngineConformance


class Shouty(TemplateEngine):
    """A bug for the suite to find: every output's text ends in "!"."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        decode = self._decode
        self._decode = lambda ids: decode(ids) + "!"


class TestShouty(EngineConformance):
    def make_engine(self, model_dir: str, **options: Any) -> Any:
        return Shouty(model_dir, dtype="float32", device="cpu", **options)
'''


def test_a_failed_check_shows_its_values_where_genengine_is_installed(fresh_venv: FreshVenv, tmp_path: Path) -> None:
    """pytest rewrites no asserts in an installed package by itself: the suite registers its modules for it, so
    a plugin author sees what was compared, not a bare AssertionError."""
    (tmp_path / "test_shouty.py").write_text(_SHOUTY)
    proc = subprocess.run(
        [str(fresh_venv.python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_output_fields"],
        cwd=tmp_path,
        env=fresh_venv.env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert "1 failed" in out.strip().splitlines()[-1], out[-4000:]
    assert re.search(r"E\s+AssertionError: assert '[^'\n]*!' == '", out), out[-4000:]
