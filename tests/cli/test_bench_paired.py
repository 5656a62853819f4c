"""Paired P1 samples (genengine.cli.bench.paired, benchmarks/_p1.py): the statistics, the child protocol and the
alternation, with fake engines in child processes (the real ones are GPU runs of the bench scripts)."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from genengine.cli.bench.paired import SampleChild, pair_ratio, run_paired, summarize
from genengine.errors import InvalidArgumentError

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")

# A fake engine: each sample "generates" TOKENS tokens in SECONDS and appends "NAME SEED" to LOG.
FAKE = textwrap.dedent(
    """
    import os, sys, time
    from genengine.cli.bench.paired import serve
    name, seconds, tokens, log, fail_at = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    def sample(seed):
        if str(seed) == fail_at:
            raise ValueError(f"boom at {seed}")
        with open(log, "a") as fh:
            fh.write(f"{name} {seed}\\n")
        time.sleep(seconds)
        return tokens
    serve(sample, os.fdopen(int(sys.argv[-1]), "w"), info={"who": name})
    """
)


def _fake(name: str, seconds: float, tokens: int, log: Path, fail_at: str = "-") -> SampleChild:
    return SampleChild(name, [sys.executable, "-c", FAKE, name, str(seconds), str(tokens), str(log), fail_at])


def test_summarize_median_and_spread() -> None:
    s = summarize([100.0, 98.0, 102.0, 101.0, 99.0])
    assert s["median"] == 100.0 and s["n"] == 5
    assert s["min"] == 98.0 and s["max"] == 102.0
    assert s["spread_pct"] == pytest.approx(4.0)
    assert s["iqr_pct"] == pytest.approx(2.0)  # quartiles 99 and 101
    assert summarize([5.0])["spread_pct"] == 0.0
    with pytest.raises(InvalidArgumentError, match="no samples"):
        summarize([])


def test_pair_ratio_is_the_median_of_per_round_ratios() -> None:
    # A drift that moves both sides alike leaves every per-round ratio at 0.99.
    raw = [100.0, 120.0, 80.0, 110.0]
    ours = [0.99 * x for x in raw]
    r = pair_ratio(ours, raw)
    assert r["median"] == pytest.approx(0.99) and r["min"] == pytest.approx(0.99) and r["max"] == pytest.approx(0.99)
    assert r["of_medians"] == pytest.approx(0.99)
    with pytest.raises(InvalidArgumentError, match="same number"):
        pair_ratio([1.0], [1.0, 2.0])
    with pytest.raises(InvalidArgumentError, match="> 0"):
        pair_ratio([1.0], [0.0])


def test_run_paired_alternates_sides_on_the_same_prompts(tmp_path: Path) -> None:
    log = tmp_path / "order.log"
    ours, raw = _fake("ours", 0.01, 100, log), _fake("raw", 0.02, 100, log)
    try:
        assert ours.wait_ready() == {"who": "ours"} and raw.wait_ready() == {"who": "raw"}
        result = run_paired(ours, raw, samples=4, warmup=1)
    finally:
        assert ours.close() == 0 and raw.close() == 0
    rounds = log.read_text().split("\n")[:-1]
    # the warm-up round (seed 999), then ours first in even rounds, raw first in odd ones, same seed per round
    assert rounds == [
        "raw 999", "ours 999",
        "ours 0", "raw 0", "raw 1", "ours 1", "ours 2", "raw 2", "raw 3", "ours 3",
    ]  # fmt: skip
    assert result["ours"]["n"] == result["raw"]["n"] == 4
    # ours sleeps half as long per sample: about twice the tokens/s (sleep granularity aside)
    assert 1.3 < result["ratio"]["median"] < 2.5
    assert result["ours"]["median"] > result["raw"]["median"]


def test_a_failing_sample_is_reported_with_the_side(tmp_path: Path) -> None:
    log = tmp_path / "order.log"
    ours, raw = _fake("ours", 0.0, 10, log), _fake("raw", 0.0, 10, log, fail_at="1")
    try:
        ours.wait_ready()
        raw.wait_ready()
        with pytest.raises(RuntimeError, match=r"raw: ValueError: boom at 1"):
            run_paired(ours, raw, samples=3, warmup=0)
    finally:
        ours.close()
        raw.close()


def test_a_child_that_dies_before_ready_is_reported(tmp_path: Path) -> None:
    child = SampleChild("dead", [sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(RuntimeError, match=r"dead: the child exited \(3\)"):
        child.wait_ready()
    assert child.close() == 3


@pytest.mark.parametrize(("samples", "warmup"), [(0, 1), (True, 1), (3, -1)])
def test_run_paired_refuses_bad_counts(samples: object, warmup: object, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="must be an integer"):
        run_paired(None, None, samples=samples, warmup=warmup)  # type: ignore[arg-type]


def test_bench_scripts_p1_arguments_and_cells(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(BENCHMARKS)
    import _p1

    assert _p1.modes("graphs,eager") == ["graphs", "eager"] and _p1.modes("control") == ["control"]
    assert _p1.modes("") == [] and _p1.modes("none") == []
    for bad in ("graph", "graphs,graphs"):
        with pytest.raises(argparse.ArgumentTypeError, match="allowed are graphs, eager, control, each once"):
            _p1.modes(bad)
    assert _p1.labels("graphs") == ("P1 generate tok/s, graphs (paired)", "P1 ours / raw, graphs")
    assert "raw started second" in _p1.labels("control")[1]
    assert _p1.samples("12") == 12
    for bad in ("9", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="at least 10"):
            _p1.samples(bad)
    row = {
        "samples": 3,
        "ours": summarize([99.0, 100.0, 101.0]),
        "raw": summarize([100.0, 100.0, 100.0]),
        "ratio": pair_ratio([99.0, 100.0, 101.0], [100.0, 100.0, 100.0]),
    }
    ours_cell, raw_cell, ratio_cell = _p1.cells(row)
    assert ours_cell == "100.0 tok/s (spread 2.0 %)" and raw_cell == "100.0 tok/s (spread 0.0 %)"
    assert ratio_cell == "1.0000 (rounds 0.990-1.010, n=3)"
    assert _p1.ratio({"graphs": row}) == 1.0 and _p1.ratio({"eager": row}) is None
    assert _p1.cells({"error": "RuntimeError: raw: out of memory"})[0].startswith("failed: RuntimeError")


def test_trl_step_clock_counts_nested_calls_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_trl_step.py's hooks: a call inside another (TRL's generate waking the engine) is the inner part's."""
    import time

    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_trl_step as b

    clock = b.PhaseClock(cuda=False)
    wake = clock.wrap("sleep_wake", lambda: time.sleep(0.05))

    def gen() -> None:
        wake()
        time.sleep(0.02)

    clock.wrap("generate", gen)()
    spent = clock.take()
    assert spent["sleep_wake"] >= 0.05 and 0.02 <= spent["generate"] < 0.045, spent
    assert clock.take() == dict.fromkeys((*b.PARTS, *b.TRAIN_SPLIT), 0.0)  # taken: the next step starts from zero
    rows = [dict.fromkeys((*b.PARTS, "total"), float(i)) for i in (9, 1, 2, 3)]
    s = b.summarize(rows, warmup=1)
    assert s["steps"] == 3 and s["median_s"]["total"] == 2.0  # the warm-up step (9 s) left out
    with pytest.raises(RuntimeError, match="no step after the 1 warm-up"):
        b.summarize(rows[:1], warmup=1)
    text = b.table({"backend": "vllm", "trl": {"median_s": s["median_s"]}, "genengine": {"median_s": s["median_s"]}})
    assert text.splitlines()[2].split()[-1] == "1.000"


def test_trl_step_probe_counts_the_steps_garbage_collection(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_trl_step.py's per-step probe: the seconds in GC inside the step, not before it."""
    import gc

    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_trl_step as b

    probe = b.StepProbe(cuda=False)
    try:
        gc.collect()  # before the step: not its
        probe.begin()
        assert probe.end() == {"gc_s": 0.0}
        cycles = [[] for _ in range(200_000)]
        for c in cycles:
            c.append(c)  # a cycle each: only the collector frees them
        del cycles
        probe.begin()
        gc.collect()
        row = probe.end()
        assert set(row) == {"gc_s"} and row["gc_s"] > 0.0
    finally:
        gc.callbacks.remove(probe._on_gc)


def test_trl_step_probe_counts_the_cpu_of_the_processes_an_engine_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_trl_step.py's per-step probe: CPU seconds of this process's descendants (SGLang's scheduler and
    detokenizer are the trainer's children), a grandchild's too."""
    import os
    import signal
    import subprocess
    import time

    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_trl_step as b

    burn = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.6: pass\ntime.sleep(30)"
    spawn = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {burn!r}]); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", spawn], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while (b.descendants_cpu_s() or 0.0) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (b.descendants_cpu_s() or 0.0) >= 0.6  # the grandchild's busy loop, counted
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the grandchild too
        child.wait()


FAKE_SCRIPT = textwrap.dedent(
    """
    import argparse, sys, time
    sys.path.insert(0, {benchmarks!r})
    import _p1
    ap = argparse.ArgumentParser()
    for flag in ("--model", "--p1-child", "--p1-graphs", "--p1-mem-util", "--result-fd"):
        ap.add_argument(flag)
    a = ap.parse_args()
    stopped = {stopped!r}
    def start():
        speed = 0.01 if a.p1_child == "ours" else 0.012
        def stop():
            open(stopped, "a").write(f"{{a.p1_child}} graphs={{a.p1_graphs}} mem_util={{a.p1_mem_util}}\\n")
        return (lambda seed: (time.sleep(speed), 100)[1]), {{"side": a.p1_child}}, stop
    _p1.serve_child(int(a.result_fd), start)
    """
)


def _p1_with_stand_in(tmp_path: Path) -> tuple[ModuleType, Path, Path]:
    """benchmarks/_p1.py, a stand-in bench script (FAKE_SCRIPT) and the file its engines' stops write to."""
    sys.path.insert(0, BENCHMARKS)
    try:
        import _p1
    finally:
        sys.path.remove(BENCHMARKS)
    stopped = tmp_path / "stopped.txt"
    script = tmp_path / "bench_fake.py"
    script.write_text(FAKE_SCRIPT.format(benchmarks=BENCHMARKS, stopped=str(stopped)))
    return _p1, script, stopped


@pytest.mark.parametrize("mode", ["graphs", "control"])
def test_bench_scripts_p1_measure_starts_raw_then_the_second_and_stops_both(tmp_path: Path, mode: str) -> None:
    """_p1.measure with a stand-in bench script: raw starts first, the second child (ours; raw again in the
    control row, which then holds the start order's share and nothing of ours) gets the fraction measure
    computes from what raw took, both are sampled in turn and stopped (their engines' stop called) at the end."""
    _p1, script, stopped = _p1_with_stand_in(tmp_path)
    free = iter([100, 60, 20])  # before raw, after raw (took 40), after the second
    logs: list[str] = []
    row = _p1.measure_mode(
        mode,
        str(script),
        "/nonexistent-model",
        ours_mem_util=lambda took, now: took / now,
        free_bytes=lambda: next(free),
        log=logs.append,
        samples=10,
        warmup=1,
    )
    second = "ours" if mode == "graphs" else "raw"
    assert "error" not in row, row
    assert row["control"] is (mode == "control") and row["cuda_graphs"] is True
    assert row["ours_mem_util"] == round(40 / 60, 4) and row["raw_mem_util"] == _p1.P1_RAW_SHARE
    assert row["raw_info"]["side"] == "raw" and row["ours_info"]["side"] == second
    assert row["ours"]["n"] == row["raw"]["n"] == 10
    if mode == "graphs":
        assert row["ratio"]["median"] > 1.0  # ours sleeps less
    else:
        assert 0.9 < row["ratio"]["median"] < 1.1  # the same stand-in engine on both sides
    assert sorted(stopped.read_text().splitlines()) == sorted(
        [f"{second} graphs=1 mem_util=0.6667", "raw graphs=1 mem_util=0.4000"]
    )
    assert set(row["exit_codes"].values()) == {0} and len(row["exit_codes"]) == 2
    assert any(f"{second} second at mem_util 0.667" in line for line in logs), logs


def test_bench_scripts_p1_measure_reports_a_failure_and_still_closes_the_child(tmp_path: Path) -> None:
    """A failure once raw is up (here: ours' fraction) is the row's error, logged under the row's name, and raw
    is still stopped and closed, its exit code in the row."""
    _p1, script, stopped = _p1_with_stand_in(tmp_path)
    free = iter([100, 60])

    def no_room(took: int, now: int) -> float:
        raise RuntimeError(f"no room for ours ({now} free)")

    logs: list[str] = []
    row = _p1.measure(
        str(script),
        "/nonexistent-model",
        graphs=False,
        ours_mem_util=no_room,
        free_bytes=lambda: next(free),
        log=logs.append,
    )
    assert row["error"] == "RuntimeError: no room for ours (60 free)" and "ratio" not in row
    assert logs[-1] == "P1 eager failed: RuntimeError: no room for ours (60 free)"
    assert row["exit_codes"] == {"raw (eager)": 0} and row["raw_info"]["side"] == "raw"
    assert stopped.read_text().splitlines() == ["raw graphs=0 mem_util=0.4000"]
