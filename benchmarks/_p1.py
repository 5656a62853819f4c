"""P1 of bench_sglang.py and bench_vllm.py: ours and the raw engine alive at once, each in a child process of
its own at about half the GPU, sampled in turn on the same prompts (:mod:`genengine.cli.bench.paired`).

The parent starts the raw child, waits until its engine is up (the engines' memory profiles must not
overlap), then ours; ``memory_share`` of each engine decides its fraction (vLLM's ``gpu_memory_utilization``
is a share of the whole GPU per instance; SGLang's ``mem_fraction_static`` a share of the memory free when
it starts, so ours gets the fraction that makes it take what raw took). Then ``run_paired`` alternates.

Seconds (7B, H200, estimated from the sessions' logs: an engine start with dummy weights is 25-40 s eager,
+15-30 s with CUDA graphs captured (vLLM's torch.compile cached by the kit), a sample 64 x 128 new tokens
at ~9500 tok/s is ~0.9 s): graphs on, 2 starts ~130 s + (2 + 12) rounds x 2 x 0.9 s ~25 s = ~150 s;
the eager row another ~90 s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from genengine.cli.args import int_at_least
from genengine.cli.bench.paired import SampleChild, run_paired

P1_SAMPLES = 12
P1_WARMUP = 2
P1_RAW_SHARE = 0.4  # the raw engine's fraction; ours' follows from what raw took (see module docstring)


def child_argv(script: str, model: str, side: str, graphs: bool, mem_util: float) -> list[str]:
    return [
        sys.executable,
        os.path.abspath(script),
        "--model",
        model,
        "--p1-child",
        side,
        "--p1-graphs",
        "1" if graphs else "0",
        "--p1-mem-util",
        f"{mem_util:.4f}",
    ]


def measure(
    script: str,
    model: str,
    *,
    graphs: bool,
    ours_mem_util: Callable[[int, int], float],
    free_bytes: Callable[[], int],
    log: Callable[[str], None],
    samples: int = P1_SAMPLES,
    warmup: int = P1_WARMUP,
    control: bool = False,
) -> dict[str, Any]:
    """One P1 row (graphs on or eager): start raw, then ours (``ours_mem_util(raw_took, free_now)`` gives
    its fraction), alternate ``samples`` rounds, stop both. ``control``: the second child is raw too (an A/A
    row: what the start order and the halves of the GPU alone give the "ours" side, with nothing of ours in
    it). Errors are reported in the row, not raised."""
    result: dict[str, Any] = {"cuda_graphs": graphs, "raw_mem_util": P1_RAW_SHARE, "control": control}
    start = time.perf_counter()
    with_pair(
        script,
        model,
        result,
        lambda ours, raw: result.update(run_paired(ours, raw, samples=samples, warmup=warmup, log=log)),
        graphs=graphs,
        ours_mem_util=ours_mem_util,
        free_bytes=free_bytes,
        log=log,
        name=f"P1 {'control' if control else 'graphs' if graphs else 'eager'}",
        second="raw" if control else "ours",
    )
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def with_pair(
    script: str,
    model: str,
    result: dict[str, Any],
    body: Callable[[SampleChild, SampleChild], object],
    *,
    graphs: bool,
    ours_mem_util: Callable[[int, int], float],
    free_bytes: Callable[[], int],
    log: Callable[[str], None],
    env: dict[str, str] | None = None,
    name: str = "",
    second: str = "ours",
) -> None:
    """Start raw, then ours (``ours_mem_util(raw_took, free_now)`` gives its fraction), each child's facts in
    ``result``; run ``body(ours, raw)``; close both, their exit codes in ``result["exit_codes"]``: P1's rows and
    benchmarks/profile_p1.py alike. ``second="raw"`` starts a second raw engine in ours' place (P1's control
    row). An error, starting them or in ``body``, goes in ``result["error"]`` and the log (``name`` before it),
    not raised: what the children answered so far stays in ``result``."""
    if second not in ("ours", "raw"):
        raise ValueError(f"second={second!r}: allowed are 'ours' and 'raw'")
    label = "graphs" if graphs else "eager"
    children: list[SampleChild] = []
    try:
        free0 = free_bytes()
        raw = SampleChild(f"raw ({label})", child_argv(script, model, "raw", graphs, P1_RAW_SHARE), env=env)
        children.append(raw)
        result["raw_info"] = raw.wait_ready()
        free1 = free_bytes()
        took = free0 - free1
        util = ours_mem_util(took, free1)
        result["ours_mem_util"] = round(util, 4)
        log(f"P1 {label}: raw up ({took / (1 << 30):.1f} GiB); {second} second at mem_util {util:.3f}")
        name2 = "ours" if second == "ours" else "raw, started second"
        ours = SampleChild(f"{name2} ({label})", child_argv(script, model, second, graphs, util), env=env)
        children.append(ours)
        result["ours_info"] = ours.wait_ready()
        result["ours_took_gib"] = round((free1 - free_bytes()) / (1 << 30), 2)
        result["raw_took_gib"] = round(took / (1 << 30), 2)
        body(ours, raw)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        log(f"{name} failed: {result['error']}" if name else f"failed: {result['error']}")
    finally:
        for child in reversed(children):
            result.setdefault("exit_codes", {})[child.name] = child.close()


PROFILE_ENV = "GENENGINE_P1_PROFILE"
"""Set to 1 in a P1 child's environment (benchmarks/profile_p1.py): its sample times its engine's inner calls."""


def profiling() -> bool:
    return os.environ.get(PROFILE_ENV) == "1"


class Clock:
    """Times calls of methods wrapped on live objects (instance attributes, so only this engine's): per name,
    every call's start and end. A sample takes the figures relative to its own start and clears them."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = {}

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        spans = self.spans.setdefault(name, [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spans.append((t, time.perf_counter()))

        setattr(obj, attr, timed)

    def take(self, t0: float, t1: float) -> dict[str, Any]:
        """``{"outer_s": t1 - t0, name: {n, total_s, median_s, first_start_s, last_end_s}}`` (offsets from
        ``t0``) of the calls since the last take."""
        out: dict[str, Any] = {"outer_s": t1 - t0}
        for name, spans in self.spans.items():
            if spans:
                durations = sorted(e - s for s, e in spans)
                out[name] = {
                    "n": len(spans),
                    "total_s": sum(durations),
                    "median_s": durations[len(durations) // 2],
                    "first_start_s": spans[0][0] - t0,
                    "last_end_s": spans[-1][1] - t0,
                }
            spans.clear()
        return out


def timed_sample(clock: Clock | None, run: Callable[[], int]) -> int | tuple[int, dict[str, Any]]:
    """``run()``'s tokens, with the clock's figures for this sample when profiling."""
    if clock is None:
        return run()
    t0 = time.perf_counter()
    tokens = run()
    return tokens, clock.take(t0, time.perf_counter())


Started = tuple[Callable[..., Any], dict[str, Any], Callable[[], Any] | None]


def serve_child(result_fd: int, start: Callable[[], Started]) -> None:
    """The child's side: ``start()`` builds the engine and returns ``(sample(seed) -> tokens, info, stop)``;
    then it serves samples until told to quit, calls ``stop`` (engines with processes of their own: SGLang's
    scheduler would outlive an ``os._exit`` and hold its memory) and ends without any other teardown."""
    from genengine.cli.bench.paired import serve

    out = os.fdopen(result_fd, "w", encoding="utf-8")
    try:
        sample, info, stop = start()
    except Exception as exc:
        import traceback

        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        traceback.print_exc()
        os._exit(1)
    serve(sample, out, info=info)
    if stop is not None:
        stop()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def labels(mode: str) -> tuple[str, str]:
    """The report's two row names for one P1 mode (its tok/s pair, its ratio)."""
    if mode == "control":
        return "P1 generate tok/s, control (raw started second, raw)", "P1 raw started second / raw, control"
    return f"P1 generate tok/s, {mode} (paired)", f"P1 ours / raw, {mode}"


def cells(row: dict[str, Any]) -> tuple[str, str, str]:
    """(ours, raw, ours/raw) of one P1 row as table cells: medians with their spread (max - min, % of the
    median), the ratio with the range of the per-round ratios; an error in the first cell."""
    if "error" in row or "ratio" not in row:
        return f"failed: {row.get('error', 'no samples')}"[:160], "-", "-"
    o, r, q = row["ours"], row["raw"], row["ratio"]
    return (
        f"{o['median']:.1f} tok/s (spread {o['spread_pct']:.1f} %)",
        f"{r['median']:.1f} tok/s (spread {r['spread_pct']:.1f} %)",
        f"{q['median']:.4f} (rounds {q['min']:.3f}-{q['max']:.3f}, n={row['samples']})",
    )


def ratio(report_p1: dict[str, Any], mode: str = "graphs") -> float | None:
    row = report_p1.get(mode) or {}
    return row["ratio"]["median"] if "ratio" in row else None


MODES = ("graphs", "eager", "control")
"""P1's rows: CUDA graphs on (what users run), eager, and ``control``: graphs on with raw in ours' place."""


def modes(text: str) -> list[str]:
    """``--p1-modes``: comma-separated from ``MODES`` (in the order given); '' or 'none' for no P1."""
    got = [m.strip() for m in text.split(",") if m.strip() and m.strip() != "none"]
    bad = [m for m in got if m not in MODES]
    if bad or len(set(got)) != len(got):
        raise argparse.ArgumentTypeError(f"--p1-modes {text!r}: allowed are {', '.join(MODES)}, each once")
    return got


def measure_mode(mode: str, script: str, model: str, **kwargs: Any) -> dict[str, Any]:
    """``measure`` for one of ``MODES``."""
    return measure(script, model, graphs=mode != "eager", control=mode == "control", **kwargs)


samples = int_at_least(10, "--p1-samples {text!r}: at least 10 rounds (1 % needs them)")
"""``--p1-samples``: paired rounds per P1 row."""
