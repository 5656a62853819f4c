"""Paired throughput samples: ours and the raw engine alive at once, each in a process of its own,
sampled in turn on the same prompts, so that a drift of the GPU (clocks, heat, a neighbour) lands on both.

One unpaired median of five runs could not resolve 1 %: the same commit gave ours ÷ raw 1.25 and 0.54 in
two runs (issue 41). With both engines up, sample *i* of ours and of raw run back to back on the same
prompts (the order flips each round), and the ratio is the median of the per-round ratios, reported with
the spread of each side.

The engines run in child processes (vLLM's sleep allocator serves one engine per process) that speak a
line protocol on stdin and a result pipe: :func:`serve` is the child's loop, :class:`SampleChild` the
parent's handle and :func:`run_paired` the alternation. The statistics (:func:`summarize`,
:func:`pair_ratio`) are plain functions of lists of numbers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, Protocol

from genengine.errors import InvalidArgumentError

__all__ = ["SampleChild", "Sampler", "pair_ratio", "run_paired", "serve", "summarize"]

READY = "ready"


def summarize(samples: Sequence[float]) -> dict[str, Any]:
    """Median and spread of samples: ``spread_pct`` is (max - min) / median, ``iqr_pct`` the interquartile
    range / median, both in percent, so "ours is 0.5 % slower" can be read against the noise of each side."""
    values = [float(x) for x in samples]
    if not values:
        raise InvalidArgumentError("summarize: no samples (expected at least one number)")
    med = statistics.median(values)
    lo, hi = min(values), max(values)
    if len(values) >= 2:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    else:
        q1 = q3 = values[0]
    scale = 100.0 / med if med else float("nan")
    return {
        "n": len(values),
        "median": med,
        "min": lo,
        "max": hi,
        "spread_pct": (hi - lo) * scale,
        "iqr_pct": (q3 - q1) * scale,
        "all": values,
    }


def pair_ratio(ours: Sequence[float], raw: Sequence[float]) -> dict[str, Any]:
    """Ours ÷ raw of paired samples (sample i of each ran back to back): the median of the per-pair ratios
    (what drift between pairs cannot move), its spread, and the ratio of the two medians beside it."""
    if len(ours) != len(raw) or not ours:
        raise InvalidArgumentError(
            f"pair_ratio: {len(ours)} samples of ours and {len(raw)} of raw; expected the same number, >= 1"
        )
    if any(r <= 0 for r in raw):
        raise InvalidArgumentError(f"pair_ratio: raw samples must be > 0, got {list(raw)}")
    ratios = [o / r for o, r in zip(ours, raw, strict=True)]
    summary = summarize(ratios)
    return {
        "median": summary["median"],
        "min": summary["min"],
        "max": summary["max"],
        "iqr_pct": summary["iqr_pct"],
        "of_medians": statistics.median(ours) / statistics.median(raw),
        "all": ratios,
    }


# ---- the child ---------------------------------------------------------------------------------------------
def serve(
    sample: Callable[..., int | tuple[int, Mapping[str, Any]]],
    out: IO[str],
    *,
    info: Mapping[str, Any] | None = None,
    commands: IO[str] | None = None,
) -> None:
    """The child's loop: announce ``ready`` (with ``info``), then for each ``sample SEED`` line on
    ``commands`` (stdin) run ``sample(seed)`` (it returns the tokens it generated), time it and answer one
    JSON line on ``out``; ``quit`` or end of input returns. An error is answered, not raised: the parent
    reports it beside the other side's figures. ``sample SEED NEW`` calls ``sample(seed, NEW)`` (a profile
    asks for other lengths); a sample that returns ``(tokens, detail)`` has ``detail`` (its own timings)
    answered beside its time."""
    src = sys.stdin if commands is None else commands

    def say(obj: Mapping[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say({READY: True, **(info or {})})
    for line in src:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "quit" or not cmd:
            return
        if cmd != "sample":
            say({"error": f"unknown command {cmd!r} (allowed: sample SEED [NEW_TOKENS], quit)"})
            continue
        try:
            args = [int(x) for x in arg.split()]
            start = time.perf_counter()
            got = sample(*args)
            secs = time.perf_counter() - start
            tokens, detail = (got[0], got[1]) if isinstance(got, tuple) else (got, None)
            answer: dict[str, Any] = {"tokens": int(tokens), "seconds": secs, "tok_per_s": int(tokens) / secs}
            if detail is not None:
                answer["detail"] = dict(detail)
            say(answer)
        except Exception as exc:
            say({"error": f"{type(exc).__name__}: {exc}"})


# ---- the parent --------------------------------------------------------------------------------------------
class Sampler(Protocol):
    """A side of the pair: a :class:`SampleChild`, or an engine in this process answering the same way."""

    def sample(self, seed: int) -> dict[str, Any]: ...


class SampleChild:
    """A child process running :func:`serve`: started with ``argv`` and ``--result-fd N`` appended (the
    write end of a pipe it answers on; its stdout stays free for the engine's logs)."""

    def __init__(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> None:
        self.name = name
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [*argv, "--result-fd", str(write_fd)],
                stdin=subprocess.PIPE,
                pass_fds=(write_fd,),
                text=True,
                start_new_session=True,  # its group: a child that will not quit is killed with its own children
                env=None if env is None else {**os.environ, **env},
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._results = os.fdopen(read_fd, "r", encoding="utf-8")
        self.info: dict[str, Any] = {}

    def _answer(self) -> dict[str, Any]:
        line = self._results.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise RuntimeError(f"{self.name}: the child exited ({code}) without an answer")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def wait_ready(self) -> dict[str, Any]:
        """Block until the engine is up; its ``info`` (start time, memory) or a RuntimeError saying why not."""
        answer = self._answer()
        if "error" in answer or not answer.get(READY):
            raise RuntimeError(f"{self.name}: {answer.get('error', answer)}")
        self.info = {k: v for k, v in answer.items() if k != READY}
        return self.info

    def sample(self, seed: int, new_tokens: int | None = None) -> dict[str, Any]:
        """One timed sample on the prompts of ``seed`` (``new_tokens``: another length than the child's own)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"sample {seed}\n" if new_tokens is None else f"sample {seed} {new_tokens}\n")
        self.proc.stdin.flush()
        answer = self._answer()
        if "error" in answer:
            raise RuntimeError(f"{self.name}: {answer['error']}")
        return answer

    def close(self, timeout: float = 120.0) -> int | None:
        """Ask the child to quit and wait (killed after ``timeout`` seconds); its exit status."""
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait(timeout=30)
        self._results.close()
        return code


def run_paired(
    ours: Sampler,
    raw: Sampler,
    *,
    samples: int = 12,
    warmup: int = 2,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``warmup`` untimed rounds, then ``samples`` rounds: in round *i* both engines generate on prompts of
    seed *i*, ours first in even rounds and raw first in odd ones. Tokens/s of each side summarized, and the
    paired ratio."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise InvalidArgumentError(f"samples={samples!r} must be an integer >= 1")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise InvalidArgumentError(f"warmup={warmup!r} must be an integer >= 0")
    got: dict[str, list[float]] = {"ours": [], "raw": []}
    for i in range(-warmup, samples):
        seed = 1000 + i if i < 0 else i
        order = (("ours", ours), ("raw", raw)) if i % 2 == 0 else (("raw", raw), ("ours", ours))
        for side, child in order:
            answer = child.sample(seed)
            if i >= 0:
                got[side].append(float(answer["tok_per_s"]))
        if log is not None and i >= 0:
            log(f"P1 round {i + 1}/{samples}: ours {got['ours'][-1]:.1f}, raw {got['raw'][-1]:.1f} tok/s")
    return {
        "samples": samples,
        "warmup": warmup,
        "ours": summarize(got["ours"]),
        "raw": summarize(got["raw"]),
        "ratio": pair_ratio(got["ours"], got["raw"]),
    }
