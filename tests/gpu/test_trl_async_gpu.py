"""TRL's AsyncGRPOTrainer on a GPU engine (SGLang or vLLM), through genengine.integrations.trl_async.

``examples/trl_async_grpo.py`` on the tiny random Qwen2 (or ``GENENGINE_TRL_ASYNC_MODEL``, a model folder),
engine and trainer on the same GPU (the engine takes 0.3 of its memory), 6 steps of 16 samples: what must hold
is that every step trains, what it trains is at most ``max_staleness`` (1) versions old, and the engine ends at
the trainer's version (one sync at start-up, one per step). Each step's samples/s and staleness are printed and
land in ``$OUT/trl_async_grpo_ENGINE.json`` (the figures for docs/benchmarks.md). Needs TRL (the kit's
``WITH_TRL=1``). The engine is SGLang when it is importable, else vLLM (``GENENGINE_TRL_ASYNC_BACKEND``
overrides), as the GPU kit installs one per run:

    bash tools/gpu/run_tests.sh sglang tests/gpu/test_trl_async_gpu.py
    bash tools/gpu/run_tests.sh vllm tests/gpu/test_trl_async_gpu.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
    pytest.skip("needs trl and datasets (the GPU kit carries them with WITH_TRL=1)", allow_module_level=True)

from support.gpu_checks import installed_engine  # noqa: E402

pytestmark = pytest.mark.gpu

if importlib.util.find_spec("flashinfer") is None:  # a setting of the GPU kit, as in test_vllm_gpu.py
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 6


def test_async_grpo_trainer_on_the_gpu_engine(tmp_path: Path) -> None:
    backend = installed_engine("GENENGINE_TRL_ASYNC_BACKEND")
    if backend is None:
        pytest.skip("neither sglang nor vllm is installed")
    sys.path.insert(0, str(EXAMPLES))
    import trl_async_grpo

    out = Path(os.environ.get("OUT", str(tmp_path))) / f"trl_async_grpo_{backend}.json"
    argv = ["--backend", backend, "--steps", str(STEPS), "--json", str(out), "--out-dir", str(tmp_path / "run")]
    model = os.environ.get("GENENGINE_TRL_ASYNC_MODEL")
    rows = trl_async_grpo.main([*argv, *(["--model", model] if model else [])])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["samples"] == 16 and r["staleness_max"] <= 1 for r in rows), rows
    assert all(r["samples_per_s"] and r["samples_per_s"] > 0 for r in rows[1:]), rows
    report = json.loads(out.read_text())
    assert report["engine_weight_version"] == report["trainer_model_version"] == STEPS + 1
    assert report["syncs"] == STEPS + 1 and "error" not in report


def test_async_grpo_trainer_with_a_lora_policy_on_the_gpu_engine(tmp_path: Path) -> None:
    """The same run with a rank-16 LoRA policy (``--lora 16``: ``peft_config=``, the engine started with LoRA
    enabled): every sync after the start-up one sends only the adapter, and no sample spans a sync (a request in
    flight finishes under the adapter it started with). Lands in ``$OUT/trl_async_grpo_ENGINE_lora.json``."""
    backend = installed_engine("GENENGINE_TRL_ASYNC_BACKEND")
    if backend is None:
        pytest.skip("neither sglang nor vllm is installed")
    if importlib.util.find_spec("peft") is None:
        pytest.skip("needs peft")
    if backend == "sglang":
        from genengine_sglang.compat import lora_tensors_per_rank

        if not lora_tensors_per_rank():  # compat.BRANCHES: enable_lora is refused before 0.5.17
            pytest.skip("this SGLang takes adapters from tensors in another shape than genengine sends (0.5.17 on)")
    sys.path.insert(0, str(EXAMPLES))
    import trl_async_grpo

    out = Path(os.environ.get("OUT", str(tmp_path))) / f"trl_async_grpo_{backend}_lora.json"
    argv = ["--backend", backend, "--steps", str(STEPS), "--lora", "16", "--json", str(out)]
    model = os.environ.get("GENENGINE_TRL_ASYNC_MODEL")
    rows = trl_async_grpo.main([*argv, "--out-dir", str(tmp_path / "run"), *(["--model", model] if model else [])])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["samples"] == 16 and r["staleness_max"] <= 1 for r in rows), rows
    assert all(r["mixed_version_samples"] == 0 for r in rows), rows
    report = json.loads(out.read_text())
    assert report["sync_mode"] == "adapter" and "error" not in report, report
    assert report["engine_weight_version"] == report["trainer_model_version"] == STEPS + 1
    assert report["syncs"] == STEPS + 1 and report["last_adapter"]["tensors"] > 0
