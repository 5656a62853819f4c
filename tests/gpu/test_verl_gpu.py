"""verl 0.9.1's own trainer on one GPU (marker gpu): ``examples/verl_grpo.sh`` (``python -m verl.trainer.main_ppo``,
GRPO, FSDP actor, hybrid rollout, a tiny random Qwen2, a generated parquet and a rule reward) for 5 steps with
``rollout.name=genengine`` on the installed engine, and the same config with verl's own rollout of that engine
(``rollout.name=vllm`` or ``sglang``) for the step-time comparison: two tests, each a run of its own (together
they can outlast one device command: ``GENENGINE_VERL_BASELINE`` picks).

Checked (genengine): the run ends 0 after 5 steps, every step logs a weight update (``timing_s/update_weights``)
and a reward (``critic/score/mean``), and once the trainer's processes are gone no process holds memory on the GPU.
Each run writes ``$OUT/verl_steps_ENGINE_ROLLOUT.json`` (ROLLOUT ``genengine`` or ``verl``): seconds per step split
into generate (``timing_s/gen``), weight update (``timing_s/update_weights``) and the rest (median of steps 2-5:
step 1 compiles and warms up), or verl's failure with the log's tail.

    WITH_RAY=1 WITH_VERL=1 bash tools/gpu/prepare.sh ENGINE gpu-kit   # then the kit's install calls
    bash tools/gpu/run_tests.sh ENGINE tests/gpu/test_verl_gpu.py                                  # both runs
    GENENGINE_VERL_BASELINE=0 bash tools/gpu/run_tests.sh ENGINE tests/gpu/test_verl_gpu.py       # genengine's only
    GENENGINE_VERL_BASELINE=only bash tools/gpu/run_tests.sh ENGINE tests/gpu/test_verl_gpu.py    # verl's own only
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("ray")
from support.gpu_checks import gpu_memory_by_process_per_gpu, installed_engine  # noqa: E402
from support.installed import installed  # noqa: E402
from support.stacks import dump_stacks_and_kill  # noqa: E402

from genengine.integrations.verl.config import trl_conflict  # noqa: E402

if not installed("verl"):  # not imported: the trainer runs in its own process, and collection would import verl
    pytest.skip("verl 0.9.1 is not installed (the GPU kit's WITH_VERL=1)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
ENGINE = installed_engine("GENENGINE_VERL_BACKEND")
STEPS = 5
_LINE = re.compile(r"step:(\d+) - (.*)")


def _overrides(engine: str, rollout: str) -> list[str]:
    """The kit's SGLang settings (tools/gpu/run_tests.sh's GENENGINE_SGLANG_OPTIONS: no FlashAttention 3, no
    JIT-compiled sampling), as genengine's options or as verl's own ``engine_kwargs.sglang``."""
    if engine != "sglang":
        return []
    options = json.loads(os.environ.get("GENENGINE_SGLANG_OPTIONS", "{}"))
    key = "genengine.options" if rollout == "genengine" else "sglang"
    return [f"+actor_rollout_ref.rollout.engine_kwargs.{key}.{k}={v}" for k, v in options.items()]


SITE = Path(__file__).resolve().parents[1] / "support" / "verl_site"  # sitecustomize: hides TRL, dumps stacks
RUN_TIMEOUT_S = float(os.environ.get("GENENGINE_VERL_RUN_TIMEOUT_S", "1500"))
"""How long one run may take before its processes' stacks are dumped and it is killed (verify.sh sets it under
the part's timeout, so that the stacks come back)."""


def _run(rollout: str, engine: str, out: Path, extra: list[str]) -> tuple[int, list[dict[str, float]], str]:
    env = {**os.environ, "ROLLOUT": rollout, "BACKEND": engine, "STEPS": str(STEPS), "OUT": str(out)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH")]))
    if trl_conflict() is not None:  # the installed TRL lacks what verl 0.9.1's FSDP workers import from it
        env["GENENGINE_HIDE_TRL"] = "1"
    env.setdefault("GENENGINE_LOGGING_LEVEL", "INFO")  # genengine's lines in the log too (verl's root is WARNING)
    # The log streams to a file under $OUT (verify.sh's work folder, sent back even when the part times out), and
    # each process's stacks go beside it when the run outlasts RUN_TIMEOUT_S: where a run that never ends got to.
    report_dir = Path(os.environ.get("OUT", out))
    stacks = report_dir / f"verl_stacks_{rollout}_{engine}"
    env["GENENGINE_STACKS_DIR"] = str(stacks)
    out.mkdir(parents=True, exist_ok=True)
    log_path = report_dir / f"verl_{rollout}_{engine}.log"
    with log_path.open("w") as sink:
        proc = subprocess.Popen(
            ["bash", str(ROOT / "examples" / "verl_grpo.sh"), *extra], env=env, stdout=sink, stderr=subprocess.STDOUT
        )
        try:
            proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            dump_stacks_and_kill("GENENGINE_STACKS_DIR", str(stacks))
            proc.wait()
            pytest.fail(
                f"the {rollout} run did not end in {RUN_TIMEOUT_S:g} s; every process's stacks are in {stacks}; "
                f"the log's end:\n{log_path.read_text(errors='replace')[-4000:]}"
            )
    log = log_path.read_text(errors="replace")
    steps: list[dict[str, float]] = []
    for match in _LINE.finditer(log):
        metrics: dict[str, float] = {}
        for item in match.group(2).split(" - "):
            key, _, value = item.partition(":")
            try:
                metrics[key.strip()] = float(value)
            except ValueError:
                continue
        metrics["step"] = float(match.group(1))
        steps.append(metrics)
    return proc.returncode, steps, log


def _split(steps: list[dict[str, float]]) -> dict[str, Any]:
    later = steps[1:] or steps
    gen = statistics.median(s.get("timing_s/gen", 0.0) for s in later)
    update = statistics.median(s.get("timing_s/update_weights", 0.0) for s in later)
    step = statistics.median(s.get("timing_s/step", 0.0) for s in later)
    return {
        "generate_s": gen,
        "update_weights_s": update,
        "rest_s": step - gen - update,
        "step_s": step,
        "steps": len(steps),
    }


def _gpu_processes(timeout_s: float = 60.0) -> dict[str, dict[int, float]]:
    """NVML's processes per GPU, once none holds memory or after ``timeout_s`` (Ray's workers exit after the
    driver)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {gpu: procs for gpu, procs in gpu_memory_by_process_per_gpu().items() if procs}
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(1)


BASELINE = os.environ.get("GENENGINE_VERL_BASELINE", "1")
"""``1``: both runs (one after the other: over one command's 10 minutes on a cold machine); ``0``: genengine's
only; ``only``: verl's own rollout only (the comparison in a call of its own)."""


def _write(name: str, report: dict[str, Any], tmp_path: Path) -> None:
    out = Path(os.environ.get("OUT", tmp_path))
    (out / name).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


@pytest.mark.skipif(ENGINE is None, reason="needs SGLang or vLLM")
@pytest.mark.skipif(BASELINE == "only", reason="GENENGINE_VERL_BASELINE=only: verl's own rollout only")
def test_verl_grpo_runs_on_genengine(tmp_path: Path) -> None:
    assert ENGINE is not None
    code, steps, log = _run("genengine", ENGINE, tmp_path / "genengine", _overrides(ENGINE, "genengine"))
    assert code == 0, log[-6000:]
    assert [int(s["step"]) for s in steps] == list(range(1, STEPS + 1)), log[-3000:]
    for s in steps:
        assert "timing_s/update_weights" in s and "critic/score/mean" in s, s
    _write(f"verl_steps_{ENGINE}_genengine.json", {"engine": ENGINE, "steps": STEPS, **_split(steps)}, tmp_path)
    assert not _gpu_processes(), f"processes still hold GPU memory after the run: {_gpu_processes(0)}"


@pytest.mark.skipif(ENGINE is None, reason="needs SGLang or vLLM")
@pytest.mark.skipif(BASELINE == "0", reason="GENENGINE_VERL_BASELINE=0: genengine's rollout only")
def test_verls_own_rollout_of_the_same_engine(tmp_path: Path) -> None:
    """The comparison's other side: the same recipe on verl's own rollout (verl 0.9.1 is written against vLLM 0.24
    and SGLang 0.5.12; a failure on another release is recorded in the JSON before the test fails)."""
    assert ENGINE is not None
    code, steps, log = _run(ENGINE, ENGINE, tmp_path / "verl", _overrides(ENGINE, ENGINE))
    ok = code == 0 and len(steps) == STEPS
    report = _split(steps) if ok else {"error": f"exit {code}, {len(steps)} step(s)", "tail": log[-3000:]}
    _write(f"verl_steps_{ENGINE}_verl.json", {"engine": ENGINE, "steps": STEPS, **report}, tmp_path)
    assert ok, log[-6000:]
