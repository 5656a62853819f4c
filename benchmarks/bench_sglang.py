"""The sglang backend at 7B scale on one GPU, with a raw ``sglang.Engine`` measured beside it in the same run.

    PYTHONPATH=/tmp/site-proj:/tmp/site-sglang python3 benchmarks/bench_sglang.py [--json PATH] [--strict]
    (or: bash tools/gpu/run_tests.sh sglang --bench)
    [--p1-only] [--p1-modes graphs,eager,control] [--p1-samples 12]

Model: Qwen2-7B shapes (config.json and a small tokenizer only, ``load_format="dummy"``: random bf16 weights,
15.2 GB, 339 tensors), memory fraction 0.6, no CUDA graphs, no radix cache, token-id prompts, as
shared/gpu/anchor_bench.py. Machine settings (triton attention, pytorch sampling on the H200 kit) come from
``$GENENGINE_SGLANG_OPTIONS`` and apply to both engines. The raw engine runs first, in a child process, with
exactly the server arguments genengine passes (minus its own loader and logit-filter hooks); then ours, in
this process, driven as a trainer drives it.

  P1  generate: 64 prompts x 128 random ids, 128 new tokens, greedy, ignore_eos; output tokens/s, CUDA
      graphs on (what users run), eager as a second row. Paired (benchmarks/_p1.py): ours and raw alive at
      once, each in a child process taking about 0.4 of the GPU (raw at mem_fraction_static 0.4 of the free
      memory, ours at the fraction of what is then free that takes as much), sampled in turn on the same
      prompts, 12 rounds after 2 warm-up ones; the median of the per-round ratios, each side's median and
      spread. Target (graphs): ours / raw >= 0.995. ``--p1-only``: this alone (graphs, ~150 s at 7B;
      ``--p1-modes graphs,eager`` adds the eager row, ~90 s more; ``control`` a row of raw started second
      against raw, ~150 s: what the start order and the GPU's halves give the second engine, nothing of ours).
  P2  load_weights of all 339 tensors from trainer-held CUDA tensors, per variant (VARIANTS: handles at 1 GiB
      and 512 MiB per call, flattened 512 and 256 MiB buckets, handles in one call for comparison with raw,
      per-parameter as LightRFT): wall time of the call (it returns once SGLang has read the tensors), the
      time until a 1-token generate sees them (call + generate - the generate alone), each checked by
      loading a zeroed final norm and reading uniform logprobs; and a profile of the default (our side vs
      SGLang's round trips). Extra GPU memory: peak of this process's caching allocator over the load. The
      raw engine's one-call and per-parameter ``update_weights_from_tensor`` beside them. Targets (the
      default, handles at 1 GiB): <= 0.10 s, >= 9x faster than per-parameter, <= 1 GiB extra.
  P3  sleep: share of the engine's memory (free memory before it started minus free memory awake; the
      process's cuBLAS warm-up, which any trainer has done, counted apart) that level 1 (weights kept on the
      GPU) and level 2 give back, what each process keeps (NVML), wake times; raw SGLang's release of every
      tag beside it. RL cycle: sleep(2) + wake(weights) + load_weights + wake(kv_cache), median of 3 after a
      warm-up. Targets: level 2 >= 99.5% (issue 41); cycle <= 0.5 s. What level 2 leaves is split per
      process (NVML, each PID named: this trainer process, SGLang's scheduler) and, in the scheduler, into
      torch's blocks outside the memory saver (live, cached) and the rest, beside the floor of any CUDA
      process (a child that only creates its context, then also loads cuBLAS, read by NVML): what no release
      can return short of ending the process. Per tag: SGLang's release of kv_cache, weights, cuda_graph one
      at a time, each tag's GiB (ours and raw), then the share a release of everything could reach at best.
      ``--p3-mem-util F`` (repeatable) also measures the level-2 share with the engine at fraction F.

Prints a table and ``BENCH_SGLANG_RESULT {json}``; ``--json`` writes the same JSON to a file. ``--strict``
exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import _p1
from _bench_7b import (  # this folder is on sys.path when the script runs
    CFG,
    CONTEXT,
    GIB,
    MEM_UTIL,
    NEW_TOKENS,
    free_bytes,
    make_model_dir,
    prompts,
    staged_sleep_wake,
    timed,
    trainer_state,
    warm_trainer_process,
)

for _key, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)


OPTIONS: dict[str, Any] = {
    "load_format": "dummy",
    "disable_cuda_graph": True,
    "disable_radix_cache": True,
    "context_length": CONTEXT,
    "log_level": "warning",
}
MIB = 1 << 20
VARIANTS: list[tuple[str, str, int | None]] = [  # (label, weight_sync_mode, bucket_bytes; None: the mode's default)
    ("handles", "handles", None),
    ("handles_512MiB", "handles", 512 * MIB),
    ("flattened", "flattened", None),
    ("flattened_256MiB", "flattened", 256 * MIB),
    ("handles_one_call", "handles", 1 << 40),  # beyond the 1 GiB bound: only to compare with raw's one call
    ("per_param", "per_param", None),
]
DEFAULT_VARIANT = "handles"
TARGETS = {
    "p1_ratio": 0.995,
    "p2_seconds": 0.10,
    "p2_speedup": 9.0,
    "p2_extra_gib": 1.0,
    "p3_share": 0.995,
    "cycle_seconds": 0.5,
}
T0 = time.time()


def log(msg: str) -> None:
    print(f"[bench-sglang {time.time() - T0:7.1f}s] {msg}", flush=True)


def engine_config(model: str, mem_util: float = MEM_UTIL, options: dict[str, Any] | None = None) -> Any:
    from genengine.config import EngineConfig

    return EngineConfig(backend="sglang", model=model, mem_util=mem_util, options=dict(options or OPTIONS))


# ---- P1: ours and raw alive at once, one child each (benchmarks/_p1.py) -----------------------------------------
def p1_child(model: str, side: str, graphs: bool, mem_util: float, result_fd: int) -> None:
    def start() -> _p1.Started:
        config = engine_config(model, mem_util, {**OPTIONS, "disable_cuda_graph": not graphs})
        warm_trainer_process()
        t = time.perf_counter()
        clock = _p1.Clock() if _p1.profiling() else None  # benchmarks/profile_p1.py
        if side == "raw":
            from genengine_sglang.raw import start_raw_engine, stop_raw_engine

            raw_engine = start_raw_engine(config)
            stop: Callable[[], Any] = lambda: stop_raw_engine(raw_engine)  # noqa: E731

            def params_for(new: int) -> Any:
                return {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}

            def run(seed: int, params: Any) -> int:
                outs = raw_engine.generate(input_ids=prompts(seed), sampling_params=params)
                return sum(int(o["meta_info"]["completion_tokens"]) for o in outs)

        else:
            from genengine.protocol import SamplingParams
            from genengine_sglang.lightrft import RLGenerationEngine

            engine = RLGenerationEngine.from_config(config)
            stop = engine.shutdown
            if clock is not None:  # SGLang's own generate path inside ours (the rest is ours)
                clock.wrap(engine, "_call_sglang", "sglang_generate")

            def params_for(new: int) -> Any:
                return SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)

            def run(seed: int, params: Any) -> int:
                results = engine.generate(prompt_token_ids=prompts(seed), sampling_params=params)
                return sum(len(r.outputs[0].token_ids) for r in results)

        by_length = {NEW_TOKENS: params_for(NEW_TOKENS)}

        def sample(seed: int, new: int = NEW_TOKENS) -> Any:
            params = by_length.get(new) or by_length.setdefault(new, params_for(new))
            return _p1.timed_sample(clock, lambda: run(seed, params))

        # The scheduler runs in processes of its own: stopped before this one ends, or it holds its memory.
        return sample, {"start_s": round(time.perf_counter() - t, 1), "mem_util": mem_util}, stop

    _p1.serve_child(result_fd, start)


def ours_mem_util(took: int, free: int) -> float:
    """P1's fraction for ours: mem_fraction_static is a share of the memory free when the engine starts
    (SGLang keeps the rest free), so ours takes what raw took at raw's take over what is free now."""
    return min(0.95, took / free)


def p1(model: str, modes: list[str], samples: int) -> dict[str, Any]:
    return {
        mode: _p1.measure_mode(
            mode,
            __file__,
            model,
            ours_mem_util=ours_mem_util,
            free_bytes=free_bytes,
            log=log,
            samples=samples,
        )
        for mode in modes
    }


def sleep_share_at(model: str, mem_util: float) -> dict[str, Any]:
    """P3's share with the engine at another memory fraction: what SGLang keeps after a release is about
    fixed (its scheduler's context and buffers), so the share depends on the pool it is compared with."""
    from support.gpu_checks import gpu_memory_by_process

    from genengine_sglang.lightrft import RLGenerationEngine

    free0 = free_bytes()
    engine = RLGenerationEngine.from_config(engine_config(model, mem_util))
    try:
        awake = free_bytes()
        engine.sleep(2)
        freed = free_bytes() - awake
        kept = gpu_memory_by_process()
    finally:
        engine.shutdown()
    held = free0 - awake
    return {
        "mem_util": mem_util,
        "engine_gib": round(held / GIB, 2),
        "freed_gib": round(freed / GIB, 2),
        "share": round(freed / held, 4),
        "left_per_process_gib": kept,
    }


# ---- the raw engine (child process) ---------------------------------------------------------------------------
def raw_main(model: str, out: str) -> None:
    from genengine_sglang.raw import start_raw_engine, stop_raw_engine

    result: dict[str, Any] = {}
    try:
        import sglang

        result["sglang"] = sglang.__version__
        warm_trainer_process()
        free0 = free_bytes()
        engine = start_raw_engine(engine_config(model))
        held = free0 - free_bytes()
        result["engine_gib"] = round(held / GIB, 2)
        one = {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True}
        # P3 before P2: the per-parameter loads leave blocks in the scheduler's cache that a release then
        # returns too, which would count memory the engine did not hold at start as freed (session 4: 100.33 %).
        from support.gpu_checks import gpu_memory_by_process

        awake = free_bytes()
        engine.release_memory_occupation()  # every tag, as our sleep(2)
        released = free_bytes()
        result["p3_release_all_share"] = round((released - awake) / held, 4)
        result["p3_left_gib"] = round((free0 - released) / GIB, 3)
        result["p3_left_per_process_gib"] = gpu_memory_by_process()
        log(
            f"raw P3: release_memory_occupation() frees {result['p3_release_all_share']:.2%}, "
            f"{result['p3_left_gib']} GiB left of the engine's (per process: {result['p3_left_per_process_gib']})"
        )
        engine.resume_memory_occupation()
        try:
            result["p3_release_by_tag"] = release_by_tag(engine, held, lambda: time.sleep(0.5))
            log(f"raw P3 release by tag: {result['p3_release_by_tag']}")
        except Exception as exc:  # a reading: P2 still runs
            result["p3_release_by_tag_error"] = f"{type(exc).__name__}: {exc}"
        items = trainer_state()
        barrier_s = statistics.median(timed(lambda: engine.generate(input_ids=[[1, 2, 3, 4]], sampling_params=one)))

        def then_barrier(fn: Callable[[], Any]) -> Callable[[], None]:
            def run() -> None:
                fn()
                engine.generate(input_ids=[[1, 2, 3, 4]], sampling_params=one)

            return run

        one_call = timed(then_barrier(lambda: engine.update_weights_from_tensor(list(items), flush_cache=False)))
        per_param = timed(
            then_barrier(lambda: [engine.update_weights_from_tensor([it], flush_cache=False) for it in items]),
            reps=1,
        )
        result["p2"] = {
            "barrier_s": round(barrier_s, 4),
            "one_call_visible_s": round(statistics.median(one_call) - barrier_s, 4),
            "per_param_visible_s": round(statistics.median(per_param) - barrier_s, 4),
        }
        log(f"raw P2: {result['p2']}")
        items.clear()
        stop_raw_engine(engine)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-3000:]
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    sys.stdout.flush()
    os._exit(0)


def run_raw(model: str) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        path = fh.name
    cmd = [sys.executable, os.path.abspath(__file__), "--model", model, "--raw-child", path]
    proc = subprocess.run(cmd, timeout=900, check=False)
    try:
        with open(path, encoding="utf-8") as fh:
            data: dict[str, Any] = json.load(fh)
    except (OSError, ValueError):
        data = {"error": f"raw child exited {proc.returncode} without a result"}
    return data


# ---- P3: who keeps what after a release ------------------------------------------------------------------------
_FLOOR_CHILD = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import torch
from support.gpu_checks import gpu_memory_by_process
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
context = gpu_memory_by_process().get(os.getpid())
a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
(a @ a).float().sum().item()
torch.nn.functional.linear(a, a).sum().item()
torch.cuda.synchronize()
blas = gpu_memory_by_process().get(os.getpid())
print("FLOOR " + json.dumps({"cuda_context_gib": context, "with_cublas_gib": blas,
                             "torch_reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 3)}))
"""


def cuda_process_floor() -> dict[str, Any]:
    """NVML's charge for a process that only created its CUDA context, then also ran bf16 matmuls (cuBLAS
    loaded): what every process on the GPU keeps until it ends, whatever it releases."""
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    try:
        out = subprocess.run(
            [sys.executable, "-c", _FLOOR_CHILD, tests], capture_output=True, text=True, timeout=120, check=False
        ).stdout
        line = next(x for x in out.splitlines() if x.startswith("FLOOR "))
        return json.loads(line[len("FLOOR ") :])  # type: ignore[no-any-return]
    except Exception as exc:  # a reading, never a failure of the bench
        return {"error": f"{type(exc).__name__}: {exc}"}


def release_by_tag(sgl: Any, held: int, settle: Callable[[], None]) -> dict[str, Any]:
    """SGLang's own ``release_memory_occupation`` one tag at a time (kv_cache, weights, cuda_graph): the GiB each
    tag frees, their sum as a share of the engine's memory, and what each process keeps once all are released;
    then every tag is resumed. The weights' contents are gone (no CPU backup): the caller loads them again."""
    from support.gpu_checks import gpu_memory_by_process

    out: dict[str, Any] = {}
    start = free_bytes()
    for tag in ("kv_cache", "weights", "cuda_graph"):
        before = free_bytes()
        sgl.release_memory_occupation(tags=[tag])
        settle()
        out[tag + "_gib"] = round((free_bytes() - before) / GIB, 3)
    out["all_tags_share"] = round((free_bytes() - start) / held, 4)
    out["left_per_process_gib"] = gpu_memory_by_process()
    sgl.resume_memory_occupation()
    return out


def who_keeps_what(
    held: int,
    freed: int,
    per_process: dict[int, float],
    scheduler: dict[str, Any],
    scheduler_pid: int | None,
    trainer_before_gib: float | None,
    floor: dict[str, Any],
) -> dict[str, Any]:
    """What a sleep left of the engine's memory, per process and, in the scheduler, per kind, with the floor
    no release can go below (a CUDA process's context and cuBLAS) and the share that floor allows."""
    left = (held - freed) / GIB
    me = per_process.get(os.getpid())
    sched = per_process.get(scheduler_pid) if scheduler_pid is not None else None
    torch_outside = scheduler.get("default_pool_reserved_gib", 0.0) + scheduler.get("other_pools_reserved_gib", 0.0)
    ctx = floor.get("with_cublas_gib") or floor.get("cuda_context_gib")
    out: dict[str, Any] = {
        "left_gib": round(left, 3),
        "trainer_process_gib": me,
        "trainer_process_extra_gib": round(me - trainer_before_gib, 3)
        if me is not None and trainer_before_gib
        else None,
        "scheduler_pid": scheduler_pid,
        "scheduler_gib": sched,
        "scheduler_torch_outside_saver_gib": round(torch_outside, 3),
        "scheduler_torch_live_gib": scheduler.get("default_pool_allocated_gib"),
        "scheduler_not_torch_gib": round(sched - torch_outside, 3) if sched is not None else None,
        "cuda_process_floor_gib": ctx,
    }
    if sched is not None and ctx:
        out["scheduler_beyond_floor_gib"] = round(sched - ctx, 3)
        out["best_share_keeping_only_the_floor"] = round(1 - ctx / (held / GIB), 4)
    return out


# ---- ours (this process) ----------------------------------------------------------------------------------------
def ours(model: str, variants: list[tuple[str, str, int | None]], report: dict[str, Any]) -> None:
    import torch
    from support.gpu_checks import gpu_memory_by_process

    from genengine.protocol import SamplingParams
    from genengine_sglang import _weightsync
    from genengine_sglang._scheduler_hooks import MEMORY_REPORT_ENV
    from genengine_sglang.lightrft import RLGenerationEngine

    free_cold = free_bytes()
    warm_trainer_process()
    free0 = free_bytes()
    trainer_before_gib = gpu_memory_by_process().get(os.getpid())
    trainer_reserved_before = torch.cuda.memory_reserved()
    # The scheduler appends what it holds to this file at each barrier (read below, awake and asleep).
    memory_file = os.path.join(tempfile.mkdtemp(prefix="genengine-bench-"), "scheduler-memory.jsonl")
    os.environ[MEMORY_REPORT_ENV] = memory_file
    t = time.perf_counter()
    engine = RLGenerationEngine.from_config(engine_config(model))
    os.environ.pop(MEMORY_REPORT_ENV)

    def scheduler_memory() -> dict[str, Any]:
        _weightsync.barrier(engine.sglang_engine, 1, flush=False)
        with open(memory_file, encoding="utf-8") as fh:
            last = json.loads(fh.readlines()[-1])
        return {
            "pid": last.get("pid"),
            "default_pool_reserved_gib": round(last["pools"].get("default", {}).get("reserved", 0) / GIB, 3),
            "default_pool_allocated_gib": round(last["pools"].get("default", {}).get("allocated", 0) / GIB, 3),
            "other_pools_reserved_gib": round(last["pools"].get("other", {}).get("reserved", 0) / GIB, 3),
            "largest_default_blocks_mib": [round(b / MIB, 1) for b in last["default_pool_blocks"][:12]],
        }

    def asleep_reading() -> dict[str, Any]:
        return {
            "per_process_gib": gpu_memory_by_process(),
            "scheduler": scheduler_memory(),
            "trainer_torch_growth_gib": round((torch.cuda.memory_reserved() - trainer_reserved_before) / GIB, 3),
        }

    report["start_s"] = round(time.perf_counter() - t, 1)
    awake = free_bytes()
    held = free0 - awake
    held_cold = free_cold - awake  # as if the trainer's own libraries were the engine's
    report["engine_gib"] = round(held / GIB, 2)
    report["scheduler_memory_awake"] = scheduler_memory()
    report["trainer_warmup_gib"] = round((free_cold - free0) / GIB, 3)
    log(
        f"ours started in {report['start_s']} s, holds {held / GIB:.2f} GiB "
        f"(the trainer's warm-up took {report['trainer_warmup_gib']} GiB)"
    )
    one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True, logprobs=True)

    items = trainer_state()
    nbytes = sum(t.numel() * t.element_size() for _, t in items)
    report["trainer"] = {"tensors": len(items), "gb": round(nbytes / 1e9, 2)}

    def barrier() -> Any:
        return engine.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=one)

    engine.flush_cache()
    barrier_s = statistics.median(timed(barrier))
    zeroed = [(n, torch.zeros_like(t) if n == "model.norm.weight" else t) for n, t in items]
    uniform = -math.log(CFG["vocab_size"])
    p2: dict[str, Any] = {"barrier_s": round(barrier_s, 4)}
    for label, mode, bucket in variants:
        engine.weight_sync_mode = mode
        engine.load_weights(zeroed, bucket_bytes=bucket)  # also the warm-up
        lp = barrier()[0].outputs[0].logprobs[0]
        seen = abs(lp - uniform) < 1e-2
        engine.load_weights(items, bucket_bytes=bucket)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loads, visible = [], []
        reps = 1 if mode == "per_param" else 5
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            report_ = engine.load_weights(items, bucket_bytes=bucket)
            loads.append(time.perf_counter() - t)
            barrier()
            visible.append(time.perf_counter() - t - barrier_s)
        extra = (torch.cuda.max_memory_allocated() - base) / GIB
        p2[label] = {
            "mode": mode,
            "bucket_mib": None if bucket is None else bucket >> 20,
            "load_s": round(statistics.median(loads), 4),
            "until_visible_s": round(max(statistics.median(visible), statistics.median(loads)), 4),
            "gbps": round(nbytes / statistics.median(loads) / 1e9, 1),
            "buckets": report_.num_buckets,
            "extra_gib": round(extra, 3),
            "new_weights_seen": seen,
        }
        log(f"ours P2 {label}: {p2[label]}")
    engine.weight_sync_mode = "handles"
    if "per_param" in p2:
        for label in p2:
            if isinstance(p2[label], dict) and label != "per_param":
                p2[label]["speedup_vs_per_param"] = round(p2["per_param"]["load_s"] / p2[label]["load_s"], 2)
    p2["profile_handles"] = profile_handles(engine, items, _weightsync)
    log(f"ours P2 handles profile: {p2['profile_handles']}")
    report["p2"] = p2

    p3: dict[str, Any] = {}
    for level in (1, 2):
        reading = staged_sleep_wake(engine, level, items, asleep_reading)
        p3[f"level{level}"] = {
            "freed_gib": round(reading["freed"] / GIB, 2),
            "share": round(reading["freed"] / held, 4),
            "share_incl_trainer_warmup": round(reading["freed"] / held_cold, 4),
            "left_per_process_gib": reading["asleep"]["per_process_gib"],
            "scheduler_memory": reading["asleep"]["scheduler"],
            "trainer_torch_growth_gib": reading["asleep"]["trainer_torch_growth_gib"],
            "sleep_s": round(reading["sleep_s"], 3),
            "wake_weights_s": round(reading["wake_weights_s"], 3),
            "wake_kv_s": round(reading["wake_kv_s"], 3),
        }
        log(f"ours P3 level {level}: {p3[f'level{level}']}")

    def cycle() -> None:
        engine.sleep(2)
        engine.wake(["weights"])
        engine.load_weights(items)
        engine.wake(["kv_cache"])

    cycles = timed(cycle)
    p3["cycle_s"] = round(statistics.median(cycles), 3)
    p3["cycle_all_s"] = [round(c, 3) for c in cycles]
    p3["after_cycle_ok"] = len(barrier()[0].outputs[0].token_ids) == 1
    report["p3"] = p3
    log(f"ours P3 cycle: {p3['cycle_s']} s")
    level2 = p3["level2"]
    trainer_growth = level2["trainer_torch_growth_gib"]  # the trainer's own tensors since the engine started
    p3["level2_who_keeps_what"] = who_keeps_what(
        held,
        round(level2["freed_gib"] * GIB),
        level2["left_per_process_gib"],
        level2["scheduler_memory"],
        level2["scheduler_memory"].get("pid"),
        None if trainer_before_gib is None else trainer_before_gib + trainer_growth,
        cuda_process_floor(),
    )
    log(f"ours P3 level 2, who keeps what: {p3['level2_who_keeps_what']}")
    try:
        p3["release_by_tag"] = release_by_tag(engine.sglang_engine, held, engine._settle_memory)
        engine.load_weights(items)  # the weights tag came back without its contents
        p3["after_release_by_tag_ok"] = len(barrier()[0].outputs[0].token_ids) == 1
        log(f"ours P3 release by tag: {p3['release_by_tag']}")
    except Exception as exc:  # a reading: the figures above stand
        p3["release_by_tag_error"] = f"{type(exc).__name__}: {exc}"
    items.clear()
    zeroed.clear()
    gc.collect()
    engine.shutdown()


def profile_handles(engine: Any, items: list[tuple[str, Any]], ws: Any) -> dict[str, Any]:
    """Where a default ``handles`` load spends its time: our side (materialise, synchronise, pickle the
    handles) against SGLang's round trip (tokenizer manager → scheduler: unpickle, open the IPC handles,
    load, reply). Wraps the two module functions for three loads; the rest is validation and bookkeeping."""
    spent = {"payload_s": 0.0, "sglang_call_s": 0.0}
    calls = {"payload": 0, "sglang_call": 0}
    originals = (ws.producer_payload, ws._send_per_rank)

    def wrap(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key + "_s"] += time.perf_counter() - t
                calls[key] += 1

        return run

    ws.producer_payload, ws._send_per_rank = wrap(originals[0], "payload"), wrap(originals[1], "sglang_call")
    try:
        total = sum(timed(lambda: engine.load_weights(items), reps=3, warmup=0))
    finally:
        ws.producer_payload, ws._send_per_rank = originals
    return {
        "per_load_s": round(total / 3, 4),
        **{k: round(v / 3, 4) for k, v in spent.items()},
        "calls_per_load": {k: v // 3 for k, v in calls.items()},
    }


# ---- report -----------------------------------------------------------------------------------------------------
def verdicts(r: dict[str, Any]) -> dict[str, bool | None]:
    p1_ratio = _p1.ratio(r.get("p1") or {})
    p2, p3 = r.get("p2") or {}, r.get("p3") or {}
    default = p2.get(DEFAULT_VARIANT) or {}
    measured = [v for k, v in p2.items() if isinstance(v, dict) and "extra_gib" in v]
    return {
        "p1_ratio": None if p1_ratio is None else p1_ratio >= TARGETS["p1_ratio"],
        "p2_seconds": None if not default else default["until_visible_s"] <= TARGETS["p2_seconds"],
        "p2_speedup": None
        if "speedup_vs_per_param" not in default
        else default["speedup_vs_per_param"] >= TARGETS["p2_speedup"],
        "p2_extra_gib": None if not default else default["extra_gib"] <= TARGETS["p2_extra_gib"],
        "p2_weights_seen": None if not measured else all(v["new_weights_seen"] for v in measured),
        "p3_share": None if "level2" not in p3 else p3["level2"]["share"] >= TARGETS["p3_share"],
        "cycle_seconds": None if "cycle_s" not in p3 else p3["cycle_s"] <= TARGETS["cycle_seconds"],
    }


def table(r: dict[str, Any]) -> str:
    rows: list[tuple[str, str, str]] = []
    raw = r.get("raw") or {}
    p2, p3 = r.get("p2") or {}, r.get("p3") or {}
    for mode, row in (r.get("p1") or {}).items():
        ours_cell, raw_cell, ratio_cell = _p1.cells(row)
        pair_label, ratio_label = _p1.labels(mode)
        rows.append((pair_label, ours_cell, raw_cell))
        rows.append((ratio_label, ratio_cell, ""))
    for label, m in p2.items():
        if isinstance(m, dict) and "load_s" in m:
            rows.append(
                (
                    f"P2 {label}{' (default)' if label == DEFAULT_VARIANT else ''}",
                    f"{m['load_s']} s call, {m['until_visible_s']} s visible, {m['gbps']} GB/s, "
                    f"{m['buckets']} buckets, +{m['extra_gib']} GiB, x{m.get('speedup_vs_per_param', '-')} "
                    f"vs per-param, seen={m['new_weights_seen']}",
                    "",
                )
            )
    if "p3_release_all_share" in raw:
        left = ""
        if "p3_left_gib" in raw:
            left = f", {raw['p3_left_gib']} GiB left, NVML {raw.get('p3_left_per_process_gib')}"
        rows.append(("P3 raw release_memory_occupation()", "", f"frees {raw['p3_release_all_share']:.2%}{left}"))
    rp2 = raw.get("p2") or {}
    if rp2:
        rows.append(
            ("P2 raw one call / per-param", "", f"{rp2['one_call_visible_s']} s / {rp2['per_param_visible_s']} s")
        )
    for level in (1, 2):
        m = p3.get(f"level{level}")
        if m:
            rows.append(
                (
                    f"P3 sleep({level})",
                    f"frees {m['freed_gib']} GiB = {m['share']:.2%}; sleep {m['sleep_s']} s, wake weights "
                    f"{m['wake_weights_s']} s, wake kv {m['wake_kv_s']} s",
                    "",
                )
            )
            kept = m.get("scheduler_memory")
            if kept:
                rows.append(
                    (
                        f"P3 sleep({level}) scheduler keeps",
                        f"{kept['default_pool_allocated_gib']} GiB live in torch's default pool (largest MiB: "
                        f"{kept['largest_default_blocks_mib'][:6]}); NVML: {m['left_per_process_gib']}",
                        "",
                    )
                )
    w = p3.get("level2_who_keeps_what")
    if w:
        rows.append(
            (
                "P3 sleep(2) leaves, per process",
                f"{w['left_gib']} GiB: trainer process +{w['trainer_process_extra_gib']} GiB; scheduler (pid "
                f"{w['scheduler_pid']}) {w['scheduler_gib']} GiB = torch outside the saver "
                f"{w['scheduler_torch_outside_saver_gib']} (live {w['scheduler_torch_live_gib']}) + not torch "
                f"{w['scheduler_not_torch_gib']}; a bare CUDA process (context + cuBLAS) {w['cuda_process_floor_gib']}"
                f" GiB: best share keeping only that {w.get('best_share_keeping_only_the_floor')}",
                "",
            )
        )
    for key, side in (("release_by_tag", p3), ("p3_release_by_tag", raw)):
        t = side.get(key)
        if t:
            text = (
                f"kv_cache {t['kv_cache_gib']}, weights {t['weights_gib']}, cuda_graph {t['cuda_graph_gib']} GiB: "
                f"{t['all_tags_share']:.2%}; NVML after {t['left_per_process_gib']}"
            )
            rows.append(("P3 SGLang release one tag at a time", *((text, "") if side is p3 else ("", text))))
    if "cycle_s" in p3:
        rows.append(("P3 RL cycle", f"{p3['cycle_s']} s (sleep 2, wake weights, load, wake kv)", ""))
    for other in r.get("p3_other_mem_util", []):
        rows.append(
            (
                f"P3 sleep(2) at mem_util {other['mem_util']}",
                f"frees {other['freed_gib']} of {other['engine_gib']} GiB = {other['share']:.2%}",
                "",
            )
        )
    widths = [max(len(x[i]) for x in [("what", "genengine", "raw sglang"), *rows]) for i in range(3)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(("what", "genengine", "raw sglang"), widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append(
        "targets: "
        + ", ".join(f"{k} {'ok' if v else 'MISSED' if v is False else 'n/a'}" for k, v in verdicts(r).items())
    )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(tempfile.gettempdir(), "genengine-qwen2-7b-shape-sglang"))
    ap.add_argument("--json", default=None, help="write the result JSON here")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--skip-raw", action="store_true", help="measure ours only")
    ap.add_argument(
        "--variants", default=",".join(v[0] for v in VARIANTS), help="weight-sync variants to measure (comma-separated)"
    )
    ap.add_argument(
        "--p3-mem-util",
        type=float,
        action="append",
        default=[],
        help="also measure the sleep(2) share with the engine at this memory fraction (repeatable)",
    )
    ap.add_argument("--p1-only", action="store_true", help="measure P1 alone (default mode: graphs, ~150 s)")
    ap.add_argument(
        "--p1-modes",
        type=_p1.modes,
        default=None,
        help="P1 rows, comma-separated from graphs,eager,control (raw against raw: the start order's share); "
        "'' for none (default: graphs,eager; --p1-only: graphs)",
    )
    ap.add_argument("--p1-samples", type=_p1.samples, default=_p1.P1_SAMPLES, help="paired rounds per P1 row")
    ap.add_argument("--raw-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--p1-child", choices=("ours", "raw"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--p1-graphs", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--p1-mem-util", type=float, default=_p1.P1_RAW_SHARE, help=argparse.SUPPRESS)
    ap.add_argument("--result-fd", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    make_model_dir(a.model, tokenizer=True)
    if a.raw_child:
        raw_main(a.model, a.raw_child)
        return 0
    if a.p1_child:
        p1_child(a.model, a.p1_child, bool(a.p1_graphs), a.p1_mem_util, a.result_fd)
        return 0
    p1_modes = a.p1_modes if a.p1_modes is not None else ["graphs"] if a.p1_only else ["graphs", "eager"]
    import torch

    wanted = set(a.variants.split(","))
    variants = [v for v in VARIANTS if v[0] in wanted]
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "settings": {
            **CFG,
            "mem_util": MEM_UTIL,
            **OPTIONS,
            "machine": os.environ.get("GENENGINE_SGLANG_OPTIONS"),
            "p1": f"paired, {a.p1_samples} rounds after {_p1.P1_WARMUP}, modes {p1_modes}",
        },
        "targets": TARGETS,
    }
    if p1_modes:
        log(f"P1, paired: {p1_modes}")
        report["p1"] = p1(a.model, p1_modes, a.p1_samples)
        failed_p1 = {m: row["error"] for m, row in report["p1"].items() if "error" in row}
        if failed_p1:
            report["error"] = f"P1: {failed_p1}"
    if not a.skip_raw and not a.p1_only:
        log("raw sglang.Engine, in a child process")
        report["raw"] = run_raw(a.model)
    try:
        if not a.p1_only:
            ours(a.model, variants, report)
        for mem_util in a.p3_mem_util:
            share = sleep_share_at(a.model, mem_util)
            log(f"ours P3 at mem_util={mem_util}: {share}")
            report.setdefault("p3_other_mem_util", []).append(share)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()[-3000:]
        log(report["traceback"])
    report["verdicts"] = verdicts(report)
    report["elapsed_s"] = round(time.time() - T0, 1)
    print(table(report), flush=True)
    line = json.dumps(report, default=str)
    print("BENCH_SGLANG_RESULT " + line, flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(report, indent=1, default=str))
    failed = "error" in report or (a.strict and any(v is False for v in report["verdicts"].values()))
    sys.stdout.flush()
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
