"""GPU: a trainer holding a real SGLang or vLLM engine dies, and nothing of the engine survives it.

Each case starts a trainer child (this file run as a script) that creates an engine through
``genengine.create_engine``, generates, reports READY, and is then ended by SIGTERM, SIGINT (Ctrl-C),
SIGKILL, an uncaught exception, or a normal exit *without* ``shutdown()``. Afterwards every process of its
tree, and any process carrying the run's environment marker (orphans wherever they were re-parented), must be
gone, and the GPU's free memory must be back where it was before the trainer started. SGLang's engine
processes die with the trainer through ``PR_SET_PDEATHSIG`` (SGLang sets it in its scheduler and
detokenizer) and ``genengine.engine.lifecycle.at_exit`` (normal exit, exception, Ctrl-C); vLLM runs in the trainer's
process. The CPU twin, with the controls that show the checks can fail, is tests/core/test_cleanup.py.

The engine is SGLang when it is importable, else vLLM (``GENENGINE_CLEANUP_BACKEND`` overrides); SGLang's
machine settings come from ``$GENENGINE_SGLANG_OPTIONS`` as tools/gpu/run_tests.sh sets them. Run:

    bash tools/gpu/run_tests.sh sglang tests/gpu/test_cleanup_gpu.py
    bash tools/gpu/run_tests.sh vllm tests/gpu/test_cleanup_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve()
ENDINGS = ("sigkill", "sigterm", "sigint", "exception", "exit")
GIB = 1 << 30
MEMORY_SLACK = 512 << 20  # what may stay taken after the trainer is gone (allocator noise, not an engine)


def _engine_options(backend: str) -> dict[str, Any]:
    """Fast-starting settings; SGLang's machine settings arrive through $GENENGINE_SGLANG_OPTIONS."""
    if backend == "sglang":
        return {"mem_util": 0.3, "disable_cuda_graph": True, "log_level": "warning"}
    return {"mem_util": 0.3, "disable_cuda_graph": True, "max_model_len": 1024}


# ---- the trainer child ----------------------------------------------------------------------------------------
def _trainer(backend: str, ending: str, model: str) -> None:
    from genengine import create_engine

    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(key, value)
    engine = create_engine(backend=backend, model=model, **_engine_options(backend))
    params = {"temperature": 0.0, "max_new_tokens": 8}
    engine.generate(["The quick brown fox"], params)
    print(f"READY pid={os.getpid()}", flush=True)
    if ending in ("exit", "exception"):
        sys.stdin.readline()  # the test has recorded the process tree
        if ending == "exception":
            raise RuntimeError("the trainer crashed")
        return  # no shutdown(): the exit path must stop the engine
    while True:  # signals arrive while the trainer works
        engine.generate(["Once upon a time"], params)
        time.sleep(0.05)


# ---- the tests ------------------------------------------------------------------------------------------------
pytestmark = pytest.mark.gpu


def _free_bytes() -> int:
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def _nvidia_smi_apps() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(nvidia-smi: {exc})"


@pytest.fixture(scope="module")
def setup() -> dict[str, Any]:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from support.gpu_checks import installed_engine

    backend = installed_engine("GENENGINE_CLEANUP_BACKEND")
    if backend is None:
        pytest.skip("needs sglang or vllm")
    from genengine.models.tiny_model import tiny_model_dir

    torch.cuda.init()
    return {"backend": backend, "model": str(tiny_model_dir()), "record": {}}


@pytest.mark.parametrize("ending", ENDINGS)
def test_trainer_death_leaves_no_engine_process_and_frees_the_gpu(setup: dict[str, Any], ending: str) -> None:
    from support.processes import TrainerRun

    backend, model = setup["backend"], setup["model"]
    before = _free_bytes()
    out = os.environ.get("OUT")
    log = str(Path(out) / f"cleanup_{backend}_{ending}.log") if out else None
    run = TrainerRun([sys.executable, str(HERE), backend, ending, model], ending, log_path=log)
    outcome = run.finish(ready_timeout_s=240, exit_timeout_s=120, gone_timeout_s=60)
    deadline = time.monotonic() + 60
    after = _free_bytes()
    while after < before - MEMORY_SLACK and time.monotonic() < deadline:  # the driver frees a dead context lazily
        time.sleep(0.5)
        after = _free_bytes()
    setup["record"][ending] = {
        "returncode": outcome.returncode,
        "exit_seconds": round(outcome.exit_seconds, 2),
        "tree": [p.describe() for p in outcome.tree],
        "survivors": [p.describe() for p in outcome.survivors],
        "free_before_gib": round(before / GIB, 2),
        "free_after_gib": round(after / GIB, 2),
    }
    if out:
        (Path(out) / f"cleanup_{backend}.json").write_text(json.dumps(setup["record"], indent=1))
    assert outcome.returncode is not None, f"the trainer did not exit: {outcome.describe()}"
    assert not outcome.survivors, f"engine processes outlived the trainer: {outcome.describe()}"
    if backend == "sglang":
        assert len(outcome.tree) >= 2, f"expected SGLang's scheduler and detokenizer: {outcome.describe()}"
    assert after >= before - MEMORY_SLACK, (
        f"GPU memory not given back after {ending}: free {before / GIB:.2f} GiB before the trainer, "
        f"{after / GIB:.2f} GiB after; nvidia-smi: {_nvidia_smi_apps()}\n{outcome.describe()}"
    )
    if ending == "exception":
        assert "RuntimeError: the trainer crashed" in outcome.output


if __name__ == "__main__":
    _trainer(sys.argv[1], sys.argv[2], sys.argv[3])
