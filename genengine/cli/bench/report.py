"""The output of ``genengine bench``: the end-of-run table and the four-panel plot of a report.

Both read only the report's plain data (what :func:`~genengine.cli.bench.run_bench` returns, or its JSON
file), so a saved report can be re-rendered without running anything.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["format_report", "plot_report"]


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n} B"


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "n/a"
    if s < 0.001:
        return f"{s * 1e6:.0f} µs"
    return f"{s * 1000:.2f} ms" if s < 0.01 else f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def _rows(report: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    g = report["generate"]
    world = f", {report['world_size']} ranks (memory summed)" if report.get("world_size", 1) > 1 else ""
    yield (
        "backend",
        f"{report['backend']} on {report['device']}, tp_size={report['tp_size']}{world}, dtype={report['dtype']}",
    )
    yield (
        "model",
        f"{report['model']} ({report['weights']['num_tensors']} tensors, {_fmt_bytes(report['weights']['num_bytes'])})",
    )
    yield "engine start", _fmt_s(report["create_seconds"])
    yield "engine memory", f"{_fmt_bytes(report['engine_memory_bytes'])} awake with weights ({report['memory_probe']})"
    s = report["settings"]
    shape = f"{s['batch_size']} prompts x {s['prompt_len']} tokens, {s['max_new_tokens']} new, greedy"
    spread = ""
    if g.get("spread_pct") is not None and len(g.get("tokens_per_s_runs", [])) > 1:
        spread = f", spread {g['spread_pct']:.1f} % over {len(g['tokens_per_s_runs'])} runs"
    yield "generate", f"{g['tokens_per_s']:.1f} tok/s ({shape}{spread})"
    if g.get("paired"):
        yield (
            "generate, raw engine",
            f"{g['raw_tokens_per_s']:.1f} tok/s (spread {g['raw_spread_pct']:.1f} %); ours/raw {g['vs_raw']:.4f} "
            f"(paired rounds {g['vs_raw_min']:.3f}-{g['vs_raw_max']:.3f}, n={g['samples']})",
        )
    elif g.get("raw_tokens_per_s"):
        yield "generate, raw engine", f"{g['raw_tokens_per_s']:.1f} tok/s (ours/raw = {g['vs_raw']:.2f})"
    elif g.get("raw_error"):
        yield "generate, raw engine", f"failed: {g['raw_error']}"
    else:
        yield "generate, raw engine", "n/a (the plugin registers no raw_runner)"
    lw = report["load_weights"]
    b = lw["bucketed"]
    yield (
        "load_weights, bucketed",
        (
            f"{_fmt_s(b['seconds'])} ({b['gb_per_s']:.2f} GB/s, {b['num_buckets']} bucket(s)); "
            f"until a generate sees them {_fmt_s(b['until_visible_seconds'])}"
        ),
    )
    p = lw.get("per_parameter")
    if p:
        yield (
            "load_weights, per parameter",
            (
                f"{_fmt_s(p['seconds'])} ({p['gb_per_s']:.2f} GB/s, {p['calls']} calls,"
                f" {_fmt_s(p['seconds_per_call'])}/call)"
            ),
        )
    yield "same greedy output after loads", "yes" if lw.get("greedy_unchanged") else "NO"
    for c in report["sleep"]:
        lvl = c["level"]
        if "error" in c:
            yield f"sleep level {lvl}", f"not supported: {c['error']}"
            continue
        share = f" = {c['freed_share']:.1%} of engine memory" if c.get("freed_share") is not None else ""
        yield f"sleep level {lvl}", f"{_fmt_s(c['sleep_seconds'])}, frees {_fmt_bytes(c['freed_bytes'])}{share}"
        for w in c["wake"]:
            yield f"  wake {w['tag']}", _fmt_s(w["seconds"])
            if w["tag"] == "weights" and "reload_seconds" in c:
                yield "  load_weights (re-push)", _fmt_s(c["reload_seconds"])
        yield "  same greedy output after wake", "yes" if c["greedy_unchanged"] else "NO"
    sd = report["shutdown"]
    note = " (CPU: includes code loaded on first use)" if report["device"].startswith("cpu") else ""
    yield (
        "shutdown",
        f"{_fmt_s(sd['seconds'])}, memory left above the start {_fmt_bytes(sd['memory_left_bytes'])}{note}",
    )
    yield "benchmark took", _fmt_s(report["total_seconds"])


def format_report(report: Mapping[str, Any]) -> str:
    """The end-of-run table, one measurement per line."""
    rows = list(_rows(report))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 2 + max(len(v) for _, v in rows))
    body = "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
    return f"{line}\n{body}\n{line}"


def _time_unit(seconds: list[float]) -> tuple[float, str]:
    return (1000.0, "ms") if max(seconds, default=0.0) < 1 else (1.0, "s")


def plot_report(report: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Four panels: throughput, weight sync, memory freed by sleep, time of each sleep/wake step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    fig.suptitle(f"genengine bench: {report['backend']} on {report['device']}", fontsize=13)
    ours, other, third = "#3b6fb6", "#b0b0b0", "#e08a3c"

    ax = axes[0][0]
    g = report["generate"]
    labels, values, colors = ["genengine"], [g["tokens_per_s"]], [ours]
    if g.get("raw_tokens_per_s"):
        labels.append("raw engine")
        values.append(g["raw_tokens_per_s"])
        colors.append(other)
    else:
        ax.text(0.98, 0.95, "raw engine: n/a", ha="right", va="top", transform=ax.transAxes, color="#666666")
    bars = ax.bar(labels, values, color=colors, width=0.6)
    ax.bar_label(bars, fmt="%.0f")
    s = report["settings"]
    ax.set_title(f"generate: {s['batch_size']} prompts x {s['prompt_len']} tokens, {s['max_new_tokens']} new")
    ax.set_ylabel("tokens / s")
    ax.margins(y=0.15)

    ax = axes[0][1]
    lw = report["load_weights"]
    labels = ["bucketed\n(1 call)"]
    secs = [lw["bucketed"]["seconds"]]
    rates = [lw["bucketed"]["gb_per_s"]]
    if lw.get("per_parameter"):
        labels.append(f"per parameter\n({lw['per_parameter']['calls']} calls)")
        secs.append(lw["per_parameter"]["seconds"])
        rates.append(lw["per_parameter"]["gb_per_s"])
    scale, unit = _time_unit(secs)
    bars = ax.bar(labels, [x * scale for x in secs], color=[ours, other][: len(labels)], width=0.6)
    ax.bar_label(bars, labels=[f"{_fmt_s(x)}\n{r:.2f} GB/s" for x, r in zip(secs, rates, strict=True)])
    ax.set_title(
        f"load_weights: {_fmt_bytes(report['weights']['num_bytes'])} in {report['weights']['num_tensors']} tensors"
    )
    ax.set_ylabel(unit)
    ax.margins(y=0.25)

    ax = axes[1][0]
    cycles = [c for c in report["sleep"] if "error" not in c]
    engine_mem = report.get("engine_memory_bytes") or 0
    mib = 1 << 20
    if cycles and engine_mem:
        labels = [f"level {c['level']}" for c in cycles]
        freed = [max(c["freed_bytes"] or 0, 0) / mib for c in cycles]
        kept = [max(engine_mem / mib - f, 0) for f in freed]
        ax.bar(labels, freed, color=ours, label="freed by sleep", width=0.6)
        ax.bar(labels, kept, bottom=freed, color=other, label="still held", width=0.6)
        for i, c in enumerate(cycles):
            if c.get("freed_share") is not None:
                ax.text(i, engine_mem / mib, f"{c['freed_share']:.0%} freed", ha="center", va="bottom")
        ax.legend(loc="center right")
        ax.set_ylim(0, engine_mem / mib * 1.15)
    else:
        ax.text(0.5, 0.5, "no sleep measurement", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(f"sleep: memory freed, of the engine's {_fmt_bytes(engine_mem)}")
    ax.set_ylabel(f"MiB ({report['memory_probe']})")

    ax = axes[1][1]
    if cycles:
        steps: list[str] = ["sleep"]
        for c in cycles:
            for w in c["wake"]:
                if w["tag"] not in steps:
                    steps.append(w["tag"])
        if any("reload_seconds" in c for c in cycles):  # the trainer's re-push comes right after waking weights
            steps.insert(steps.index("weights") + 1 if "weights" in steps else len(steps), "re-push")
        times = []
        for c in cycles:
            t = {"sleep": c["sleep_seconds"], "re-push": c.get("reload_seconds")}
            t.update({w["tag"]: w["seconds"] for w in c["wake"]})
            times.append(t)
        scale, unit = _time_unit([v for t in times for v in t.values() if v is not None])
        width = 0.8 / len(cycles)
        for i, (c, t) in enumerate(zip(cycles, times, strict=True)):
            pts = [(j, t[step]) for j, step in enumerate(steps) if t.get(step) is not None]
            xs = [j + (i - (len(cycles) - 1) / 2) * width for j, _ in pts]
            bars = ax.bar(
                xs, [v * scale for _, v in pts], width=width, label=f"level {c['level']}", color=[ours, third][i % 2]
            )
            ax.bar_label(bars, labels=[_fmt_s(v) for _, v in pts], fontsize=8)
        names = {"sleep": "sleep", "re-push": "load_weights\n(re-push)"}
        ax.set_xticks(range(len(steps)), [names.get(st, f"wake\n{st}") for st in steps])
        ax.legend()
        ax.margins(y=0.15)
        ax.set_ylabel(unit)
    ax.set_title("sleep, then the staged wake (weights first)")

    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
