"""The registry with real installed plugin distributions, discovered through their entry points.

Each plugin under tests/plugins/packages/ is installed into its own folder (its modules and the ``.dist-info``
its pyproject declares, as pip lays them out); the checks run in a fresh
interpreter with that folder on PYTHONPATH, so discovery goes through importlib.metadata exactly as for
a user's ``pip install``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import genengine
from genengine.errors import BackendImportError, BackendNotFoundError, ConfigError, GenEngineError
from genengine.plugins.registry import available_backends, create_engine, get_backend

if sys.version_info >= (3, 11):
    import tomllib
else:  # the TOML reader pip vendors (pip is what this file used to install the plugins with)
    from pip._vendor import tomli as tomllib

PLUGINS = Path(__file__).parent / "packages"


@pytest.fixture(scope="session")
def plugin_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each plugin installed into a folder of its own as pip puts a distribution there: its modules and a
    ``.dist-info`` with the METADATA and ``entry_points.txt`` its pyproject declares (all that
    importlib.metadata reads). Written here, not by five ``pip install`` runs (10 s of CPU building wheels)."""
    root = tmp_path_factory.mktemp("plugins")
    dirs = {}
    for name in ("example", "broken", "duplicate", "badhook", "typo"):
        source = PLUGINS / name
        pyproject = tomllib.loads((source / "pyproject.toml").read_text())
        project, setup = pyproject["project"], pyproject["tool"]["setuptools"]
        target = root / name
        target.mkdir()
        for package in setup.get("packages", []):
            shutil.copytree(source / package, target / package, ignore=shutil.ignore_patterns("__pycache__"))
        for module in setup.get("py-modules", []):
            shutil.copy(source / f"{module}.py", target / f"{module}.py")
        info = target / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
        info.mkdir()
        requires = "".join(f"Requires-Dist: {r}\n" for r in project.get("dependencies", []))
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n{requires}"
        )
        (info / "entry_points.txt").write_text(
            "".join(
                f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) + "\n"
                for group, points in project["entry-points"].items()
            )
        )
        dirs[name] = target
    return dirs


def run_with(dirs: list[Path], code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(d) for d in dirs), PYTHONWARNINGS="default")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def cli_with(dirs: list[Path], *args: str) -> subprocess.CompletedProcess[str]:
    return run_with(dirs, f"import sys; from genengine.cli import main; sys.exit(main({list(args)!r}))")


def test_builtin_backends_listed_with_install_hints() -> None:
    infos = {b.name: b for b in available_backends()}
    assert {"transformers", "sglang", "vllm"} <= set(infos)
    assert infos["transformers"].loadable and infos["transformers"].distribution == "genengine"
    for name in ("sglang", "vllm"):
        if not infos[name].loadable:  # on the CPU machine
            assert infos[name].reason == f"not installed: missing module(s) {name}; pip install 'genengine[{name}]'"


def test_cli_backends_table_lists_all_three() -> None:
    out = cli_with([], "backends").stdout
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert {"sglang", "transformers", "vllm"} <= set(lines)
    assert "loadable" in lines["transformers"]


def test_example_plugin_discovered_through_entry_point(plugin_dirs: dict[str, Path]) -> None:
    proc = cli_with([plugin_dirs["example"]], "backends", "--json")
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["example"]["distribution"] == "genengine-example-backend"
    assert rows["example"]["version"] == "1.2.3"
    assert rows["example"]["status"] == "loadable"
    code = (
        "import genengine\n"
        "e = genengine.create_engine(backend='example', model='m', tp_size=1)\n"
        "print(type(e).__name__, e.generate(['hi'])[0].outputs[0].text, e.config.model)\n"
    )
    assert run_with([plugin_dirs["example"]], code).stdout.split() == ["EchoEngine", "hi", "m"]


def test_broken_plugin_warns_but_listing_works(plugin_dirs: dict[str, Path]) -> None:
    dirs = [plugin_dirs["example"], plugin_dirs["broken"]]
    proc = cli_with(dirs, "backends")
    assert proc.returncode == 0
    assert "error importing genengine plugin 'broken'" in proc.stderr
    assert "genengine-broken-backend" in proc.stderr
    table = proc.stdout
    assert "example" in table and "transformers" in table
    assert "plugin failed to import: ModuleNotFoundError" in table


def test_selecting_broken_plugin_names_distribution_and_chains(plugin_dirs: dict[str, Path]) -> None:
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import genengine\n"
        "from genengine.errors import BackendImportError\n"
        "try:\n"
        "    genengine.create_engine(backend='broken', model='m')\n"
        "except BackendImportError as e:\n"
        "    print(type(e.__cause__).__name__)\n"
        "    print(e)\n"
    )
    out = run_with([plugin_dirs["broken"]], code).stdout.splitlines()
    assert out[0] == "ModuleNotFoundError"
    assert "genengine-broken-backend" in out[1] and "genengine_dependency_that_does_not_exist" in out[1]


def test_misspelt_hooks_break_only_their_own_plugin(plugin_dirs: dict[str, Path]) -> None:
    """Issue 15: ``register_backends(reg)`` raised pluggy's PluginValidationError out of every registry call."""
    from genengine.models.tiny_model import tiny_model_dir

    dirs = [plugin_dirs["example"], plugin_dirs["badhook"]]
    model = str(tiny_model_dir())
    code = (
        "import json, warnings\n"
        "warnings.simplefilter('ignore')\n"
        "import genengine\n"
        "from genengine.errors import BackendImportError\n"
        "rows = {b.name: [b.loadable, b.reason, b.distribution] for b in genengine.available_backends()}\n"
        "errors = {}\n"
        "for name in ('badparam', 'badname'):\n"
        "    try:\n"
        "        genengine.create_engine(backend=name, model='m')\n"
        "    except BackendImportError as e:\n"
        "        errors[name] = [str(e), type(e.__cause__).__name__]\n"
        f"with genengine.create_engine(backend='transformers', model={model!r}, dtype='float32') as e:\n"
        "    out = e.generate(['Hello'], {'max_new_tokens': 2, 'temperature': 0})[0].outputs[0].token_ids\n"
        "print(json.dumps({'rows': rows, 'errors': errors, 'tokens': out}))\n"
    )
    proc = run_with(dirs, code)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    rows, errors = got["rows"], got["errors"]
    assert rows["transformers"][0] and rows["example"][0], rows
    assert len(got["tokens"]) == 2
    loadable, reason, dist = rows["badparam"]
    assert not loadable and dist == "genengine-badhook-backend"
    assert reason.startswith("plugin failed to register: ") and "register_backends(reg)" in reason
    assert "genengine calls register_backends(register)" in reason and "\n" not in reason
    loadable, reason, dist = rows["badname"]
    assert not loadable and dist == "genengine-badhook-backend"
    assert "registered no backend" in reason and "register_backend," in reason
    assert "genengine calls register_backends(register)" in reason
    msg, cause = errors["badparam"]
    assert "'badparam' cannot be used" in msg and "genengine-badhook-backend" in msg and "(reg)" in msg
    assert cause == "PluginValidationError"
    assert "'badname' cannot be used" in errors["badname"][0]

    proc = cli_with(dirs, "backends")
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert "loadable" in lines["transformers"] and "loadable" in lines["example"]
    assert "plugin failed to register" in lines["badparam"] and "plugin failed to register" in lines["badname"]
    assert "error registering genengine plugin 'badparam' (distribution 'genengine-badhook-backend')" in proc.stderr


def test_duplicate_backend_name_keeps_the_first_and_isolates_the_second(plugin_dirs: dict[str, Path]) -> None:
    """Issue 40 (A9c): a second plugin registering 'example' made every registry call raise, built-ins too."""
    dirs = [plugin_dirs["example"], plugin_dirs["duplicate"]]
    code = (
        "import json, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import genengine\n"
        "    rows = {b.name: [b.loadable, b.reason, b.distribution] for b in genengine.available_backends()}\n"
        "from genengine.errors import BackendImportError, DuplicateBackendError\n"
        "e = genengine.create_engine(backend='example', model='m')\n"
        "try:\n"
        "    genengine.create_engine(backend='duplicate', model='m')\n"
        "except BackendImportError as exc:\n"
        "    error = [str(exc), type(exc.__cause__).__name__]\n"
        "print(json.dumps({'rows': rows, 'engine': type(e).__name__, 'error': error,\n"
        "                  'warnings': [str(w.message) for w in caught]}))\n"
    )
    proc = run_with(dirs, code)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    rows = got["rows"]
    assert rows["example"] == [True, None, "genengine-example-backend"]  # the first one is kept and works
    assert got["engine"] == "EchoEngine" and rows["transformers"][:2] == [True, None]
    loadable, reason, dist = rows["duplicate"]  # the second, under its plugin's name, not usable
    assert not loadable and dist == "genengine-duplicate-backend"
    assert "'example' is registered twice" in reason and "genengine-example-backend" in reason
    assert [w for w in got["warnings"] if "'example' is registered twice" in w and "the first is used" in w]
    msg, cause = got["error"]
    assert "'duplicate' cannot be used" in msg and "genengine-duplicate-backend" in msg
    assert cause == "DuplicateBackendError"

    proc = cli_with(dirs, "backends")
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert "loadable" in lines["example"] and "loadable" in lines["transformers"]
    assert "registered twice" in lines["duplicate"] and "registered twice" in proc.stderr


def test_plugin_registration_mistakes_are_named(plugin_dirs: dict[str, Path]) -> None:
    """Issue 40 (A9a, b, c): a missing requirement is named (not "pip install <the plugin itself>"), a misspelt
    factory is a BackendImportError naming backend, distribution and string, and a built-in's name taken by a
    plugin leaves the built-in in place."""
    code = (
        "import json, warnings\n"
        "warnings.simplefilter('ignore')\n"
        "import genengine\n"
        "from genengine.errors import BackendImportError\n"
        "rows = {b.name: [b.loadable, b.reason, b.distribution] for b in genengine.available_backends()}\n"
        "errors = {}\n"
        "for name in ('needsdep', 'typoattr', 'typomodule'):\n"
        "    try:\n"
        "        genengine.create_engine(backend=name, model='m')\n"
        "    except BackendImportError as e:\n"
        "        errors[name] = str(e)\n"
        "print(json.dumps({'rows': rows, 'errors': errors}))\n"
    )
    proc = run_with([plugin_dirs["typo"]], code)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    rows, errors = got["rows"], got["errors"]
    dist = "genengine-typo-backend"
    # (a) the missing module is named; the hint that only reinstalls the plugin is dropped
    assert rows["needsdep"] == [
        False, "not installed: missing module(s) genengine_dependency_that_does_not_exist", dist
    ]  # fmt: skip
    assert "genengine_dependency_that_does_not_exist" in errors["needsdep"]
    assert "pip install genengine-typo-backend" not in errors["needsdep"]
    # (b) a misspelt attribute: listed loadable (finding out would import the engine), refused clearly
    msg = errors["typoattr"]
    assert "'typoattr'" in msg and dist in msg and "'genengine_typo_backend:Engin'" in msg, msg
    # (b) a misspelt module: seen without importing anything, so listed as not loadable, and refused clearly
    loadable, reason, _ = rows["typomodule"]
    assert not loadable and "'genengine_typo_backendd'" in reason and dist in reason, reason
    msg = errors["typomodule"]
    assert "'typomodule'" in msg and dist in msg and "'genengine_typo_backendd:Engine'" in msg, msg
    # (c) 'transformers' again: the built-in is kept, the plugin's copy is listed under the plugin's name
    assert rows["transformers"] == [True, None, "genengine"]
    assert not rows["typo"][0] and "'transformers' is registered twice" in rows["typo"][1]

    proc = cli_with([plugin_dirs["typo"]], "backends")
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert "loadable" in lines["transformers"] and lines["transformers"].split()[1] == "genengine"
    assert "missing module(s) genengine_dependency_that_does_not_exist" in lines["needsdep"]


def test_unknown_backend_lists_installed_and_how_to_install() -> None:
    with pytest.raises(BackendNotFoundError) as info:
        create_engine(backend="sglangg", model="m")
    msg = str(info.value)
    assert "'sglangg'" in msg and "transformers" in msg
    if not get_backend("transformers").missing and "sglang" not in {b.name for b in available_backends() if b.loadable}:
        assert "pip install 'genengine[sglang]'" in msg


@pytest.mark.skipif(
    any(b.name == "sglang" and b.loadable for b in available_backends()), reason="sglang is installed here"
)
def test_missing_engine_package_is_a_clear_import_error() -> None:
    with pytest.raises(BackendImportError, match=r"pip install 'genengine\[sglang\]'"):
        create_engine(backend="sglang", model="m")


class _Engine:
    """A fake engine class, to test that create_engine accepts classes and instances."""

    def __init__(self, config: genengine.EngineConfig) -> None:
        self.config = config

    def generate(self) -> None: ...
    def sleep(self) -> None: ...
    def wake(self) -> None: ...
    def load_weights(self) -> None: ...
    def flush_cache(self) -> None: ...
    def shutdown(self) -> None: ...


def test_engine_class_and_instance_accepted_as_backend() -> None:
    engine = create_engine(backend=_Engine, model="m", mem_util=0.5, attention_backend="triton")
    assert isinstance(engine, _Engine)
    assert engine.config.mem_util == 0.5 and engine.config.options == {"attention_backend": "triton"}
    assert create_engine({"backend": engine}) is engine
    with pytest.raises(ConfigError, match="neither a backend name"):
        create_engine(backend=42, model="m")


def test_backend_needs_a_model() -> None:
    with pytest.raises(ConfigError, match="needs a model"):
        create_engine(backend="transformers")


def test_all_errors_share_one_base() -> None:
    import genengine.errors as errors

    classes = [getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)]
    assert len(classes) > 10
    assert all(issubclass(c, GenEngineError) for c in classes)


def test_live_engine_tracking_is_per_class_and_drops_closed_engines() -> None:
    """The one tracker both plugins use: ``live_engines(kind)`` lists the tracked, unclosed engines of that
    class; ``untrack_engine(e, kind)`` forgets ``e`` and returns the others of ``kind`` in the same step."""
    from genengine.engine.lifecycle import live_engines, track_engine, untrack_engine

    class A:
        closed = False

    class B(A):
        pass

    a, b, c = A(), B(), B()
    for engine in (a, b, c):
        track_engine(engine)
    try:
        assert set(live_engines(B)) == {b, c} and set(live_engines(A)) == {a, b, c}
        c.closed = True
        assert live_engines(B) == [b]
        assert untrack_engine(b, B) == [c]  # still tracked (closed only): vLLM's "last engine" reads this
        assert untrack_engine(c, B) == [] and live_engines(A) == [a]
    finally:
        for engine in (a, b, c):
            untrack_engine(engine)


def test_engine_start_is_logged_once_with_what_runs(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 40 (A6): one INFO line per engine started says backend, device, dtype (the engine's: "auto" is
    what the checkpoint holds), model and tp."""
    import logging

    from genengine.models.tiny_model import tiny_model_dir

    model = str(tiny_model_dir())
    with caplog.at_level(logging.INFO, logger="genengine"):
        with create_engine(backend="transformers", model=model, dtype="auto", max_batch_size=2):
            pass
        create_engine(backend=_Engine, model="m", tp_size=2)
    lines = [
        r.getMessage() for r in caplog.records if r.name == "genengine.plugins.registry" and r.levelno == logging.INFO
    ]
    assert lines == [
        f"genengine: started engine backend=transformers device=cpu dtype=bfloat16 model={model} tp=1",  # not 'auto'
        f"genengine: started engine backend={__name__}._Engine device=cpu dtype=bfloat16 model=m tp=2",
    ]


def test_a_broken_plugins_row_gives_way_to_a_backend_of_its_name() -> None:
    """A plugin that failed under its entry point's name does not set aside a working backend of that name."""
    import warnings

    from genengine.plugins.registry import BackendInfo, _Registry

    registry = _Registry()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        registry._fail("foo", "genengine-foo", "1.0", ImportError("no bar"), "import")
        registry._add(BackendInfo("foo", "other", "genengine-other", "2.0", factory=_Engine))
        registry._add(BackendInfo("foo", "third", "genengine-third", "3.0", factory=_Engine))
    rows = {name: (b.plugin, b.loadable) for name, b in registry.backends.items()}
    assert rows == {"foo": ("other", True), "foo@foo": ("foo", False), "third": ("third", False)}
    assert "'foo' is registered twice" in str(registry.backends["third"].error)
