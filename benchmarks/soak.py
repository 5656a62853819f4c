"""Soak: many RL cycles through the protocol, failing on anything that grows from cycle to cycle.

    python benchmarks/soak.py --backend B [--model PATH] --cycles N [--option K=V ...] [--json FILE]

A trainer runs for days; an engine that leaks a little per step dies on day two. Each cycle is the RL step a
trainer makes: ``generate`` → ``sleep(level)`` → ``wake(["weights"])`` → ``load_weights`` →
``wake(["kv_cache"])``, through the protocol only, alternating two weight sets so every load really changes
the weights (and greedy outputs are checked against each set's first outputs). After each cycle, and while
asleep, it records GPU memory (device-wide used memory and this process's ``torch.cuda.memory_allocated``),
the RSS of this process and of its children (the engine's processes), open file descriptors, threads (OS and
Python) and child processes. After ``--warmup`` cycles nothing may grow: GPU memory by more than
``--gpu-tolerance`` of the device (1%), either RSS by more than ``--rss-slope-mib`` per cycle (a robust slope
over the second half), fds, threads or children by even one (judged on the last samples, so a transient one
does not count). Exit status 0 when the run is clean, 1 with one line per leak, 2 when a cycle raised.
``--max-seconds T`` stops starting cycles after T seconds (once the warm-up and 3 more are done) and judges
the ones done, so a run under a time limit still ends with its verdict. ``--inject-leak KIND`` leaks one
fd/thread/child/memory chunk per cycle, to prove the detector fires. Without ``--model`` a tiny random model
is built; backend options come as with ``genengine generate`` (``--option attention_backend=triton``), and
SGLang also reads ``$GENENGINE_SGLANG_OPTIONS``.

Under ``torchrun`` (``WORLD_SIZE`` > 1) each rank takes the GPU of its ``LOCAL_RANK``, the default group is
started (NCCL on GPUs, gloo on CPU), rank 0 builds the tiny model for everyone, and each rank judges its own
process and GPU and writes ``FILE`` with ``.rankN`` before the suffix: a TP group soaks as a trainer runs it.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, str(ROOT))
if str(ROOT / "tests") not in sys.path:  # the repo's test helpers (tests/support), shared with the GPU tests
    sys.path.insert(0, str(ROOT / "tests"))

from support import processes  # noqa: E402

from genengine.cli.args import add_engine_arguments, add_parallel_arguments, engine_kwargs, parallel_kwargs  # noqa: E402

MIB = 1 << 20
LEAK_KINDS = ("fd", "thread", "child", "memory")
PROMPTS = ["The quick brown fox", "Once upon a time", "In a distant galaxy far away", "Hello"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="soak.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_arguments(p)
    p.add_argument("--cycles", type=int, default=200, help="RL cycles to run (default 200)")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop starting cycles after this many seconds of cycling and judge the cycles done (a time limit)",
    )
    p.add_argument("--warmup", type=int, default=None, help="cycles before growth counts (default: 10%%, >= 3)")
    p.add_argument("--sleep-level", type=int, choices=(1, 2), default=2, help="sleep level of each cycle (default 2)")
    add_parallel_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--bucket-bytes", type=int, default=None, help="load_weights bucket size (default: the engine's)")
    p.add_argument(
        "--weights-device", default="auto", help="where the trainer's tensors live: auto (cuda if present), cpu, cuda"
    )
    p.add_argument("--same-weights", action="store_true", help="reload one weight set instead of alternating two")
    p.add_argument("--strict-outputs", action="store_true", help="fail when greedy outputs drift between cycles")
    p.add_argument("--gpu-tolerance", type=float, default=0.01, help="allowed GPU memory growth, share of the device")
    p.add_argument("--rss-slope-mib", type=float, default=1.0, help="allowed RSS growth per cycle, MiB (default 1)")
    p.add_argument(
        "--inject-leak",
        choices=LEAK_KINDS,
        action="append",
        default=[],
        metavar="KIND",
        help=f"self-test: leak one KIND ({', '.join(LEAK_KINDS)}) per cycle; repeatable",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write the samples and the verdict here")
    p.add_argument("--quiet", action="store_true", help="no per-cycle lines")
    return p


# ---- measuring --------------------------------------------------------------------------------------------
class Probe:
    """What the process (and, on a GPU, the device) holds right now."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.device_total = int(torch.cuda.mem_get_info()[1]) if self.cuda else 0

    def sample(self) -> dict[str, int]:
        kids = [p for p in processes.descendants(os.getpid()) if p.state not in ("Z", "X")]
        s = {
            "rss": processes.rss_bytes(),
            "fds": processes.open_fd_count(),
            "os_threads": processes.thread_count(),
            "py_threads": threading.active_count(),
            "children": len(kids),
            "children_rss": sum(_rss_or_zero(p.pid) for p in kids),  # engine processes (SGLang's schedulers)
        }
        if self.cuda:
            torch = self.torch
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            s["gpu_used"] = int(total - free)
            s["gpu_allocated"] = int(torch.cuda.memory_allocated())
        return s


def _rss_or_zero(pid: int) -> int:
    try:
        return processes.rss_bytes(pid)
    except OSError:  # exited between the listing and the read
        return 0


class Leaker:
    """``--inject-leak``: one resource more per cycle, released at the end of the run."""

    def __init__(self, kinds: list[str], probe: Probe) -> None:
        self.kinds = kinds
        self.probe = probe
        self.held: list[Any] = []
        self.stop = threading.Event()

    def leak(self) -> None:
        for kind in self.kinds:
            self._leak(kind)

    def _leak(self, kind: str) -> None:
        if kind == "fd":
            self.held.append(open(os.devnull, "rb"))  # noqa: SIM115 (kept open on purpose)
        elif kind == "thread":
            t = threading.Thread(target=self.stop.wait, daemon=True)
            t.start()
            self.held.append(t)
        elif kind == "child":
            self.held.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        elif kind == "memory":
            if self.probe.cuda:
                n = int(self.probe.device_total * 0.006)  # 0.6% of the device a cycle
                self.held.append(self.probe.torch.empty(n, dtype=self.probe.torch.uint8, device="cuda"))
            else:
                chunk = bytearray(8 * MIB)
                chunk[::4096] = b"x" * len(chunk[::4096])  # touch every page: it counts in RSS
                self.held.append(chunk)

    def release(self) -> None:
        self.stop.set()
        for item in self.held:
            if isinstance(item, subprocess.Popen):
                item.kill()
                item.wait()
            elif hasattr(item, "close"):
                item.close()
        self.held.clear()


# ---- judging ----------------------------------------------------------------------------------------------
def theil_sen_slope(values: list[float]) -> float:
    """Median of the pairwise slopes: one jump in a noisy series does not make a trend."""
    slopes = [(values[j] - values[i]) / (j - i) for i in range(len(values)) for j in range(i + 1, len(values))]
    return statistics.median(slopes) if slopes else 0.0


def judge(
    records: list[dict[str, Any]], warmup: int, *, device_total: int, gpu_tolerance: float, rss_slope: float
) -> list[str]:
    """One message per resource that grew after the warm-up; empty when the run is clean."""
    failures: list[str] = []
    after = [r for r in records if r["cycle"] >= warmup]
    if len(after) < MIN_JUDGED or warmup < 1:
        return [f"too few cycles to judge: {len(after)} after a warm-up of {warmup} (need >= {MIN_JUDGED})"]
    base_cycle = warmup - 1
    base = records[base_cycle]
    for key, what in (("fds", "open file descriptors"), ("os_threads", "OS threads"),
                      ("py_threads", "Python threads"), ("children", "child processes")):  # fmt: skip
        start = base["awake"][key]
        tail = min(r["awake"][key] for r in after[-3:])  # kept for the last three cycles: not transient
        if tail > start:
            peak = max(after, key=lambda r: r["awake"][key])
            failures.append(
                f"{what} grew from {start} (cycle {base_cycle}) to {tail} and stayed there "
                f"(peak {peak['awake'][key]} at cycle {peak['cycle']}): +{tail - start} over {len(after)} cycles"
            )
    if device_total:
        allowed = gpu_tolerance * device_total
        for phase in ("awake", "asleep"):
            for key in ("gpu_used", "gpu_allocated"):
                start = base[phase][key]
                peak_cycle, peak_value = base_cycle, start
                for r in after:
                    if r[phase][key] > peak_value:
                        peak_cycle, peak_value = r["cycle"], r[phase][key]
                growth = peak_value - start
                if growth > allowed:
                    failures.append(
                        f"GPU memory ({key}, {phase}) grew by {growth / MIB:.0f} MiB "
                        f"({100 * growth / device_total:.2f}% of the device, allowed {100 * gpu_tolerance:g}%) "
                        f"from cycle {base_cycle} to cycle {peak_cycle}"
                    )
    half = after[len(after) // 2 :]
    for key, what in (("rss", "RSS"), ("children_rss", "RSS of the child processes")):
        if key not in half[0]["awake"]:
            continue
        slope = theil_sen_slope([r["awake"][key] / MIB for r in half])
        if slope > rss_slope:
            failures.append(
                f"{what} grows {slope:.2f} MiB per cycle over cycles {half[0]['cycle']}..{half[-1]['cycle']} "
                f"(allowed {rss_slope:g}): {half[0]['awake'][key] / MIB:.0f} -> {half[-1]['awake'][key] / MIB:.0f} MiB"
            )
    return failures


# ---- running ----------------------------------------------------------------------------------------------
def weight_sets(model_dir: str, device: str, same: bool) -> list[list[tuple[str, Any]]]:
    """The checkpoint's tensors (set 0, the engine's start weights) and a perturbed copy (set 1)."""
    import torch

    from genengine.testing.conformance import load_checkpoint

    first = {name: t.to(device) for name, t in load_checkpoint(model_dir).items()}
    if same:
        return [list(first.items())]
    gen = torch.Generator(device="cpu").manual_seed(1234)
    second = {}
    for name, t in first.items():
        noise = torch.randn(t.shape, generator=gen).to(device) * (0.05 * float(t.float().std() or 1.0))
        second[name] = (t.float() + noise).to(t.dtype)
    return [list(first.items()), list(second.items())]


MIN_JUDGED = 3
"""Cycles after the warm-up that a verdict needs."""


def out_of_time(since: float, limit: float | None) -> bool:
    """Whether ``limit`` seconds have passed since ``since``; under torchrun every rank gets rank 0's answer
    (they must stop at the same cycle, or the ones going on wait on the others' collectives)."""
    if limit is None:
        return False
    late = time.perf_counter() - since > limit
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = [late]
        dist.broadcast_object_list(flag, src=0)
        late = bool(flag[0])
    return late


def _wait_for_every_rank() -> None:
    """Under torchrun, a barrier: the ranks' engines come up seconds apart on a loaded machine, and a clock
    started before the last one would count that wait as cycling time."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def start_ranks() -> tuple[int, int]:
    """(rank, world size); under torchrun, the rank's device and the default group, as a trainer sets them up."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist
    from support.tp2_run import init_trainer_world

    init_trainer_world()  # as tests/gpu/tp2_vllm.py: no eager device binding
    return dist.get_rank(), world


def shared_model(args: argparse.Namespace, rank: int, world: int) -> None:
    """Without ``--model`` under torchrun, rank 0 builds the tiny model and every rank loads that one."""
    if world == 1 or args.model is not None:
        return
    import torch.distributed as dist

    path = [str(engine_kwargs(args)["model"]) if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    args.model = path[0]


def rank_path(path: str, rank: int, world: int) -> str:
    if world == 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from genengine import create_engine
    from genengine.protocol import TAG_KV_CACHE, TAG_WEIGHTS

    kwargs = {**engine_kwargs(args), **parallel_kwargs(args)}
    model_dir = str(kwargs["model"])
    device = args.weights_device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    warmup = args.warmup if args.warmup is not None else min(max(3, args.cycles // 10), args.cycles - 3)
    probe = Probe()
    sets = weight_sets(model_dir, device, args.same_weights)
    leaker = Leaker(args.inject_leak, probe)
    params = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens, "logprobs": True}
    records: list[dict[str, Any]] = []
    references: dict[int, list[list[int]]] = {}
    mismatches: list[int] = []
    report: dict[str, Any] = {
        "backend": args.backend,
        "model": model_dir,
        "options": dict(args.option),
        "cycles": args.cycles,
        "warmup": warmup,
        "sleep_level": args.sleep_level,
        "weights_device": device,
        "inject_leak": args.inject_leak,
        "device_total_bytes": probe.device_total,
        "start": probe.sample(),
    }
    start = time.perf_counter()
    engine = create_engine(**kwargs)
    report["engine_start_seconds"] = time.perf_counter() - start
    report["engine_started"] = probe.sample()
    # What is alive now (the imported modules, the engine) lives to the end: move it out of the garbage
    # collector's sight. The embedded engine's sleep runs a full gc.collect() each cycle, which otherwise walks
    # over a million objects of torch and transformers (0.25 s a cycle on a CPU, half of a CI-sized soak). What
    # the cycles make, a leak included, is collected and sampled as before.
    gc.collect()
    gc.freeze()
    failure: str | None = None
    _wait_for_every_rank()  # rank 0's clock decides for all: start it once every rank's engine is up
    cycling_since = time.perf_counter()
    try:
        for cycle in range(args.cycles):
            # Never before the verdict has enough cycles: a loaded machine (two ranks on two cores) makes cycles
            # slow, and a time limit that cut them short would fail the run as "too few cycles to judge".
            if cycle >= warmup + MIN_JUDGED and out_of_time(cycling_since, args.max_seconds):
                report["stopped_at_max_seconds"] = cycle
                break
            current = cycle % len(sets)
            results, t_gen = _timed(lambda: engine.generate(PROMPTS, params))
            tokens = [r.outputs[0].token_ids for r in results]
            if current not in references:
                references[current] = tokens
            elif tokens != references[current]:
                mismatches.append(cycle)
            _, t_sleep = _timed(lambda: engine.sleep(args.sleep_level))
            asleep = probe.sample()
            _, t_wake_w = _timed(lambda: engine.wake([TAG_WEIGHTS]))
            stream = iter(sets[(cycle + 1) % len(sets)])
            load, t_load = _timed(functools.partial(engine.load_weights, stream, bucket_bytes=args.bucket_bytes))
            _, t_wake_kv = _timed(lambda: engine.wake([TAG_KV_CACHE]))
            if engine.is_sleeping:  # a backend-specific tag still released: take it back too
                engine.wake()
            if args.inject_leak:
                leaker.leak()
            record = {
                "cycle": cycle,
                "seconds": {
                    "generate": t_gen,
                    "sleep": t_sleep,
                    "wake_weights": t_wake_w,
                    "load_weights": t_load,
                    "wake_kv_cache": t_wake_kv,
                },
                "buckets": load.num_buckets,
                "asleep": asleep,
                "awake": probe.sample(),
            }
            records.append(record)
            if not args.quiet and (cycle < 3 or (cycle + 1) % max(1, args.cycles // 20) == 0):
                a = record["awake"]
                gpu = f" gpu_used={a['gpu_used'] / MIB:.0f}MiB" if "gpu_used" in a else ""
                print(
                    f"soak: cycle {cycle + 1}/{args.cycles} {sum(record['seconds'].values()):.2f}s "
                    f"rss={a['rss'] / MIB:.0f}MiB fds={a['fds']} threads={a['os_threads']} "
                    f"children={a['children']}{gpu}",
                    flush=True,
                )
    except Exception as exc:
        failure = f"cycle {len(records)} raised {type(exc).__name__}: {exc}"
    finally:
        engine.shutdown()
        leaker.release()
    report["end"] = probe.sample()
    report["records"] = records
    report["output_mismatch_cycles"] = mismatches
    if len(references) == 2:  # else alternating the weights would prove nothing about stale weights or caches
        report["weight_sets_differ"] = references[0] != references[1]
    report["failures"] = []
    if failure is not None:
        report["error"] = failure
        return report
    failures = judge(
        records,
        warmup,
        device_total=probe.device_total,
        gpu_tolerance=args.gpu_tolerance,
        rss_slope=args.rss_slope_mib,
    )
    if mismatches and args.strict_outputs:
        failures.append(f"greedy outputs differ from their weight set's first outputs in cycles {mismatches[:10]}")
    report["failures"] = failures
    return report


def summarize(report: dict[str, Any]) -> str:
    records = report["records"]
    who = f" rank {report['rank']}/{report['world_size']}" if report.get("world_size", 1) > 1 else ""
    cut = report.get("stopped_at_max_seconds")
    done = (
        f"{len(records)} of {report['cycles']} cycles (--max-seconds)" if cut is not None else f"{len(records)} cycles"
    )
    lines = [f"soak{who}: {report['backend']} on {report['model']}, {done} (warm-up {report['warmup']})"]
    if records:
        per = {k: statistics.median(r["seconds"][k] for r in records) for k in records[0]["seconds"]}
        lines.append("  median seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in per.items()))
        first, last = records[min(report["warmup"], len(records)) - 1]["awake"], records[-1]["awake"]
        for key in first:
            unit = MIB if key in ("rss", "children_rss", "gpu_used", "gpu_allocated") else 1
            lines.append(f"  {key:13s} {first[key] / unit:10.0f} -> {last[key] / unit:10.0f}")
    if report["output_mismatch_cycles"]:
        lines.append(f"  greedy outputs drifted in {len(report['output_mismatch_cycles'])} cycle(s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cycles < 4:
        print("soak: --cycles must be >= 4 (warm-up plus three judged cycles)", file=sys.stderr)
        return 2
    rank, world = start_ranks()
    shared_model(args, rank, world)
    args.quiet = args.quiet or rank > 0  # one rank's progress lines are enough
    report = run(args)
    report["rank"], report["world_size"] = rank, world
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # rank 0's tiny model folder goes when it exits: the others may still be reading it
        dist.destroy_process_group()
    print(summarize(report))
    if args.json:
        Path(rank_path(args.json, rank, world)).write_text(json.dumps(report, indent=1, default=str))
    if "error" in report:
        print(f"soak: FAILED: {report['error']}", file=sys.stderr)
        return 2
    for message in report["failures"]:
        print(f"soak: LEAK: {message}", file=sys.stderr)
    if report["failures"]:
        return 1
    print("soak: OK: nothing grew after the warm-up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
