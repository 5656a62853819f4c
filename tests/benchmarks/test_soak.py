"""benchmarks/soak.py: a clean CI-sized run on the embedded engine passes; injected leaks of every kind fail it.

The GPU runs (200 cycles on SGLang and vLLM) use the same script; its judging of GPU memory is checked
here on made-up samples, since this machine has no GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOAK = ROOT / "benchmarks" / "soak.py"
MIB = 1 << 20

pytestmark = pytest.mark.timeout(240)


def _soak_module() -> Any:
    spec = importlib.util.spec_from_file_location("genengine_soak", SOAK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model() -> str:
    from genengine.models.tiny_model import tiny_model_dir

    return str(tiny_model_dir())


def _run(model: str, tmp_path: Path, *args: str) -> tuple[int, str, dict[str, Any]]:
    out = tmp_path / "soak.json"
    # One intra-op thread: the tiny model gains nothing from two, and spinning OpenMP threads make every
    # op crawl when the machine's other core is busy.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(SOAK), "--model", model, "--dtype", "float32", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, proc.stdout + proc.stderr, report


def test_clean_soak_passes(model: str, tmp_path: Path) -> None:
    code, output, report = _run(model, tmp_path, "--cycles", "30", "--strict-outputs", "--max-new-tokens", "8")
    assert code == 0, output
    assert "soak: OK" in output and not report["failures"]
    records = report["records"]
    assert [r["cycle"] for r in records] == list(range(30)) and report["warmup"] == 3
    assert all(r["buckets"] >= 1 for r in records)
    # Two weight sets that really differ, every later cycle reproducing its set's greedy outputs exactly.
    assert report["weight_sets_differ"] is True and report["output_mismatch_cycles"] == []
    for key in ("rss", "children_rss", "fds", "os_threads", "py_threads", "children"):
        assert key in records[-1]["awake"] and key in records[-1]["asleep"]
    assert records[-1]["awake"]["children"] == 0  # the embedded engine starts no process


def test_injected_leaks_fail_the_soak(model: str, tmp_path: Path) -> None:
    leaks = [arg for kind in ("fd", "thread", "child", "memory") for arg in ("--inject-leak", kind)]
    code, output, report = _run(model, tmp_path, "--cycles", "8", "--warmup", "2", "--max-new-tokens", "2", *leaks)
    assert code == 1, output
    failures = "\n".join(report["failures"])
    for needle in ("open file descriptors grew", "OS threads grew", "Python threads grew", "child processes grew"):
        assert needle in failures, failures
    assert "RSS grows" in failures and "MiB per cycle" in failures, failures
    assert "RSS of the child processes grows" in failures, failures  # the leaked children's own memory
    assert output.count("soak: LEAK:") == len(report["failures"]) == 6
    assert report["end"]["children"] == 0, "the leaked children were cleaned up at the end"


def test_soak_under_torchrun_judges_each_rank(tmp_path: Path) -> None:
    """Two real ranks (gloo): rank 0 builds the model for both, each rank writes and judges its own report."""
    out = tmp_path / "soak.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SOAK), "--backend",
         "transformers", "--dtype", "float32", "--cycles", "400", "--max-seconds", "2", "--warmup", "2",
         "--max-new-tokens", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=200, env=env, cwd=tmp_path,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    reports = [json.loads((tmp_path / f"soak.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert not out.exists()
    assert [(r["rank"], r["world_size"]) for r in reports] == [(0, 2), (1, 2)]
    assert reports[0]["model"] == reports[1]["model"], "every rank loads rank 0's model"
    # --max-seconds: rank 0's clock decides for both, so both stop at the same cycle (else one would hang)
    cut = [r["stopped_at_max_seconds"] for r in reports]
    assert cut[0] == cut[1] == len(reports[0]["records"]) == len(reports[1]["records"]) and 5 <= cut[0] < 400
    assert all(not r["failures"] and "error" not in r for r in reports)
    assert f"{cut[0]} of 400 cycles (--max-seconds)" in output
    assert output.count("soak: OK") == 2 and "soak rank 1/2:" in output


# ---- the judge on made-up samples (GPU memory included) -----------------------------------------------------
def _records(n: int, **series: list[int]) -> list[dict[str, Any]]:
    base = {"rss": 500 * MIB, "fds": 10, "os_threads": 8, "py_threads": 2, "children": 3}
    records = []
    for i in range(n):
        sample = dict(base)
        for key, values in series.items():
            sample[key] = values[i]
        records.append({"cycle": i, "awake": sample, "asleep": dict(sample)})
    return records


def test_judge_gpu_memory_tolerance() -> None:
    soak = _soak_module()
    total = 100_000 * MIB
    used = [40_000 * MIB] * 20
    alloc = [1_000 * MIB] * 20
    clean = _records(20, gpu_used=used, gpu_allocated=alloc)
    assert soak.judge(clean, 5, device_total=total, gpu_tolerance=0.01, rss_slope=1.0) == []
    within = _records(20, gpu_used=[u + (900 * MIB if i > 10 else 0) for i, u in enumerate(used)], gpu_allocated=alloc)
    assert soak.judge(within, 5, device_total=total, gpu_tolerance=0.01, rss_slope=1.0) == []
    leaking = _records(20, gpu_used=[u + i * 100 * MIB for i, u in enumerate(used)], gpu_allocated=alloc)
    messages = soak.judge(leaking, 5, device_total=total, gpu_tolerance=0.01, rss_slope=1.0)
    assert len(messages) == 2, messages  # seen awake and asleep; the process's own allocations did not grow
    assert "GPU memory (gpu_used, awake) grew by 1500 MiB (1.50% of the device, allowed 1%) from cycle 4" in messages[0]
    assert "(gpu_used, asleep)" in messages[1] and "to cycle 19" in messages[1]
    # Growth during the warm-up (allocator pools filling) does not count.
    warming = _records(20, gpu_used=[u + min(i, 4) * 5_000 * MIB for i, u in enumerate(used)], gpu_allocated=alloc)
    assert soak.judge(warming, 5, device_total=total, gpu_tolerance=0.01, rss_slope=1.0) == []


def test_judge_counts_and_rss() -> None:
    soak = _soak_module()
    spike = _records(12, fds=[10] * 6 + [14] + [10] * 5)  # one transient fd: not a leak
    assert soak.judge(spike, 3, device_total=0, gpu_tolerance=0.01, rss_slope=1.0) == []
    creeping = _records(12, os_threads=[8] * 6 + [9] * 6)
    (message,) = soak.judge(creeping, 3, device_total=0, gpu_tolerance=0.01, rss_slope=1.0)
    assert message.startswith("OS threads grew from 8 (cycle 2) to 9 and stayed there")
    jump = _records(20, rss=[500 * MIB] * 12 + [560 * MIB] * 8)  # one step up (a cache filling), then flat
    assert soak.judge(jump, 3, device_total=0, gpu_tolerance=0.01, rss_slope=1.0) == []
    slope = _records(20, rss=[500 * MIB + i * 2 * MIB for i in range(20)])
    (message,) = soak.judge(slope, 3, device_total=0, gpu_tolerance=0.01, rss_slope=1.0)
    assert message.startswith("RSS grows 2.00 MiB per cycle")
    assert soak.judge(_records(4), 3, device_total=0, gpu_tolerance=0.01, rss_slope=1.0)[0].startswith("too few")


def test_option_flags_reach_the_engine_config() -> None:
    """``--option K=V`` is genengine generate's parser: YAML values, repeatable, passed to create_engine."""
    soak = _soak_module()
    args = soak.build_parser().parse_args(
        ["--backend", "sglang", "--model", "/m", "--option", "attention_backend=triton", "--option", "port=31000"]
    )
    from genengine.cli.args import engine_kwargs

    kwargs = engine_kwargs(args)
    assert kwargs == {"backend": "sglang", "model": "/m", "attention_backend": "triton", "port": 31000}
