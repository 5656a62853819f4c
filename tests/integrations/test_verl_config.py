"""The verl plugin's registration and config mapping, without Ray: fast checks of what
tests/integrations/test_verl.py runs for real. The config mapping needs no verl at all (plain mappings stand in
for verl's configs)."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from genengine.errors import BackendNotFoundError, ConfigError
from genengine.integrations.verl.config import engine_settings, trl_conflict

ROOT = Path(__file__).resolve().parents[2]


def rollout(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "genengine",
        "tensor_model_parallel_size": 2,
        "data_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "n_gpus_per_node": 8,
        "nnodes": 0,
        "gpu_memory_utilization": 0.6,
        "dtype": "bfloat16",
        "max_model_len": 2048,
        "prompt_length": 512,
        "response_length": 256,
        "free_cache_engine": True,
        "seed": 7,
        "engine_kwargs": {
            "vllm": {},
            "sglang": {},
            "genengine": {"backend": "vllm", "options": {"enforce_eager": True}},
        },
    }
    base.update(changes)
    return base


def test_verl_fields_map_onto_the_engine_config() -> None:
    """Model, TP, memory share, dtype, seed from verl's fields; max_model_len as the backend's own option."""
    s = engine_settings(rollout(), {"path": "/models/qwen"}, check_backend=False)
    e = s.engine
    assert (e.backend, e.model, e.tp_size, e.mem_util, e.dtype, e.seed) == (
        "vllm",
        "/models/qwen",
        2,
        0.6,
        "bfloat16",
        7,
    )
    assert e.options == {"enforce_eager": True, "max_model_len": 2048}
    assert (s.transport, s.sleep_level, s.prompt_length, s.response_length) == ("cuda_ipc", 2, 512, 256)
    sglang = rollout(engine_kwargs={"genengine": {"backend": "sglang"}})
    assert engine_settings(sglang, {"path": "/m"}, check_backend=False).engine.options == {"context_length": 2048}
    local = {"path": "hdfs://x", "local_path": "/tmp/x"}  # verl's HFModelConfig copies the model to local_path
    assert engine_settings(rollout(), local, check_backend=False).engine.model == "/tmp/x"
    cpu = rollout(engine_kwargs={"genengine": {"backend": "transformers"}})
    assert engine_settings(cpu, None, check_backend=False).transport == "gloo"


def test_verls_enforce_eager_is_the_backends_disable_cuda_graph() -> None:
    """verl's ``enforce_eager=True`` (the GPU recipe's) reaches vLLM and SGLang as ``disable_cuda_graph``, as verl's
    own servers pass it: otherwise the engine captures CUDA graphs and vLLM compiles with torch.compile, whose cache
    verl's runtime env turns off, minutes of a GPU run spent before the first step. An explicit option wins; a
    backend without the option gets nothing."""
    for backend in ("vllm", "sglang"):
        eager = rollout(enforce_eager=True, engine_kwargs={"genengine": {"backend": backend}})
        assert engine_settings(eager, {"path": "/m"}, check_backend=False).engine.options["disable_cuda_graph"] is True
        graphs = rollout(enforce_eager=False, engine_kwargs={"genengine": {"backend": backend}})
        assert "disable_cuda_graph" not in engine_settings(graphs, {"path": "/m"}, check_backend=False).engine.options
    explicit = rollout(
        enforce_eager=True, engine_kwargs={"genengine": {"backend": "sglang", "options": {"disable_cuda_graph": False}}}
    )
    assert engine_settings(explicit, {"path": "/m"}, check_backend=False).engine.options["disable_cuda_graph"] is False
    cpu = rollout(
        enforce_eager=True, tensor_model_parallel_size=1, engine_kwargs={"genengine": {"backend": "transformers"}}
    )
    assert "disable_cuda_graph" not in engine_settings(cpu, {"path": "/m"}).engine.options  # its own check passes


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"engine_kwargs": {"genengine": {}}}, ConfigError, "backend is not set"),
        ({"engine_kwargs": {"genengine": {"backend": "nosuch"}}}, BackendNotFoundError, "unknown backend 'nosuch'"),
        ({"engine_kwargs": {"genengine": {"backend": "vllm", "sleep_levl": 1}}}, ConfigError, "did you mean"),
        ({"engine_kwargs": {"genengine": "sglang"}}, ConfigError, "must be a mapping"),
        ({"tensor_model_parallel_size": 3}, ConfigError, "tensor_model_parallel_size=3 does not divide the 8"),
        ({"tensor_model_parallel_size": 16, "nnodes": 2}, ConfigError, "larger than n_gpus_per_node=8"),
        ({"data_parallel_size": 2}, ConfigError, "data_parallel_size=2 is not supported"),
        ({"pipeline_model_parallel_size": 2}, ConfigError, "pipeline_model_parallel_size=2 is not supported"),
        ({"gpu_memory_utilization": 1.5}, ConfigError, "mem_util=1.5"),
        ({"engine_kwargs": {"genengine": {"backend": "vllm", "transport": "tcp"}}}, ConfigError, "transport='tcp'"),
        ({"engine_kwargs": {"genengine": {"backend": "vllm", "sleep_level": 3}}}, ConfigError, "sleep_level=3"),
        ({"name": "vllm"}, ConfigError, "name='vllm'"),
    ],
)
def test_bad_configs_are_refused_naming_the_verl_key(changes: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        engine_settings(rollout(**changes), {"path": "/m"}, check_backend="nosuch" in str(changes))


def test_a_bad_backend_option_is_the_backends_own_error() -> None:
    """The backend's option check runs (registry.check_engine_config), under verl's key."""
    cfg = rollout(engine_kwargs={"genengine": {"backend": "transformers", "options": {"max_batch_sise": 2}}})
    with pytest.raises(ConfigError, match=r"engine_kwargs\.genengine: .*max_batch_sise"):
        engine_settings(cfg, {"path": "/m"})


def test_the_entry_point_is_declared_for_verl() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["verl.plugins"] == {"genengine": "genengine.integrations.verl.plugin"}
    assert "verl==0.9.1; python_version < '3.13'" in project["optional-dependencies"]["verl"]


def test_import_verl_loads_the_entry_point_and_registers_genengine(tmp_path: Path) -> None:
    """The entry point as an installed distribution declares it (its entry_points.txt), loaded by ``import verl``
    itself in a fresh process: rollout.name=genengine resolves to the replica and the adapter."""
    import subprocess

    pytest.importorskip("verl.workers.rollout.replica", reason="verl 0.9.1 is not installed (make setup installs it)")
    info = tmp_path / "genengine_verl_probe-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: genengine-verl-probe\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[verl.plugins]\ngenengine = genengine.integrations.verl.plugin\n")
    code = (
        "import verl\n"
        "from verl.workers.rollout.replica import get_rollout_replica_class\n"
        "from verl.workers.rollout.base import get_rollout_class\n"
        "print(get_rollout_replica_class('genengine').__name__, get_rollout_class('genengine').__name__)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["GenEngineReplica", "GenEngineServerAdapter"]


def test_the_plugin_registers_the_replica_and_the_adapter() -> None:
    pytest.importorskip("verl.workers.rollout.replica", reason="verl 0.9.1 is not installed (make setup installs it)")
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    plugin = importlib.import_module("genengine.integrations.verl.plugin")
    assert plugin.register() is True
    assert _ROLLOUT_REGISTRY[("genengine", "async")] == plugin.ADAPTER
    assert RolloutReplicaRegistry.get("genengine").__name__ == "GenEngineReplica"


def test_a_failure_to_register_is_a_warning_naming_the_cause(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """verl logs a failing plugin at DEBUG only; ours says why at WARNING and never raises into ``import verl``."""
    plugin = importlib.import_module("genengine.integrations.verl.plugin")
    monkeypatch.setitem(sys.modules, "verl.workers.rollout.replica", None)  # import fails: ModuleNotFoundError
    caplog.clear()  # what importing the plugin logged (the installed TRL's warning, when first imported here)
    with caplog.at_level(logging.WARNING, logger="genengine.integrations.verl"):
        assert plugin.register() is False
    [record] = [r for r in caplog.records if r.name == "genengine.integrations.verl"]
    assert record.levelno == logging.WARNING
    assert "rollout.name=genengine" in record.getMessage()
    assert "verl.workers.rollout.replica" in record.getMessage()


def test_genengine_logging_level_shows_genengine_info_under_verls_warning_root(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``import verl`` sets the root logger to WARNING (verl/__init__.py): genengine's INFO lines vanish in the
    run's workers unless $GENENGINE_LOGGING_LEVEL asks for them; a bad value is named, never raised."""
    plugin = importlib.import_module("genengine.integrations.verl.plugin")
    logger = logging.getLogger("genengine")
    monkeypatch.setattr(logger, "level", logger.level)
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", False)  # as in a worker whose root has no handler
    logging.getLogger("genengine.integrations.verl.server").info("hidden before")
    assert plugin.apply_log_level({}) is None
    assert plugin.apply_log_level({"GENENGINE_LOGGING_LEVEL": "info"}) == "INFO"
    logging.getLogger("genengine.integrations.verl.server").info("engine started")
    err = capfd.readouterr().err
    assert "genengine.integrations.verl.server INFO: engine started" in err and "hidden before" not in err
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.WARNING, logger="genengine.integrations.verl"):
        assert plugin.apply_log_level({"GENENGINE_LOGGING_LEVEL": "LOUD"}) is None
    assert any("GENENGINE_LOGGING_LEVEL='LOUD' is not a log level" in r.getMessage() for r in caplog.records)
    assert logger.level == logging.INFO  # left as it was


def test_a_trl_that_breaks_verls_fsdp_workers_is_named_at_plugin_load(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl 0.9.1's FSDP workers import ``AutoModelForCausalLMWithValueHead`` from any importable TRL (it pins
    0.27.0); TRL 1.16 (the dev environment's, and genengine[trl]'s) lacks it. The H200 run died of it at actor init
    with an ImportError far from the cause: the plugin names it as verl starts, and says nothing without TRL."""
    from importlib import metadata

    pytest.importorskip("verl.workers.rollout.replica", reason="verl 0.9.1 is not installed (make setup installs it)")
    plugin = importlib.import_module("genengine.integrations.verl.plugin")
    trl = metadata.version("trl")
    assert int(trl.split(".")[0]) >= 1, f"the check needs TRL 1.x installed, found {trl}"
    caplog.clear()  # what importing the plugin logged
    with caplog.at_level(logging.WARNING, logger="genengine.integrations.verl"):
        assert plugin.register() is True
    [record] = [r for r in caplog.records if r.name == "genengine.integrations.verl"]
    assert f"trl {trl}" in record.getMessage() and "trl==0.27.0" in record.getMessage()

    def no_trl(name: str) -> Any:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", no_trl)
    assert trl_conflict() is None


class _Remote:
    """``actor.method.remote(...)``'s stand-in: records the call, returns an awaitable of ``value``."""

    def __init__(self, value: Any, calls: list[Any] | None = None) -> None:
        self.value, self.calls = value, calls

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        import asyncio

        if self.calls is not None:
            self.calls.append((args, kwargs))
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.value)
        return future


class _ServerClass:
    """``ray.remote(GenEngineServer)``'s stand-in: keeps the actor options and constructor arguments."""

    def __init__(self) -> None:
        self.options_seen: dict[str, Any] = {}
        self.init_calls: list[Any] = []

    def options(self, **options: Any) -> Any:
        self.options_seen = options
        server = type("Server", (), {})()
        server.launch_server = _Remote(None)
        server.get_server_address = _Remote(("10.0.0.1", "genengine-0"))
        return type("Bound", (), {"remote": lambda _, **kw: (self.init_calls.append(kw), server)[1]})()


@pytest.mark.parametrize(("gpu_ids", "visible"), [(["3"], "3"), ([], None)])
def test_the_server_process_starts_with_the_trainer_workers_gpu_visible(gpu_ids: list[str], visible: Any) -> None:
    """The hybrid server sees the GPU of its replica's trainer worker from its process's start (the actor's
    runtime env), not from its ``__init__``: Ray unpickles verl's objects among the actor's arguments before
    ``__init__`` runs, and importing verl calls ``torch.cuda.is_available()`` (verl/utils/device.py), after which
    the process's visible GPUs are fixed. Set in ``__init__`` only (as verl's own vLLM server does: its engine runs
    in child processes), an engine in the server's own process (genengine's vLLM) would start on the host's GPU 0
    whatever the replica's GPU. Without GPUs (the CPU runs) the server gets no runtime env of its own."""
    import asyncio
    import types

    pytest.importorskip("verl.workers.rollout.replica", reason="verl 0.9.1 is not installed (make setup installs it)")
    from genengine.integrations.verl.replica import GenEngineReplica

    replica = GenEngineReplica.__new__(GenEngineReplica)  # the launch alone: the config checks have their tests
    replica.replica_rank, replica.world_size, replica.name_suffix = 0, 1, ""
    replica.is_reward_model = replica.is_teacher_model = False
    replica.config = types.SimpleNamespace(max_num_seqs=1024)
    replica.model_config, replica.rollout_mode, replica.gpus_per_replica_node = None, "hybrid", 1
    worker = types.SimpleNamespace(__ray_call__=_Remote(("ab" * 28, gpu_ids)))
    replica.workers = [worker]
    replica.server_class = _ServerClass()
    asyncio.run(replica.launch_servers())
    options = replica.server_class.options_seen
    assert options["num_cpus"] == 0 and "num_gpus" not in options  # shares the trainer's GPU, holds no Ray GPU
    assert options["scheduling_strategy"].node_id == "ab" * 28
    if visible is None:
        assert "runtime_env" not in options
    else:
        env = options["runtime_env"]["env_vars"]
        assert env["CUDA_VISIBLE_DEVICES"] == visible
        assert env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    assert replica.server_class.init_calls[0]["cuda_visible_devices"] == visible
    assert replica.server_address == "10.0.0.1:genengine-0"
