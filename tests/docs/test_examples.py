"""The trainer-facing examples: every YAML is a valid engine config for its backend, and the worked RL loop
really runs on the CPU (and really learns, which it can only do if ``load_weights`` reaches the engine)."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

from genengine import EngineConfig
from genengine.models.tiny_model import tiny_model_dir

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BACKENDS = ("transformers", "sglang", "vllm")


@pytest.mark.parametrize("backend", BACKENDS)
def test_yaml_loads_into_engine_config(backend: str) -> None:
    config = EngineConfig.from_yaml(EXAMPLES / "configs" / f"{backend}.yaml")
    assert config.backend == backend
    assert config.enable_sleep is True and config.tp_size == 1
    assert config.options, "each example shows its backend's options"


@pytest.mark.parametrize("backend", BACKENDS)
def test_yaml_options_pass_the_backends_own_checks(backend: str) -> None:
    """The option checks run without the engine installed, so a typo in an example fails here."""
    config = EngineConfig.from_yaml(EXAMPLES / "configs" / f"{backend}.yaml").replace(model=str(tiny_model_dir()))
    if backend == "transformers":
        from genengine.backends.transformers.engine import OPTIONS
        from genengine.config import check_options

        check_options(backend, config.options, OPTIONS)
    elif backend == "sglang":
        from genengine_sglang.settings import resolve_settings as resolve_sglang

        assert resolve_sglang(config, environ={}).mem_util == config.mem_util
    else:
        from genengine_vllm.settings import resolve_settings

        assert resolve_settings(config).weight_sync_mode == "bucketed"


def test_each_backend_has_a_script() -> None:
    for backend in BACKENDS:
        text = (EXAMPLES / f"rl_loop_{backend}.py").read_text()
        assert f'"configs" / "{backend}.yaml"' in text


def test_rl_loop_runs_on_cpu_and_learns(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # The script as ``python examples/rl_loop_transformers.py --steps 8`` runs it (``__main__``, its argv), in
    # this process: a fresh interpreter would only add its torch and transformers imports (5-6 s of CPU on the
    # 2-core CI machine), which every other test of the suite already pays for.
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / "rl_loop_transformers.py"), "--steps", "8"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts examples/ first
    runpy.run_path(str(EXAMPLES / "rl_loop_transformers.py"), run_name="__main__")
    stdout = capsys.readouterr().out
    rows = re.findall(r"step (\d+): reward ([\d.]+)\s+\|engine-trainer logprob\| ([\d.e+-]+)", stdout)
    assert [int(r[0]) for r in rows] == list(range(8)), stdout
    rewards = [float(r[1]) for r in rows]
    drifts = [float(r[2]) for r in rows]
    # The engine samples from the weights the trainer pushed: its logprobs agree with the trainer's ...
    assert max(drifts) < 1e-4
    # ... and the policy it serves improves on the toy reward.
    assert sum(rewards[-2:]) / 2 > rewards[0] + 0.1, rewards
