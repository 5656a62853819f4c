"""``genengine bench`` on the embedded backend: the real measurements, the table, the JSON and the PNG."""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from genengine.cli import main
from genengine.cli.bench import BenchSettings, format_report, run_bench
from genengine.errors import ConfigError, InvalidArgumentError


def _recording(calls: list[str], name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, recording ``name`` in ``calls`` at each call."""

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return real(*args, **kwargs)

    return recorded


def _spy_on_work(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record (and still do) the bench's work: building the tiny model, reading the checkpoint, creating engines.

    ``run_bench`` imports these from their modules when it calls them, so replacing the module attributes
    sees every call.
    """
    import genengine.cli.bench.measure
    import genengine.models.tiny_model
    import genengine.plugins.registry

    calls: list[str] = []
    for module, name in (
        (genengine.models.tiny_model, "build_tiny_model"),
        (genengine.cli.bench.measure, "trainer_weights"),
        (genengine.plugins.registry, "create_engine"),
    ):
        monkeypatch.setattr(module, name, _recording(calls, name, getattr(module, name)))
    return calls


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path, float]:
    """``genengine bench`` with no model, backend or device argument: builds its tiny model, runs the embedded
    backend. Only the run's size is set small (2 prompts of 8 tokens, 4 new ones, one repeat: the rounds and
    every measurement stay; the defaults' 8 x 32 of 32 tokens, three repeats, cost ~18 s more of CPU)."""
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("bench")
    buf = io.StringIO()
    start = time.perf_counter()
    small = ["--batch-size", "2", "--prompt-len", "8", "--max-new-tokens", "4", "--repeats", "1"]
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(buf):
        work = _spy_on_work(mp)
        rc = main(["bench", *small, "--json", str(out / "r.json"), "--plot", str(out / "r.png"), "--quiet"])
    elapsed = time.perf_counter() - start
    assert rc == 0
    # The spies see the work when there is some (what makes their silence below mean something).
    assert work == ["build_tiny_model", "trainer_weights", "create_engine"], work
    return json.loads((out / "r.json").read_text()), buf.getvalue(), out / "r.png", elapsed


def test_a_run_without_a_model_finishes_quickly_and_writes_everything(default_run: Any) -> None:
    report, table, png, elapsed = default_run
    assert elapsed < 120
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    for row in (
        "generate",
        "generate, raw engine",
        "load_weights, bucketed",
        "load_weights, per parameter",
        "sleep level 1",
        "sleep level 2",
        "wake weights",
        "wake kv_cache",
        "shutdown",
    ):
        assert f"\n{row} " in table or f"\n  {row} " in table, row
    assert report["backend"] == "transformers" and report["device"].startswith("cpu")


def test_report_holds_real_measurements(default_run: Any) -> None:
    report = default_run[0]
    g = report["generate"]
    s = report["settings"]
    assert (s["batch_size"], s["prompt_len"], s["max_new_tokens"], s["repeats"]) == (2, 8, 4, 1)  # the options'
    assert g["tokens"] == s["batch_size"] * s["max_new_tokens"]  # greedy, ignore_eos: every token counted
    assert g["tokens_per_s"] > 0 and g["raw_tokens_per_s"] > 0
    runs = g["tokens_per_s_runs"]  # the spread beside the median: a 1 % difference needs a smaller one
    assert g["spread_pct"] == pytest.approx((max(runs) - min(runs)) / g["tokens_per_s"] * 100)
    assert 0 <= g["iqr_pct"] <= g["spread_pct"]
    w = report["weights"]
    lw = report["load_weights"]
    assert lw["bucketed"]["num_tensors"] == w["num_tensors"] and lw["bucketed"]["num_buckets"] >= 1
    assert lw["bucketed"]["gb_per_s"] == pytest.approx(w["num_bytes"] / lw["bucketed"]["seconds"] / 1e9)
    assert lw["per_parameter"]["calls"] == w["num_tensors"]
    assert lw["greedy_unchanged"] is True  # loading the checkpoint's own weights changes nothing
    levels = {c["level"]: c for c in report["sleep"]}
    assert set(levels) == {1, 2}
    for c in levels.values():
        assert [x["tag"] for x in c["wake"]] == ["weights", "kv_cache"]  # the staged order
        assert c["greedy_unchanged"] is True
    # Level 2 drops the weights: most of what the engine holds comes back to the process.
    assert levels[2]["freed_share"] > 0.5
    assert levels[2]["freed_bytes"] > 0.5 * w["num_bytes"]
    assert "reload_seconds" in levels[2] and "reload_seconds" not in levels[1]


def test_p1_is_paired_with_the_raw_engine_alive_in_a_child(default_run: Any) -> None:
    """Issue 41 point 2: the plugin's raw_engine runs in a process of its own, up before ours and sampled in
    turn with it on the same prompts, 10 rounds; the ratio is the median of the per-round ratios."""
    import os
    import statistics

    g = default_run[0]["generate"]
    assert g["paired"] is True and g["samples"] == 10
    assert len(g["tokens_per_s_runs"]) == len(g["raw_tokens_per_s_runs"]) == 10
    assert g["raw_info"]["pid"] != os.getpid()
    ratios = [o / r for o, r in zip(g["tokens_per_s_runs"], g["raw_tokens_per_s_runs"], strict=True)]
    assert g["vs_raw"] == pytest.approx(statistics.median(ratios))
    assert g["vs_raw_min"] == pytest.approx(min(ratios)) and g["vs_raw_max"] == pytest.approx(max(ratios))
    assert g["raw_tokens_per_s"] == pytest.approx(statistics.median(g["raw_tokens_per_s_runs"]))
    assert f"ours/raw {g['vs_raw']:.4f} (paired rounds" in default_run[1]


def test_table_is_printed_from_the_report(default_run: Any) -> None:
    assert format_report(default_run[0]) in default_run[1]


def test_engine_class_as_backend_and_skipped_parts(tmp_path: Path) -> None:
    from genengine.models.tiny_model import tiny_model_dir

    report = run_bench(
        BenchSettings(
            backend="genengine.backends.transformers.engine:TransformersEngine",
            model=str(tiny_model_dir()),
            dtype="float32",
            batch_size=2,
            prompt_len=4,
            max_new_tokens=3,
            repeats=1,
            sleep_levels=(2,),
            per_parameter=False,
            progress=False,
        )
    )
    assert report["backend"] == "genengine.backends.transformers.engine.TransformersEngine"
    assert report["generate"]["tokens"] == 6 and report["generate"]["raw_tokens_per_s"] is None
    assert report["load_weights"]["per_parameter"] is None
    assert [c["level"] for c in report["sleep"]] == [2]
    assert "n/a (the plugin registers no raw_runner)" in format_report(report)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model"], "is not a local model folder"),
        (["--batch-size", "0"], "batch_size=0 must be an integer >= 1"),
        (["--backend", "nope"], "unknown backend 'nope'"),
        (["--tp-size", "2"], "run `torchrun --nproc-per-node 2"),
    ],
)
def test_bad_arguments_fail_before_any_work(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    work = _spy_on_work(monkeypatch)
    assert main(["bench", "--quiet", *args]) == 2
    assert message in capsys.readouterr().err
    assert work == []  # no model was built, no checkpoint read, no engine started


@pytest.mark.parametrize("args", [["--option", "no_equals_sign"], ["--sleep-levels", "1,3"], ["--p1-samples", "9"]])
def test_malformed_options_are_usage_errors(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", *args])
    assert exc.value.code == 2
    assert args[0] in capsys.readouterr().err


def test_settings_are_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="pair_samples=9 must be an integer >= 10"):
        BenchSettings(pair_samples=9).check()
    with pytest.raises(InvalidArgumentError, match="sleep level 3"):
        BenchSettings(sleep_levels=(3,)).check()
    with pytest.raises(ConfigError, match="'/no/such'"):
        BenchSettings(model="/no/such").check()


def test_option_values_are_typed() -> None:
    from genengine.cli.args import parse_option as _option

    assert _option("max_batch_size=4") == ("max_batch_size", 4)
    assert _option("device=cpu") == ("device", "cpu")
    assert _option("flag=true") == ("flag", True)


@pytest.mark.slow
def test_under_torchrun_every_rank_measures_and_rank_0_reports(tmp_path: Path) -> None:
    """The --tp-size path: the benchmark plays the trainer, owns the (gloo) world, sums memory over ranks."""
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    genengine = shutil.which("genengine", path=str(Path(sys.executable).parent))
    if torchrun is None or genengine is None:
        pytest.skip("torchrun or the genengine script is not installed next to this interpreter")
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "--no-python", genengine, "bench", "--quiet", "--repeats", "1",
         "--batch-size", "2", "--prompt-len", "4", "--max-new-tokens", "2", "--no-per-parameter", "--no-raw",
         "--sleep-levels", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("benchmark took") == 1  # only rank 0 prints
    report = json.loads(out.read_text())
    assert report["rank"] == 0 and report["world_size"] == 2
    assert "2 ranks (memory summed)" in proc.stdout
    assert report["sleep"][0]["greedy_unchanged"] is True


# ---- genengine bench --async ---------------------------------------------------------------------------
def test_lognormal_lengths_are_long_tailed_and_capped() -> None:
    from genengine.cli.bench.asynchronous import lognormal_lengths

    lengths = lognormal_lengths(4000, 64, 1.0, 1024, seed=3)
    assert lengths == lognormal_lengths(4000, 64, 1.0, 1024, seed=3)
    assert min(lengths) >= 1 and max(lengths) <= 1024
    median = sorted(lengths)[len(lengths) // 2]
    assert 58 <= median <= 70
    assert max(lengths) > 8 * median  # the tail a synchronous step waits for
    assert lognormal_lengths(50, 8, 0.0, 1024, seed=0) == [8] * 50


def test_async_bench_collects_the_samples_with_partial_rollouts(capsys: pytest.CaptureFixture[str]) -> None:
    from genengine.cli.bench.asynchronous import AsyncBenchSettings, _jobs, format_async_report, run_async_bench

    settings = AsyncBenchSettings(batch_size=4, steps=3, median_new_tokens=4, max_new_tokens=24, prompt_len=8)
    report = run_async_bench(settings)
    sync, asy = report["sync"], report["async"]
    # The synchronous run generated exactly the jobs' forced lengths (ignore_eos), batch after batch.
    jobs = _jobs(settings, 4096)
    assert sync["tokens"] == sum(next(jobs).params.max_new_tokens for _ in range(12))
    assert sync["samples"] == asy["samples"] == 12
    assert len(sync["load_seconds"]) == len(asy["pause_load_resume_seconds"]) == 3
    assert all(g > 0 for g in asy["pause_load_resume_seconds"])
    # The gap's three parts add up to it, step by step.
    parts = asy["pause_load_resume_parts"]
    for k, gap in enumerate(asy["pause_load_resume_seconds"]):
        assert sum(parts[name][k] for name in ("pause", "load", "resume")) == pytest.approx(gap, abs=1e-3)
    assert asy["in_flight"] == 6 and asy["aborted_at_end"] >= 1
    # Samples carried over an update say so in their weight_versions, and their older tokens are counted.
    assert asy["carried_samples"] >= 1 and 0 < asy["off_policy_tokens"] < asy["tokens"]
    assert report["ratio"] == pytest.approx(asy["seconds"] / sync["seconds"])
    table = format_async_report(report)
    assert "async / sync" in table and f"{report['ratio']:.3f}" in table


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--oversample", "0.5"], "oversample=0.5 must be >= 1.0"),
        (["--median-new-tokens", "300", "--max-new-tokens", "64"], "median_new_tokens=300 must be <= max_new_tokens"),
        (["--steps", "0"], "steps=0 must be an integer >= 1"),
        (["--backend", "nope"], "unknown backend 'nope'"),
        (["--model", "/nonexistent/model"], "is not a local model folder"),
        (["--tp-size", "2"], "--tp-size 2: bench --async measures one engine in this process; allowed: 1"),
    ],
)
def test_async_bench_bad_arguments_fail_before_any_work(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    work = _spy_on_work(monkeypatch)
    assert main(["bench", "--async", "--quiet", *args]) == 2
    assert message in capsys.readouterr().err
    assert work == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--repeats", "0"], "repeats=0 must be an integer >= 1"),
        (["--min-seconds", "0"], "min_seconds=0.0 must be a number > 0"),
        (["--pool-mem-util", "1.5"], "pool_mem_util=1.5 must be a number in (0, 1]"),
        (["--transport", "carrier-pigeon"], "carrier-pigeon"),
        (["--backend", "nope"], "unknown backend 'nope'"),
        (["--model", "/nonexistent/model"], "is not a local model folder"),
        (["--tp-size", "2"], "--tp-size 2: bench --pool measures tp_size=1 replicas"),
        (["--async"], "--async and --pool are two different comparisons"),
    ],
)
def test_pool_bench_bad_arguments_fail_before_any_work(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib
    import sys

    import ray

    ray_pg = importlib.import_module("ray.util.placement_group")  # the module (ray.util's attribute is the function)

    work = _spy_on_work(monkeypatch)
    # Ray may be up already: the Ray test files share one cluster per pytest process. So the calls that would
    # start or use it are watched, whatever state it is in.
    ray_up = ray.is_initialized()
    for module, name in ((ray, "init"), (ray_pg, "placement_group")):
        monkeypatch.setattr(module, name, _recording(work, f"ray.{name}", getattr(module, name)))
    assert main(["bench", "--pool", "--quiet", *args]) == 2
    assert message in capsys.readouterr().err
    assert work == []
    assert ray_up or not sys.modules["ray"].is_initialized()  # no Ray started for it


@pytest.mark.parametrize("level", [0, 3, True, "2"])
def test_pool_bench_refuses_a_sleep_level_other_than_1_or_2(level: object) -> None:
    from genengine.cli.bench.pool import PoolBenchSettings

    with pytest.raises(InvalidArgumentError, match=rf"sleep_level={level!r}: allowed are 1 and 2"):
        PoolBenchSettings(sleep_level=level).check()  # type: ignore[arg-type]


@pytest.mark.parametrize("handles", [(), ("torch", "nccl"), ("cuda",)])
def test_pool_bench_refuses_unknown_cuda_ipc_handles(handles: tuple[str, ...]) -> None:
    from genengine.cli.bench.pool import PoolBenchSettings

    with pytest.raises(InvalidArgumentError, match=r"allowed are 'driver' and 'torch', at least one"):
        PoolBenchSettings(handles=handles).check()


@pytest.mark.parametrize("phases", [True, False])
def test_pool_bench_plots_the_sync_phases_when_the_report_has_them(
    phases: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--pool --plot`` draws the pool's sync phases (as ``--sync`` draws its own), and nothing when the run
    measured none; the table and the JSON come first either way. The pool itself is stood in for."""
    pytest.importorskip("matplotlib")  # --plot is refused without it, before any work
    import genengine.cli.bench.pool as pool
    import genengine.cli.bench.sync as sync

    report: dict[str, Any] = {"sync": {"phases": {"pause": 1.0}} if phases else {}}
    drawn: list[tuple[Any, str]] = []
    monkeypatch.setattr(pool, "run_pool_bench", lambda settings: report)
    monkeypatch.setattr(pool, "format_pool_report", lambda r: "the pool table")
    monkeypatch.setattr(pool, "pool_sync_phases", lambda r: ("phases of", r))
    monkeypatch.setattr(sync, "write_plot", lambda r, path, say: drawn.append((r, path)))
    png, out = str(tmp_path / "p.png"), tmp_path / "p.json"
    assert main(["bench", "--pool", "--quiet", "--json", str(out), "--plot", png]) == 0
    assert "the pool table" in capsys.readouterr().out and json.loads(out.read_text()) == report
    assert drawn == ([(("phases of", report), png)] if phases else [])
