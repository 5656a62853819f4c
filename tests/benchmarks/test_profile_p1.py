"""benchmarks/profile_p1.py and the P1 child's profile hooks (benchmarks/_p1.py, genengine.cli.bench.paired), with
fake engines in child processes: the real ones are a GPU run (docs/benchmarks.md)."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from genengine.cli.bench.paired import SampleChild

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")

# A fake engine whose call of N new tokens takes FIXED + N * PER_TOKEN seconds, timed inside as P1 children do.
FAKE = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {benchmarks!r})
    import _p1
    from genengine.cli.bench.paired import serve
    name, fixed, per_token, log = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    class Engine:
        def generate(self, new):
            time.sleep(fixed)
            for _ in range(new):
                self.step()
        def step(self):
            time.sleep(per_token)
    engine = Engine()
    clock = _p1.Clock() if _p1.profiling() else None
    if clock is not None:
        clock.wrap(engine, "generate", "llm_generate")
        clock.wrap(engine, "step", "step")
    def sample(seed, new=8):
        with open(log, "a") as fh:
            fh.write(f"{{name}} {{seed}} {{new}}\\n")
        return _p1.timed_sample(clock, lambda: (engine.generate(new), 4 * new)[1])
    serve(sample, os.fdopen(int(sys.argv[-1]), "w"))
    """
).format(benchmarks=BENCHMARKS)


def _fake(name: str, fixed: float, per_token: float, log: Path, *, profile: bool = True) -> SampleChild:
    env = {"GENENGINE_P1_PROFILE": "1"} if profile else {"GENENGINE_P1_PROFILE": "0"}
    return SampleChild(name, [sys.executable, "-c", FAKE, name, str(fixed), str(per_token), str(log)], env=env)


@pytest.fixture
def profile_p1(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(BENCHMARKS)
    import profile_p1 as module

    return module


def test_a_sample_at_another_length_answers_the_childs_own_timings(tmp_path: Path) -> None:
    """``sample SEED NEW``: the child generates NEW tokens; with the profile on it answers what it timed inside
    (one generate, NEW steps), with it off the plain answer P1 has always had."""
    log = tmp_path / "calls.log"
    on, off = _fake("on", 0.0, 0.001, log), _fake("off", 0.0, 0.001, log, profile=False)
    try:
        on.wait_ready()
        off.wait_ready()
        a = on.sample(5, 3)
        b = off.sample(6)
    finally:
        assert on.close() == 0 and off.close() == 0
    assert log.read_text().splitlines() == ["on 5 3", "off 6 8"]
    assert a["tokens"] == 12 and a["detail"]["step"]["n"] == 3 and a["detail"]["llm_generate"]["n"] == 1
    inner = a["detail"]["llm_generate"]
    assert 0 <= inner["first_start_s"] <= inner["last_end_s"] <= a["detail"]["outer_s"] <= a["seconds"]
    assert b["tokens"] == 32 and "detail" not in b


def test_clock_takes_each_samples_calls_once() -> None:
    sys.path.insert(0, BENCHMARKS)
    try:
        import _p1
    finally:
        sys.path.remove(BENCHMARKS)

    class Thing:
        def work(self, x: int) -> int:
            time.sleep(0.01)
            return x + 1

    thing, other = Thing(), Thing()
    clock = _p1.Clock()
    clock.wrap(thing, "work", "work")
    tokens, detail = _p1.timed_sample(clock, lambda: thing.work(1) + thing.work(2) + other.work(0))  # type: ignore[misc]
    assert tokens == 6
    assert detail["work"]["n"] == 2  # the other instance is not wrapped
    assert 0.02 <= detail["work"]["total_s"] <= detail["outer_s"]
    _, again = _p1.timed_sample(clock, lambda: 0)  # type: ignore[misc]
    assert "work" not in again  # taken by the first sample
    assert _p1.timed_sample(None, lambda: 7) == 7


def test_analyse_splits_a_gap_into_its_fixed_and_per_token_parts(profile_p1) -> None:  # type: ignore[no-untyped-def]
    """Ours 5 ms slower per call, equal per token: the fit puts the whole gap in the fixed part."""

    def answers(fixed: float, per_token: float, new: int) -> list[dict[str, object]]:
        out = []
        for jitter in (0.0, 0.0002, -0.0002):
            s = fixed + new * per_token + jitter
            detail = {
                "outer_s": s,
                "llm_generate": {"n": 1, "total_s": s - 0.001, "median_s": s - 0.001, "first_start_s": 0.0005,
                                 "last_end_s": s - 0.0005},
                "step": {"n": new, "total_s": new * per_token, "median_s": per_token, "first_start_s": 0.002,
                         "last_end_s": s - 0.001},
            }  # fmt: skip
            out.append({"seconds": s, "tok_per_s": 64 * new / s, "detail": detail})
        return out

    samples = {
        "ours": {32: answers(0.045, 0.007, 32), 128: answers(0.045, 0.007, 128)},
        "raw": {32: answers(0.040, 0.007, 32), 128: answers(0.040, 0.007, 128)},
    }
    a = profile_p1.analyse(samples, 32, 128)
    assert a["gap"]["fixed_ms"] == pytest.approx(5.0, abs=1e-6)
    assert a["gap"]["per_token_us"] == pytest.approx(0.0, abs=1e-6)
    assert a["gap"]["ours_minus_raw_ms_128"] == pytest.approx(5.0, abs=1e-6)
    assert a["gap"]["ratio_tok_s_128"] < 1.0
    assert a["sides"]["raw"]["per_token_us"] == pytest.approx(7000.0)
    assert a["sides"]["ours"]["inside_long"]["steps"] == 128
    assert a["gap"]["inside_long_ours_minus_raw"]["call_ms"] == pytest.approx(5.0, abs=1e-6)
    text = profile_p1.summary({"engine": "vllm", "cuda_graphs": True, "rounds": 3, "analysis": a})
    assert "fixed per call: ours 45.00 ms, raw 40.00 ms (+5.00)" in text
    assert profile_p1.summary({"engine": "vllm", "error": "RuntimeError: boom"}).endswith("failed: RuntimeError: boom")


def test_profile_rounds_alternate_and_see_a_per_token_cost(tmp_path: Path, profile_p1) -> None:  # type: ignore[no-untyped-def]
    """Two fake engines, ours 11 ms slower per token: the rounds are paired as P1's, and the analysis of the
    real samples shows the gap per token, not per call (a gap wide enough that a loaded 2-core machine's sleep
    overshoot, a few ms, cannot hide it or double it)."""
    log = tmp_path / "calls.log"
    ours, raw = _fake("ours", 0.002, 0.012, log), _fake("raw", 0.002, 0.001, log)
    try:
        ours.wait_ready()
        raw.wait_ready()
        got = profile_p1.run_rounds(ours, raw, rounds=2, lengths=(2, 8), log=lambda _: None)
    finally:
        ours.close()
        raw.close()
    assert log.read_text().splitlines() == [
        "raw 1999 2", "ours 1999 2", "raw 1999 8", "ours 1999 8",  # the warm-up round: raw first (odd)
        "ours 2000 2", "raw 2000 2", "ours 2000 8", "raw 2000 8",
        "raw 2001 2", "ours 2001 2", "raw 2001 8", "ours 2001 8",
    ]  # fmt: skip
    a = profile_p1.analyse(got, 2, 8)
    assert 6000 < a["gap"]["per_token_us"] < 20000  # 11 ms a token, sleep granularity and load aside
    assert a["sides"]["ours"]["inside_long"]["steps"] == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tgi"], "invalid choice"),
        (["vllm", "--rounds", "1"], ">= 2"),
        (["vllm", "--short", "128"], "allowed 1 to 127"),
    ],
)
def test_profile_p1_refuses_bad_arguments(argv: list[str], message: str, profile_p1, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        profile_p1.parse(argv)
    assert message in capsys.readouterr().err


def test_profile_p1_defaults_write_to_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, profile_p1) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OUT", str(tmp_path))
    a = profile_p1.parse(["sglang"])
    assert a.json == str(tmp_path / "profile_p1_sglang.json") and a.summary == str(tmp_path / "profile_p1_sglang.txt")
    assert a.model.endswith("genengine-qwen2-7b-shape-sglang") and a.rounds == 4 and not a.eager


FAKE_BENCH = textwrap.dedent(
    """
    import argparse, sys, time
    sys.path.insert(0, {benchmarks!r})
    import _p1
    ap = argparse.ArgumentParser()
    for flag in ("--model", "--p1-child", "--p1-graphs", "--p1-mem-util", "--result-fd"):
        ap.add_argument(flag)
    a = ap.parse_args()
    def start():
        clock = _p1.Clock() if _p1.profiling() else None
        class Engine:
            def generate(self, new):
                time.sleep(0.02 if a.p1_child == "ours" else 0.0)  # ours: 20 ms more per call
                return 4 * new
        engine = Engine()
        if clock is not None:
            clock.wrap(engine, "generate", "llm_generate")
        def sample(seed, new=128):
            return _p1.timed_sample(clock, lambda: engine.generate(new))
        return sample, {{"side": a.p1_child, "graphs": a.p1_graphs}}, None
    _p1.serve_child(int(a.result_fd), start)
    """
)


def test_profile_p1_main_with_a_stand_in_bench_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, profile_p1
) -> None:  # type: ignore[no-untyped-def]
    """The whole script: raw then ours started from the bench script as P1 children with the profile on,
    graphs on, the rounds, and the JSON and text summary where verify.sh's ``profile`` part reads them."""
    import json
    import types

    script = tmp_path / "bench_vllm.py"
    script.write_text(FAKE_BENCH.format(benchmarks=BENCHMARKS))
    fake = types.ModuleType("bench_vllm")
    fake.__file__ = str(script)
    free = iter([100, 60, 20])
    fake.free_bytes = lambda: next(free)  # type: ignore[attr-defined]
    fake.ours_mem_util = lambda took, now: 0.4  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "bench_vllm", fake)
    monkeypatch.setattr(profile_p1, "make_model_dir", lambda path, tokenizer: path)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert profile_p1.main(["vllm", "--rounds", "2", "--short", "8"]) == 0
    report = json.loads((tmp_path / "profile_p1_vllm.json").read_text())
    assert report["raw_info"]["side"] == "raw" and report["ours_info"]["side"] == "ours"
    assert report["raw_info"]["graphs"] == "1" and set(report["exit_codes"].values()) == {0}
    assert [len(report["samples"][s][str(n)]) for s in ("ours", "raw") for n in (8, 128)] == [2, 2, 2, 2]
    gap = report["analysis"]["gap"]
    assert gap["inside_long_ours_minus_raw"]["llm_generate_ms"] > 10.0  # the 20 ms ours adds, seen inside
    assert (tmp_path / "profile_p1_vllm.txt").read_text().startswith("profile_p1 vllm (CUDA graphs)")


def test_profile_p1_main_reports_a_failure_and_still_closes_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], profile_p1
) -> None:  # type: ignore[no-untyped-def]
    """A failure once raw is up (ours' fraction here): exit status 1, the error in the JSON, the summary and
    the log, and raw closed all the same (its exit code in the JSON)."""
    import json
    import types

    script = tmp_path / "bench_vllm.py"
    script.write_text(FAKE_BENCH.format(benchmarks=BENCHMARKS))
    fake = types.ModuleType("bench_vllm")
    fake.__file__ = str(script)
    free = iter([100, 60])
    fake.free_bytes = lambda: next(free)  # type: ignore[attr-defined]

    def no_room(took: int, now: int) -> float:
        raise RuntimeError("no room for ours")

    fake.ours_mem_util = no_room  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "bench_vllm", fake)
    monkeypatch.setattr(profile_p1, "make_model_dir", lambda path, tokenizer: path)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert profile_p1.main(["vllm", "--rounds", "2"]) == 1
    report = json.loads((tmp_path / "profile_p1_vllm.json").read_text())
    assert report["error"] == "RuntimeError: no room for ours" and "samples" not in report
    assert report["exit_codes"] == {"raw (graphs)": 0} and report["raw_info"]["side"] == "raw"
    assert (tmp_path / "profile_p1_vllm.txt").read_text() == "profile_p1 vllm: failed: RuntimeError: no room for ours\n"
    assert "] failed: RuntimeError: no room for ours" in capsys.readouterr().out
