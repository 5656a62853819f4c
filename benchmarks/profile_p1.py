"""Where ours loses against the raw engine in P1: the same children as P1 (benchmarks/_p1.py, CUDA graphs on),
timed inside, on the same prompts, at two lengths.

    PYTHONPATH=/tmp/site-proj:/tmp/site-ENGINE python3 benchmarks/profile_p1.py ENGINE [--rounds 4] [--short 32]
        [--eager] [--json PATH] [--summary PATH]            (or: tools/gpu/run_tests.sh ENGINE --script ...)

Both engines up at once as in P1 (raw first, then ours at the fraction that gives it what raw took), each child
started with ``GENENGINE_P1_PROFILE=1``. One warm-up round, then ``--rounds`` rounds; in each, both sides generate
on the prompts of the round's seed (64 x 128 ids, greedy, ignore_eos) once with ``--short`` new tokens and once
with 128, the side going first alternating. Two views of the same samples:

* **Fixed and per-step cost** (both engines): a call of N new tokens takes ``fixed + N x per_token``; the two
  lengths give both per side (medians over rounds), and ours minus raw of each says whether the gap is a cost
  per call (preparing requests, converting outputs) or per decode step (a per-step callback, logprobs, a sync).
* **Inside the call** (the calls each child wraps on its own engine objects, the same on both sides):
  vLLM: ``LLM.generate`` (ours' time outside it is ours alone), ``LLMEngine.step`` (count, median), of which
  ``engine_core.get_output`` (schedule + forward + sample) and ``output_processor.process_outputs`` (host), and
  the time before the first step (adding the requests) and after the last. SGLang: ours' ``_call_sglang`` (the
  tokenizer manager's generate, which raw's ``Engine.generate`` also runs) against ours' whole call.

Seconds on one H200 at 7B (dummy weights): two starts with CUDA graphs ~70-80 s (vLLM's torch.compile cached
by the kit), then (1 + 4) rounds x 2 sides x (0.25 + 0.9) s ~12 s: ~90 s. Writes ``profile_p1_ENGINE.json`` and
a short text summary ``profile_p1_ENGINE.txt`` (to ``$OUT`` when set, else the working folder; ``--json``,
``--summary`` to choose), and prints the summary and ``PROFILE_P1_RESULT {json}``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import _p1
from _bench_7b import NEW_TOKENS, make_model_dir  # this folder is on sys.path when the script runs

from genengine.cli.args import int_at_least

T0 = time.time()


def log(msg: str) -> None:
    print(f"[profile-p1 {time.time() - T0:7.1f}s] {msg}", flush=True)


_rounds = int_at_least(2, "--rounds {text!r}: an integer >= 2 (a median needs them)")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", choices=("sglang", "vllm"))
    ap.add_argument("--model", default=None, help="the 7B-shaped folder (default: the bench script's)")
    ap.add_argument("--rounds", type=_rounds, default=4, help="timed rounds after one warm-up (default 4)")
    ap.add_argument("--short", type=int, default=32, help=f"the short length, new tokens (< {NEW_TOKENS}; default 32)")
    ap.add_argument("--eager", action="store_true", help="CUDA graphs off (default: on, as users run)")
    ap.add_argument("--json", default=None, help="the report (default: $OUT/profile_p1_ENGINE.json)")
    ap.add_argument("--summary", default=None, help="the text summary (default: $OUT/profile_p1_ENGINE.txt)")
    a = ap.parse_args(argv)
    if not 1 <= a.short < NEW_TOKENS:
        ap.error(f"--short {a.short}: allowed 1 to {NEW_TOKENS - 1} (the long length is {NEW_TOKENS})")
    out = os.environ.get("OUT") or "."
    a.json = a.json or os.path.join(out, f"profile_p1_{a.engine}.json")
    a.summary = a.summary or os.path.join(out, f"profile_p1_{a.engine}.txt")
    a.model = a.model or os.path.join(tempfile.gettempdir(), f"genengine-qwen2-7b-shape-{a.engine}")
    return a


# ---- the analysis (plain numbers: tested on the CPU) ----------------------------------------------------------
def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def fit(short: int, long: int, short_s: float, long_s: float) -> dict[str, float]:
    """``seconds = fixed + new_tokens x per_token`` through the two medians."""
    per_token = (long_s - short_s) / (long - short)
    return {"fixed_ms": 1000 * (long_s - long * per_token), "per_token_us": 1e6 * per_token}


def inside(details: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Medians over samples of what the child timed inside its calls (milliseconds; step counts as counts)."""
    rows: dict[str, list[float]] = {}

    def add(key: str, value: float | None) -> None:
        if value is not None:
            rows.setdefault(key, []).append(value)

    for d in details:
        outer = d["outer_s"]
        add("call_ms", 1000 * outer)
        for name in ("llm_generate", "sglang_generate"):
            inner = d.get(name)
            if inner:
                add(f"{name}_ms", 1000 * inner["total_s"])
                add("outside_engine_call_ms", 1000 * (outer - inner["total_s"]))
        step = d.get("step")
        if step:
            add("steps", float(step["n"]))
            add("step_median_us", 1e6 * step["median_s"])
            add("steps_total_ms", 1000 * step["total_s"])
            gen = d.get("llm_generate")
            if gen:
                add("before_first_step_ms", 1000 * (step["first_start_s"] - gen["first_start_s"]))
                add("after_last_step_ms", 1000 * (gen["last_end_s"] - step["last_end_s"]))
        for name in ("engine_core", "process_outputs"):
            part = d.get(name)
            if part:
                add(f"{name}_total_ms", 1000 * part["total_s"])
                add(f"{name}_median_us", 1e6 * part["median_s"])
    return {k: statistics.median(v) for k, v in rows.items()}


def analyse(samples: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]], short: int, long: int) -> dict[str, Any]:
    """``samples[side][length]``: the children's answers in round order (paired by position)."""
    sides: dict[str, Any] = {}
    for side in ("ours", "raw"):
        by = samples[side]
        med = {n: _median([a["seconds"] for a in by[n]]) for n in (short, long)}
        row: dict[str, Any] = {f"seconds_{n}": med[n] for n in (short, long)}
        if med[short] is not None and med[long] is not None:
            row.update(fit(short, long, med[short], med[long]))
        row["inside_long"] = inside([a["detail"] for a in by[long] if "detail" in a])
        row["inside_short"] = inside([a["detail"] for a in by[short] if "detail" in a])
        sides[side] = row
    gaps = {}
    for n in (short, long):
        pairs = list(zip(samples["ours"][n], samples["raw"][n], strict=False))
        if pairs:
            gaps[f"ours_minus_raw_ms_{n}"] = 1000 * statistics.median(o["seconds"] - r["seconds"] for o, r in pairs)
            gaps[f"ratio_tok_s_{n}"] = statistics.median(o["tok_per_s"] / r["tok_per_s"] for o, r in pairs)
    if "fixed_ms" in sides["ours"] and "fixed_ms" in sides["raw"]:
        gaps["fixed_ms"] = sides["ours"]["fixed_ms"] - sides["raw"]["fixed_ms"]
        gaps["per_token_us"] = sides["ours"]["per_token_us"] - sides["raw"]["per_token_us"]
        gaps[f"per_token_ms_x{long}"] = gaps["per_token_us"] * long / 1000
    inner = {}
    for key in sorted(set(sides["ours"]["inside_long"]) | set(sides["raw"]["inside_long"])):
        o, r = sides["ours"]["inside_long"].get(key), sides["raw"]["inside_long"].get(key)
        if o is not None and r is not None:
            inner[key] = o - r
    gaps["inside_long_ours_minus_raw"] = inner
    return {"short": short, "long": long, "sides": sides, "gap": gaps}


def summary(report: Mapping[str, Any]) -> str:
    if "analysis" not in report:
        return f"profile_p1 {report.get('engine')}: failed: {report.get('error', 'no samples')}"
    a = report["analysis"]
    short, long = a["short"], a["long"]
    g, o, r = a["gap"], a["sides"]["ours"], a["sides"]["raw"]
    lines = [
        f"profile_p1 {report['engine']} ({'CUDA graphs' if report['cuda_graphs'] else 'eager'}), "
        f"{report['rounds']} rounds, medians; ours / raw tok/s at {long}: {g.get(f'ratio_tok_s_{long}', 0):.4f}, "
        f"at {short}: {g.get(f'ratio_tok_s_{short}', 0):.4f}",
        f"  a call of {long}: ours - raw {g.get(f'ours_minus_raw_ms_{long}', 0):+.2f} ms "
        f"(of {1000 * (r.get(f'seconds_{long}') or 0):.1f}); "
        f"of {short}: {g.get(f'ours_minus_raw_ms_{short}', 0):+.2f} ms",
    ]
    if "fixed_ms" in g:
        lines.append(
            f"  fixed per call: ours {o['fixed_ms']:.2f} ms, raw {r['fixed_ms']:.2f} ms ({g['fixed_ms']:+.2f}); "
            f"per new token: ours {o['per_token_us']:.1f} us, raw {r['per_token_us']:.1f} us "
            f"({g['per_token_us']:+.2f} us, x{long} = {g[f'per_token_ms_x{long}']:+.2f} ms)"
        )
    for side, row in (("ours", o), ("raw", r)):
        ins = row["inside_long"]
        if ins:
            lines.append(f"  inside, {side}, {long} new tokens: " + ", ".join(f"{k} {v:.3g}" for k, v in ins.items()))
    if g.get("inside_long_ours_minus_raw"):
        lines.append(
            "  inside, ours - raw: " + ", ".join(f"{k} {v:+.3g}" for k, v in g["inside_long_ours_minus_raw"].items())
        )
    return "\n".join(lines)


# ---- the run -------------------------------------------------------------------------------------------------
def run_rounds(
    ours: Any, raw: Any, *, rounds: int, lengths: Sequence[int], log: Callable[[str], None] = log
) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """One warm-up round, then ``rounds``: per round and length both sides on the same seed, order alternating."""
    got: dict[str, dict[int, list[dict[str, Any]]]] = {side: {n: [] for n in lengths} for side in ("ours", "raw")}
    for i in range(-1, rounds):
        seed = 2000 + i
        for n in lengths:
            order = (("ours", ours), ("raw", raw)) if i % 2 == 0 else (("raw", raw), ("ours", ours))
            for side, child in order:
                answer = child.sample(seed, n)
                if i >= 0:
                    got[side][n].append(answer)
        if i >= 0:
            times = (f"{s} {n}: {got[s][n][-1]['seconds']:.3f} s" for s in got for n in lengths)
            log(f"round {i + 1}/{rounds}: " + ", ".join(times))
    return got


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    bench = importlib.import_module(f"bench_{a.engine}")
    make_model_dir(a.model, tokenizer=a.engine == "sglang")
    report: dict[str, Any] = {"engine": a.engine, "cuda_graphs": not a.eager, "rounds": a.rounds, "model": a.model}

    def profile(ours: Any, raw: Any) -> None:
        samples = run_rounds(ours, raw, rounds=a.rounds, lengths=(a.short, NEW_TOKENS))
        report["samples"] = samples
        report["analysis"] = analyse(samples, a.short, NEW_TOKENS)

    _p1.with_pair(
        os.path.abspath(bench.__file__),
        a.model,
        report,
        profile,
        graphs=not a.eager,
        ours_mem_util=bench.ours_mem_util,
        free_bytes=bench.free_bytes,
        log=log,
        env={_p1.PROFILE_ENV: "1"},
    )
    report["elapsed_s"] = round(time.time() - T0, 1)
    text = summary(report)
    print(text, flush=True)
    print("PROFILE_P1_RESULT " + json.dumps(report.get("analysis", {"error": report.get("error")})), flush=True)
    with open(a.json, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1, default=str)
    with open(a.summary, "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    return 1 if "error" in report else 0  # the engines lived in the children, which are closed


if __name__ == "__main__":
    sys.exit(main())
