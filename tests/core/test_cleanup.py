"""A trainer that ends badly leaves nothing behind: no engine process, no hang at exit.

Each case runs a real trainer child (this file run as a script) and ends it by SIGTERM, SIGINT, SIGKILL,
an uncaught exception or a normal exit *without* ``shutdown()``; then every process of its tree, and
anything carrying the run's environment marker wherever it was re-parented, must be gone.

The embedded engine runs in the trainer's process, so for it this is cheap to promise. The engines that
run in other processes (SGLang) are what ``genengine.engine.lifecycle`` is for; its cases use a trainer whose
"engine" is built as SGLang's: non-daemon ``multiprocessing`` spawn children that serve until stopped.
The control cases show what happens without the mechanism (an exit that hangs in ``multiprocessing``'s
join; orphans after SIGKILL), so the checks are known to catch it. The GPU twin of this file is
tests/gpu/test_cleanup_gpu.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.processes import TrainerOutcome, TrainerRun, is_alive

from genengine.engine import lifecycle

HERE = Path(__file__).resolve()
ENDINGS = ("exit", "exception", "sigterm", "sigint")

pytestmark = pytest.mark.timeout(180)


# ---- the trainer children (this file as a script) -----------------------------------------------------------
def _worker(pdeathsig: bool) -> None:
    """An engine process as SGLang starts one: it serves until it is stopped."""
    if pdeathsig:
        lifecycle.set_parent_death_signal()
    while True:
        time.sleep(0.05)


def _hung_stop() -> None:
    time.sleep(3600)


def _lifecycle_trainer(ending: str, at_exit: str, pdeathsig: bool) -> None:
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_worker, args=(pdeathsig,), name=f"engine-{i}") for i in range(2)]
    for w in workers:
        w.start()

    def stop() -> None:
        for w in workers:
            w.terminate()
        for w in workers:
            w.join(10)

    if at_exit == "stop":
        lifecycle.at_exit(stop, name="test engine", pids=[w.pid for w in workers if w.pid])
    elif at_exit == "hangs":
        lifecycle.at_exit(_hung_stop, name="test engine", pids=[w.pid for w in workers if w.pid], timeout_s=1.0)
    _serve(ending)


def _embedded_trainer(ending: str, model_dir: str) -> None:
    from genengine import create_engine

    engine = create_engine(backend="transformers", model=model_dir, dtype="float32", device="cpu")
    engine.generate(["hello"], {"max_new_tokens": 2})
    _serve(ending, lambda: engine.generate(["the quick brown fox"], {"max_new_tokens": 4}))


def _serve(ending: str, work: Any = None) -> None:
    """Report READY, then end as told: on the test's line on stdin, or by its signal while working."""
    print(f"READY pid={os.getpid()}", flush=True)
    if ending in ("exit", "exception"):
        sys.stdin.readline()
        if ending == "exception":
            raise RuntimeError("the trainer crashed")
        return
    while True:
        if work is not None:
            work()
        time.sleep(0.2)  # leave CPU to the trainers still starting next to this one


# ---- helpers ----------------------------------------------------------------------------------------------
def _run(*args: str, log_path: str | None = None) -> TrainerRun:
    ending = args[1]
    return TrainerRun([sys.executable, str(HERE), *args], ending, log_path=log_path)


def _assert_clean(outcome: TrainerOutcome, max_exit_s: float) -> None:
    assert outcome.returncode is not None, f"the trainer did not exit: {outcome.describe()}"
    assert outcome.exit_seconds < max_exit_s, outcome.describe()
    assert not outcome.survivors, f"processes outlived the trainer: {outcome.describe()}"
    expected = {"exit": 0, "exception": 1, "sigterm": -signal.SIGTERM, "sigkill": -signal.SIGKILL}
    if outcome.ending == "sigint":  # KeyboardInterrupt: Python re-raises SIGINT on itself at exit
        assert outcome.returncode in (-signal.SIGINT, 1, 130), outcome.describe()
    else:
        assert outcome.returncode == expected[outcome.ending], outcome.describe()


# ---- the embedded engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedded_outcomes() -> dict[str, TrainerOutcome]:
    """All endings at once (each child loads torch and the model: in parallel they cost one start)."""
    from genengine.models.tiny_model import tiny_model_dir

    model = str(tiny_model_dir())  # the session's default tiny model, built once for every module
    runs = {ending: _run("embedded", ending, model) for ending in ENDINGS}
    return {ending: run.finish(ready_timeout_s=150) for ending, run in runs.items()}


@pytest.mark.parametrize("ending", ENDINGS)
def test_embedded_engine_trainer_leaves_nothing(embedded_outcomes: dict[str, TrainerOutcome], ending: str) -> None:
    outcome = embedded_outcomes[ending]
    _assert_clean(outcome, max_exit_s=20)
    if ending == "exception":
        assert "RuntimeError: the trainer crashed" in outcome.output


# ---- genengine.engine.lifecycle: an engine in other processes --------------------------------------------------------
def test_trainer_output_is_logged_as_it_comes(tmp_path: Path) -> None:
    """A run killed from outside (a CI time limit) keeps what its trainer printed, READY included."""
    log = tmp_path / "trainer.log"
    outcome = _run("lifecycle", "exception", "stop", "0", log_path=str(log)).finish()
    assert outcome.ready_line and outcome.ready_line in log.read_text()
    assert log.read_text() == outcome.output and "RuntimeError" in outcome.output


@pytest.mark.parametrize("ending", ["exit", "exception", "sigint"])
def test_at_exit_stops_engine_processes(ending: str) -> None:
    outcome = _run("lifecycle", ending, "stop", "0").finish()
    assert len(outcome.tree) >= 2, outcome.describe()  # the two engine workers (and spawn's resource tracker)
    _assert_clean(outcome, max_exit_s=15)


@pytest.mark.parametrize("ending", ["sigkill", "sigterm"])
def test_parent_death_signal_kills_engine_processes(ending: str) -> None:
    outcome = _run("lifecycle", ending, "none", "1").finish()
    assert len(outcome.tree) >= 2, outcome.describe()
    _assert_clean(outcome, max_exit_s=10)


def test_a_stop_that_hangs_is_bounded_and_its_processes_killed() -> None:
    outcome = _run("lifecycle", "exit", "hangs", "0").finish()
    _assert_clean(outcome, max_exit_s=15)
    assert "took more than 1 s; killing its processes" in outcome.output


def test_control_without_at_exit_the_exit_hangs() -> None:
    """Why ``at_exit`` exists: multiprocessing joins serving children forever (the harness kills them)."""
    outcome = _run("lifecycle", "exit", "none", "0").finish(exit_timeout_s=3, gone_timeout_s=0)
    assert outcome.returncode is None, f"expected a hung exit: {outcome.describe()}"


def test_control_without_parent_death_signal_sigkill_orphans() -> None:
    """Why ``set_parent_death_signal`` exists: after SIGKILL nothing else stops the children."""
    outcome = _run("lifecycle", "sigkill", "none", "0").finish(gone_timeout_s=2)
    assert outcome.returncode == -signal.SIGKILL
    assert len(outcome.survivors) >= 2, outcome.describe()  # both engine workers
    assert not any(is_alive(p) for p in outcome.survivors)  # the harness cleaned them up


# ---- lifecycle in this process ------------------------------------------------------------------------------
@pytest.fixture
def no_pending() -> Iterator[None]:
    before = lifecycle.pending_exit_cleanups()
    yield
    for handle in lifecycle.pending_exit_cleanups():
        if handle not in before:
            handle.cancel()


@pytest.mark.usefixtures("no_pending")
def test_cancelled_handles_do_not_run_and_order_is_newest_first() -> None:
    calls: list[str] = []
    first = lifecycle.at_exit(lambda: calls.append("first"), name="first")
    second = lifecycle.at_exit(lambda: calls.append("second"), name="second")
    cancelled = lifecycle.at_exit(lambda: calls.append("cancelled"), name="cancelled")
    cancelled.cancel()
    cancelled.cancel()  # idempotent
    assert cancelled not in lifecycle.pending_exit_cleanups()
    assert [h for h in lifecycle.pending_exit_cleanups() if h in (first, second)] == [first, second]
    lifecycle.run_exit_cleanups()
    assert calls[-2:] == ["second", "first"] and "cancelled" not in calls
    assert not first.active and not second.active
    lifecycle.run_exit_cleanups()  # nothing left: no second run
    assert calls.count("first") == 1
    with pytest.raises(TypeError):
        lifecycle.at_exit("not callable", name="x")  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_pending")
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_run_the_parents_stops(tmp_path: Path) -> None:
    """A data-loader worker forked from the trainer must not stop the trainer's engine when it exits."""
    flag = tmp_path / "ran"
    handle = lifecycle.at_exit(lambda: flag.write_text(str(os.getpid())), name="engine")
    pid = os.fork()
    if pid == 0:  # the forked child: run the exit hook as its own exit would
        try:
            lifecycle.run_exit_cleanups()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert not flag.exists(), "the forked child ran the parent's stop"
    handle.run()
    assert flag.read_text() == str(os.getpid())


if __name__ == "__main__":
    kind, end, *rest = sys.argv[1:]
    if kind == "embedded":
        _embedded_trainer(end, rest[0])
    else:
        _lifecycle_trainer(end, rest[0], rest[1] == "1")
