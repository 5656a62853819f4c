"""The vllm backend at 7B scale on one GPU, with a raw ``vllm.LLM`` measured beside it in the same run.

    PYTHONPATH=/tmp/site-proj:/tmp/site-vllm python3 benchmarks/bench_vllm.py [--json PATH] [--strict]
        [--p1-only] [--p1-modes graphs,eager,control] [--p1-samples 12]

Model: Qwen2-7B shapes (config.json only, ``load_format="dummy"``: random bf16 weights, 15.2 GB), memory
fraction 0.6, eager, no prefix cache, no tokenizer (token-id prompts), as shared/gpu/anchor_bench.py. The
raw engine runs first, in a child process (vLLM's sleep allocator serves one engine per process), with
exactly the ``vllm.LLM`` arguments genengine would pass; then ours in this process.

  P1  generate: 64 prompts x 128 random ids, 128 new tokens, greedy, ignore_eos; output tokens/s, CUDA
      graphs on (what users run), eager as a second row. Paired (benchmarks/_p1.py): ours and raw alive at
      once, each in a child process at 0.4 of the GPU, sampled in turn on the same prompts, 12 rounds after
      2 warm-up ones; the median of the per-round ratios, each side's median and spread. Target (graphs):
      ours / raw >= 0.995. ``--p1-only``: this alone (graphs, ~150 s at 7B; ``--p1-modes graphs,eager``
      adds the eager row, ~90 s more; ``control`` a row of raw started second against raw, ~150 s: what the
      start order and the GPU's halves give the second engine with nothing of ours in it).
  P2  load_weights of all 339 tensors from trainer-held CUDA tensors, timed until the copies are done
      (torch.cuda.synchronize: the engine is in-process, so the next generate sees them; checked once by
      loading a zeroed final norm and reading uniform logprobs). The default (512 MiB buckets, which a list
      of dense tensors on the engine's GPU fills in one call: vLLM reads them in place) vs per-parameter
      (one load per tensor, the baseline), plus 1 GiB and one-bucket variants; the raw
      engine's one-call and per-parameter ``apply_model`` beside them. Target (issue 41): the default
      <= 0.02 s with <= 1 GiB extra GPU memory (peak of the caching allocator over the load). Trace of a
      default load: vLLM's loader (our ``_apply_weights`` calls), the flush, and the rest (our checks and
      bookkeeping), beside one ``apply_model`` call timed in this process (the floor).
  P3  sleep: share of the engine's memory (free memory before it started minus free memory awake; the
      process's cuBLAS warm-up, which any trainer has done, counted apart) that level 1 and level 2 give
      back, what stays in torch's pools, wake times; raw vLLM's level-2 sleep beside it. RL cycle:
      sleep(2) + wake(weights) + load_weights + wake(kv_cache), median of 3 after a warm-up; the
      wake(kv_cache) split into torch's empty_cache, vLLM's wake_up (of it: CuMemAllocator.wake_up, each
      create_and_map with its size, the model runner's post_kv_cache_wake_up), our flush and the rest; the
      same wake once more after 1 s idle (does the driver still work on the memory the sleep released?);
      the raw engine's own cycle in its child. Targets: >= 99% at both levels; cycle <= 0.25 s.

Prints a table and ``BENCH_VLLM_RESULT {json}``; ``--json`` writes the same JSON to a file (and ``$OUT``
is used when set). ``--strict`` exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import _p1
from _bench_7b import (  # this folder is on sys.path when the script runs
    CFG,
    CONTEXT,
    GIB,
    MEM_UTIL,
    N_PROMPTS,
    NEW_TOKENS,
    PROMPT_LEN,
    free_bytes,
    make_model_dir,
    prompts,
    set_offline_env,
    staged_sleep_wake,
    timed,
    torch_memory_breakdown,
    trainer_state,
    warm_trainer_process,
)

set_offline_env()
if importlib.util.find_spec("flashinfer") is None:  # a setting of the GPU kit (flashinfer is not carried)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

OPTIONS = {
    "load_format": "dummy",
    "skip_tokenizer_init": True,
    "disable_cuda_graph": True,
    "max_model_len": CONTEXT,
    "enable_prefix_caching": False,
}
TARGETS = {"p1_ratio": 0.995, "p2_seconds": 0.02, "p2_extra_gib": 1.0, "p3_share": 0.99, "cycle_seconds": 0.25}
T0 = time.time()


def log(msg: str) -> None:
    print(f"[bench-vllm {time.time() - T0:7.1f}s] {msg}", flush=True)


def engine_config(model: str, mem_util: float = MEM_UTIL, options: dict[str, Any] | None = None) -> Any:
    from genengine.config import EngineConfig

    return EngineConfig(
        backend="vllm", model=model, mem_util=mem_util, dtype="bfloat16", seed=0, options=options or OPTIONS
    )


# ---- P1: ours and raw alive at once, one child each (benchmarks/_p1.py) -----------------------------------------
def p1_child(model: str, side: str, graphs: bool, mem_util: float, result_fd: int) -> None:
    def start() -> _p1.Started:
        config = engine_config(model, mem_util, {**OPTIONS, "disable_cuda_graph": not graphs})
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # both sides: the model lives in the child
        warm_trainer_process()
        t = time.perf_counter()
        if side == "raw":
            import vllm

            from genengine_vllm.settings import build_llm_kwargs, resolve_settings

            settings = resolve_settings(config)
            kwargs = build_llm_kwargs(settings, external_launcher=False, group_seed=settings.seed)
            llm = vllm.LLM(**kwargs)

            def params_for(new: int) -> Any:
                return vllm.SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False, seed=0)

            def run(seed: int, params: Any) -> int:
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts(seed)], params, use_tqdm=False)
                return sum(len(o.outputs[0].token_ids) for o in outs)

            info = {"llm_kwargs": {k: str(v) for k, v in kwargs.items() if k != "model"}}
        else:
            from genengine.protocol import SamplingParams
            from genengine_vllm.engine import VLLMEngine

            engine = VLLMEngine.from_config(config)
            llm = engine._llm

            def params_for(new: int) -> Any:
                return SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)

            def run(seed: int, params: Any) -> int:
                results = engine.generate(prompt_token_ids=prompts(seed), sampling_params=params)
                return sum(len(r.outputs[0].token_ids) for r in results)

            info = {}
        clock = None
        if _p1.profiling():  # the same calls timed on both sides (benchmarks/profile_p1.py)
            clock = _p1.Clock()
            clock.wrap(llm, "generate", "llm_generate")
            clock.wrap(llm.llm_engine, "step", "step")
            clock.wrap(llm.llm_engine.engine_core, "get_output", "engine_core")
            clock.wrap(llm.llm_engine.output_processor, "process_outputs", "process_outputs")
        by_length = {NEW_TOKENS: params_for(NEW_TOKENS)}

        def sample(seed: int, new: int = NEW_TOKENS) -> Any:
            params = by_length.get(new) or by_length.setdefault(new, params_for(new))
            return _p1.timed_sample(clock, lambda: run(seed, params))

        # The model lives in this process (no engine-core process): os._exit frees it all.
        return sample, {**info, "start_s": round(time.perf_counter() - t, 1), "mem_util": mem_util}, None

    _p1.serve_child(result_fd, start)


def ours_mem_util(took: int, free: int) -> float:
    """P1's fraction for ours: gpu_memory_utilization is a share of the whole GPU per instance, so ours at
    raw's share takes what raw took."""
    return _p1.P1_RAW_SHARE


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


def raw_main(model: str, out: str) -> None:
    import torch
    import vllm

    from genengine_vllm.settings import build_llm_kwargs, resolve_settings

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as ours: the model lives in this process
    settings = resolve_settings(engine_config(model))
    kwargs = build_llm_kwargs(settings, external_launcher=False, group_seed=settings.seed)
    result: dict[str, Any] = {"llm_kwargs": {k: v for k, v in kwargs.items() if k != "model"}}
    warm_trainer_process()
    free0 = free_bytes()
    start = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    result["start_s"] = time.perf_counter() - start
    held = free0 - free_bytes()
    result["engine_gib"] = held / GIB
    items = trainer_state()

    def one_call() -> None:
        llm.apply_model(lambda m: m.load_weights(iter(items)))

    def per_param() -> None:
        for name, t in items:
            llm.apply_model(lambda m, name=name, t=t: m.load_weights([(name, t)]))

    result["p2_one_call_s"] = statistics.median(timed(one_call))
    result["p2_per_param_s"] = statistics.median(timed(per_param))
    log(f"raw P2: one call {result['p2_one_call_s']:.4f} s, per param {result['p2_per_param_s']:.4f} s")
    # Raw vLLM's own RL cycle (what ours is held to), then its wake(kv_cache) traced as ours is.
    parts: dict[str, list[float]] = {}
    steps = [
        ("sleep", lambda: llm.sleep(level=2)),
        ("wake_weights", lambda: llm.wake_up(tags=["weights"])),
        ("load_weights", one_call),
        ("wake_kv_cache", lambda: llm.wake_up(tags=["kv_cache"])),
    ]
    result["p3_cycle_s"] = statistics.median(timed(lambda: rl_cycle(steps, parts)))
    result["p3_cycle_parts_s"] = {k: statistics.median(v[1:]) for k, v in parts.items()}
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    one_call()
    result["p3_wake_kv_trace"] = traced_wake_kv(llm, lambda: llm.wake_up(tags=["kv_cache"]))
    log(f"raw RL cycle: {result['p3_cycle_s']:.3f} s {json.dumps(result['p3_cycle_parts_s'])}")
    log(f"raw wake(kv_cache) traced: {json.dumps(result['p3_wake_kv_trace'])}")
    awake = free_bytes()
    llm.sleep(level=2)
    result["p3_level2_share"] = (free_bytes() - awake) / held
    result["p3_level2_left"] = torch_memory_breakdown(exclude=[t for _, t in items])
    log(f"raw P3: sleep(level=2) frees {result['p3_level2_share']:.2%}; left {result['p3_level2_left']}")
    with open(out, "w") as fh:
        json.dump(result, fh)
    sys.stdout.flush()
    items.clear()
    torch.cuda.synchronize()
    os._exit(0)  # the process ends here: no teardown to time or to fail


# ---- P2/P3 traces: where a load's and a wake's time goes (wrappers on live objects, removed after) ----------------
class _Patches:
    """Instance or module attributes replaced by timing wrappers, restored on exit."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any, bool]] = []
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def time(self, obj: Any, name: str, label: str | None = None, record: Callable[..., None] | None = None) -> None:
        label = label or name
        real = getattr(obj, name)
        self.saved.append((obj, name, real, name in getattr(obj, "__dict__", {})))

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                self.seconds[label] = self.seconds.get(label, 0.0) + dt
                self.calls[label] = self.calls.get(label, 0) + 1
                if record is not None:
                    record(dt, *args)

        setattr(obj, name, wrapper)

    def restore(self) -> None:
        for obj, name, real, own in reversed(self.saved):
            if own or isinstance(obj, type(os)):
                setattr(obj, name, real)
            else:
                delattr(obj, name)
        self.saved.clear()


def _vllm_worker(llm: Any) -> Any:
    wrapper = llm.llm_engine.model_executor.driver_worker
    return getattr(wrapper, "worker", wrapper)


def allocator_tags() -> dict[str, dict[str, float]]:
    """vLLM's sleep allocator: allocations and GiB per tag (what a wake of that tag maps again)."""
    from vllm.device_allocator.cumem import CuMemAllocator

    out: dict[str, dict[str, float]] = {}
    for data in CuMemAllocator.get_instance().pointer_to_data.values():
        row = out.setdefault(data.tag, {"allocations": 0, "gib": 0.0})
        row["allocations"] += 1
        row["gib"] = round(row["gib"] + data.handle[1] / GIB, 3)
    return out


def traced_wake_kv(llm: Any, wake: Callable[[], Any], flush_owner: Any = None) -> dict[str, Any]:
    """One ``wake(["kv_cache"])`` (``wake``), split: torch's empty_cache, vLLM's ``LLM.wake_up`` and within it
    ``CuMemAllocator.wake_up`` (each ``create_and_map``: count, GiB, slowest) and the model runner's
    ``post_kv_cache_wake_up``, our ``_flush_cache`` (``flush_owner``); the rest is ours (state, synchronize)."""
    import torch
    from vllm.device_allocator import cumem

    maps: list[tuple[float, int]] = []
    patches = _Patches()
    patches.time(torch.cuda, "empty_cache", "empty_cache")
    patches.time(llm, "wake_up", "vllm_wake_up")
    patches.time(cumem.CuMemAllocator.get_instance(), "wake_up", "allocator_wake_up")
    patches.time(cumem, "create_and_map", "create_and_map", record=lambda dt, handle: maps.append((dt, handle[1])))
    runner = getattr(_vllm_worker(llm), "model_runner", None)
    if runner is not None:
        patches.time(runner, "post_kv_cache_wake_up", "post_kv_cache_wake_up")
    if flush_owner is not None:
        patches.time(flush_owner, "_flush_cache", "our_flush")
    torch.cuda.synchronize()
    t = time.perf_counter()
    try:
        wake()
        torch.cuda.synchronize()
    finally:
        total = time.perf_counter() - t
        patches.restore()
    sec = patches.seconds
    gib = sum(size for _, size in maps) / GIB
    mapped = sum(dt for dt, _ in maps)
    return {
        "total_s": round(total, 4),
        "empty_cache_s": round(sec.get("empty_cache", 0.0), 4),
        "vllm_wake_up_s": round(sec.get("vllm_wake_up", 0.0), 4),
        "allocator_wake_up_s": round(sec.get("allocator_wake_up", 0.0), 4),
        "create_and_map": {
            "count": len(maps),
            "gib": round(gib, 2),
            "s": round(mapped, 4),
            "ms_per_gib": round(1e3 * mapped / gib, 3) if gib else None,
            "slowest_s": round(max((dt for dt, _ in maps), default=0.0), 4),
        },
        "post_kv_cache_wake_up_s": round(sec.get("post_kv_cache_wake_up", 0.0), 4),
        "our_flush_s": round(sec.get("our_flush", 0.0), 4) if flush_owner is not None else None,
        "rest_s": round(
            total - sec.get("vllm_wake_up", 0.0) - sec.get("our_flush", 0.0) - sec.get("empty_cache", 0.0), 4
        ),
    }


def traced_load(engine: Any, items: list[tuple[str, Any]]) -> dict[str, Any]:
    """One default ``load_weights`` split: vLLM's loader (our ``_apply_weights``: lock, ``apply_model``) and calls,
    the flush (``_finish_weights``), the rest (our checks, bucketing, bookkeeping)."""
    import torch

    patches = _Patches()
    patches.time(engine, "_apply_weights", "apply")
    patches.time(engine, "_finish_weights", "flush")
    torch.cuda.synchronize()
    t = time.perf_counter()
    try:
        engine.load_weights(items)
        torch.cuda.synchronize()
    finally:
        total = time.perf_counter() - t
        patches.restore()
    apply_s, flush_s = patches.seconds.get("apply", 0.0), patches.seconds.get("flush", 0.0)
    return {
        "total_s": round(total, 4),
        "vllm_loader_s": round(apply_s, 4),
        "apply_model_calls": patches.calls.get("apply", 0),
        "flush_s": round(flush_s, 4),
        "ours_s": round(total - apply_s - flush_s, 4),
    }


def rl_cycle(steps: list[tuple[str, Callable[[], Any]]], parts: dict[str, list[float]]) -> None:
    """One sleep → wake → load → wake, each step timed (CUDA synchronized around it) into ``parts``."""
    import torch

    for name, step in steps:
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        parts.setdefault(name, []).append(time.perf_counter() - t)


# ---- ours ----------------------------------------------------------------------------------------------------
def ours(model: str, report: dict[str, Any]) -> None:
    import torch

    from genengine.protocol import SamplingParams
    from genengine_vllm.engine import VLLMEngine

    free_cold = free_bytes()
    warm_trainer_process()
    free0 = free_bytes()
    report["trainer_warmup_gib"] = (free_cold - free0) / GIB
    start = time.perf_counter()
    engine = VLLMEngine.from_config(engine_config(model))
    report["start_s"] = time.perf_counter() - start
    try:
        probe = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        probe_prompts = prompts(7)[:4]
        free_awake = free_bytes()
        held = free0 - free_awake
        report["engine_gib"] = held / GIB

        items = trainer_state()
        report["trainer_tensors"] = len(items)
        report["trainer_gb"] = sum(t.numel() * t.element_size() for _, t in items) / 1e9

        # P2: a generate sees the loaded weights (a zeroed final norm makes every logprob -ln(vocab)).
        zeroed = [(n, torch.zeros_like(t) if n == "model.norm.weight" else t) for n, t in items]
        engine.load_weights(zeroed)
        lp = engine.generate(
            prompt_token_ids=probe_prompts[:1],
            sampling_params={"max_new_tokens": 1, "temperature": 0.0, "logprobs": True},
        )
        got = lp[0].outputs[0].logprobs or [0.0]
        report["p2_generate_sees_weights"] = abs(got[0] + math.log(CFG["vocab_size"])) < 1e-2
        del zeroed

        def load(bucket: int | None = None) -> Callable[[], Any]:
            return lambda: engine.load_weights(items, bucket_bytes=bucket)

        def extra_gib(fn: Callable[[], Any]) -> float:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - before) / GIB

        # The reference outputs are those of the trainer's weights (the dummy start-up weights are others).
        engine.load_weights(items)
        reference = [
            r.outputs[0].token_ids for r in engine.generate(prompt_token_ids=probe_prompts, sampling_params=probe)
        ]
        p2: dict[str, Any] = {}
        for label, bucket in (("bucketed_512MiB", None), ("bucketed_1GiB", GIB), ("one_bucket", 1 << 40)):
            p2[label] = {"s": statistics.median(timed(load(bucket), reps=5)), "extra_gib": extra_gib(load(bucket))}
        engine.weight_sync_mode = "per_param"
        p2["per_param"] = {"s": statistics.median(timed(load())), "extra_gib": extra_gib(load())}
        engine.weight_sync_mode = "bucketed"
        p2["until_generate_s"] = statistics.median(
            timed(
                lambda: (
                    engine.load_weights(items),
                    engine.generate(
                        prompt_token_ids=probe_prompts[:1], sampling_params={"max_new_tokens": 1, "temperature": 0.0}
                    ),
                )
            )
        )
        p2["trace_default"] = [traced_load(engine, items) for _ in range(3)][-1]
        p2["same_process_one_call_s"] = statistics.median(
            timed(lambda: engine._llm.apply_model(lambda m: m.load_weights(iter(items))), reps=5)
        )
        report["p2"] = p2
        log(f"ours P2: {json.dumps(p2)}")
        tokens_ok = [
            r.outputs[0].token_ids for r in engine.generate(prompt_token_ids=probe_prompts, sampling_params=probe)
        ]
        report["p2_outputs_unchanged"] = tokens_ok == reference

        # P3: sleep levels, then the RL cycle.
        p3: dict[str, Any] = {}
        trainer_tensors = [t for _, t in items]
        for level in (1, 2):
            reading = staged_sleep_wake(engine, level, items, lambda: torch_memory_breakdown(exclude=trainer_tensors))
            after = [
                r.outputs[0].token_ids for r in engine.generate(prompt_token_ids=probe_prompts, sampling_params=probe)
            ]
            p3[f"level{level}"] = {
                "freed_gib": reading["freed"] / GIB,
                "share": reading["freed"] / held,
                "share_incl_trainer_warmup": reading["freed"] / (free_cold - free_awake),
                "left_gib": (held - reading["freed"]) / GIB,
                "left_in_torch": reading["asleep"],
                "sleep_s": reading["sleep_s"],
                "wake_weights_s": reading["wake_weights_s"],
                "wake_kv_cache_s": reading["wake_kv_s"],
                "outputs_unchanged": after == reference,
            }
            log(f"ours P3 level {level}: {json.dumps(p3[f'level{level}'])}")
        parts: dict[str, list[float]] = {}
        steps = [
            ("sleep", lambda: engine.sleep(2)),
            ("wake_weights", lambda: engine.wake(["weights"])),
            ("load_weights", lambda: engine.load_weights(items)),
            ("wake_kv_cache", lambda: engine.wake(["kv_cache"])),
        ]
        totals = timed(lambda: rl_cycle(steps, parts))
        p3["cycle_s"] = statistics.median(totals)
        p3["cycle_parts_s"] = {k: statistics.median(v[1:]) for k, v in parts.items()}
        # The same cycle, its wake(kv_cache) traced; then once more with 1 s idle before that wake.
        engine.sleep(2)
        p3["allocator_tags_asleep"] = allocator_tags()
        engine.wake(["weights"])
        engine.load_weights(items)
        p3["wake_kv_trace"] = traced_wake_kv(engine._llm, lambda: engine.wake(["kv_cache"]), engine)
        engine.sleep(2)
        engine.wake(["weights"])
        engine.load_weights(items)
        time.sleep(1.0)
        p3["wake_kv_trace_after_1s_idle"] = traced_wake_kv(engine._llm, lambda: engine.wake(["kv_cache"]), engine)
        log(f"ours wake(kv_cache) traced: {json.dumps(p3['wake_kv_trace'])}")
        log(f"  after 1 s idle: {json.dumps(p3['wake_kv_trace_after_1s_idle'])}")
        after = [r.outputs[0].token_ids for r in engine.generate(prompt_token_ids=probe_prompts, sampling_params=probe)]
        p3["cycle_outputs_unchanged"] = after == reference
        report["p3"] = p3
        log(f"ours RL cycle: {p3['cycle_s']:.3f} s {json.dumps(p3['cycle_parts_s'])}")
        items.clear()
    finally:
        t = time.perf_counter()
        engine.shutdown()
        report["shutdown_s"] = time.perf_counter() - t
        gc.collect()
        torch.cuda.empty_cache()
        report["left_after_shutdown_gib"] = (free0 - free_bytes()) / GIB


def table(r: dict[str, Any]) -> str:
    raw, ours_ = r.get("raw", {}), r.get("ours", {})
    rows: list[tuple[str, str, str, str]] = []

    def add(name: str, value: str, raw_value: str = "", target: str = "") -> None:
        rows.append((name, value, raw_value, target))

    for mode, row in (r.get("p1") or {}).items():
        ours_cell, raw_cell, ratio_cell = _p1.cells(row)
        pair_label, ratio_label = _p1.labels(mode)
        add(pair_label, ours_cell, raw_cell)
        add(ratio_label, ratio_cell, "", f">= {TARGETS['p1_ratio']}" if mode == "graphs" else "")
    p2 = ours_.get("p2", {})
    for label in ("bucketed_512MiB", "bucketed_1GiB", "one_bucket", "per_param"):
        if label in p2:
            raw_v = {"one_bucket": raw.get("p2_one_call_s"), "per_param": raw.get("p2_per_param_s")}.get(label)
            target = f"<= {TARGETS['p2_seconds']} s, <= 1 GiB" if label == "bucketed_512MiB" else ""
            add(
                f"P2 load_weights {label}",
                f"{p2[label]['s']:.4f} s, +{p2[label]['extra_gib']:.2f} GiB",
                f"{raw_v:.4f} s" if raw_v else "",
                target,
            )
    if "until_generate_s" in p2:
        add("P2 load + 1-token generate", f"{p2['until_generate_s']:.4f} s")
    tr = p2.get("trace_default")
    if tr:
        add(
            "P2 default load: vLLM loader / flush / ours",
            f"{tr['vllm_loader_s']:.4f} ({tr['apply_model_calls']} calls) / {tr['flush_s']:.4f} / {tr['ours_s']:.4f} s",
            f"one call here {p2['same_process_one_call_s']:.4f} s" if "same_process_one_call_s" in p2 else "",
        )
    p3 = ours_.get("p3", {})
    for level in (1, 2):
        d = p3.get(f"level{level}")
        if d:
            add(
                f"P3 level {level} frees",
                f"{d['share']:.1%} ({d['freed_gib']:.1f} GiB)",
                "",
                f">= {TARGETS['p3_share']:.0%}",
            )
            add(
                f"P3 level {level} sleep / wake w / wake kv",
                f"{d['sleep_s']:.3f} / {d['wake_weights_s']:.3f} / {d['wake_kv_cache_s']:.3f} s",
            )
    if "cycle_s" in p3:
        parts, raw_parts = p3.get("cycle_parts_s", {}), raw.get("p3_cycle_parts_s", {})

        def split(d: dict[str, float]) -> str:
            keys = ("sleep", "wake_weights", "load_weights", "wake_kv_cache")
            return " / ".join(f"{d[k]:.3f}" for k in keys if k in d)

        add(
            "P3 RL cycle (sleep 2 + wake w + load + wake kv)",
            f"{p3['cycle_s']:.3f} s ({split(parts)})",
            f"{raw['p3_cycle_s']:.3f} s ({split(raw_parts)})" if "p3_cycle_s" in raw else "",
            f"<= {TARGETS['cycle_seconds']} s",
        )
    for label, ours_key, raw_key in (
        ("P3 wake kv traced", "wake_kv_trace", "p3_wake_kv_trace"),
        ("P3 wake kv after 1 s idle", "wake_kv_trace_after_1s_idle", None),
    ):
        d, rd = p3.get(ours_key), raw.get(raw_key) if raw_key else None

        def wake_row(w: dict[str, Any] | None) -> str:
            if not w:
                return ""
            m = w["create_and_map"]
            return (
                f"{w['total_s']:.3f} s: alloc {w['allocator_wake_up_s']:.3f} ({m['count']} maps, {m['gib']} GiB, "
                f"{m['ms_per_gib']} ms/GiB), vllm rest {w['vllm_wake_up_s'] - w['allocator_wake_up_s']:.3f}, "
                f"flush {w['our_flush_s'] or 0:.3f}, empty_cache {w['empty_cache_s']:.3f}, rest {w['rest_s']:.3f}"
            )

        if d or rd:
            add(label, wake_row(d), wake_row(rd))
    widths = [max(len(row[i]) for row in [("metric", "genengine", "raw vllm.LLM", "target"), *rows]) for i in range(4)]
    lines = [
        "  ".join(h.ljust(w) for h, w in zip(("metric", "genengine", "raw vllm.LLM", "target"), widths, strict=True))
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def verdicts(r: dict[str, Any]) -> dict[str, bool | None]:
    ours_ = r.get("ours", {})
    p1_ratio = _p1.ratio(r.get("p1") or {})
    p2 = ours_.get("p2", {}).get("bucketed_512MiB")
    p3 = ours_.get("p3", {})
    return {
        "p1_ratio": None if p1_ratio is None else p1_ratio >= TARGETS["p1_ratio"],
        "p2_seconds": (p2["s"] <= TARGETS["p2_seconds"]) if p2 else None,
        "p2_extra_memory": (p2["extra_gib"] <= TARGETS["p2_extra_gib"]) if p2 else None,
        "p2_generate_sees_weights": ours_.get("p2_generate_sees_weights"),
        "p3_level1": (p3["level1"]["share"] >= TARGETS["p3_share"]) if "level1" in p3 else None,
        "p3_level2": (p3["level2"]["share"] >= TARGETS["p3_share"]) if "level2" in p3 else None,
        "cycle_seconds": (p3["cycle_s"] <= TARGETS["cycle_seconds"]) if "cycle_s" in p3 else None,
        "outputs_unchanged": all(
            bool(v)
            for v in (
                ours_.get("p2_outputs_unchanged"),
                p3.get("level1", {}).get("outputs_unchanged"),
                p3.get("level2", {}).get("outputs_unchanged"),
                p3.get("cycle_outputs_unchanged"),
            )
        )
        if p3
        else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(tempfile.gettempdir(), "genengine-qwen2-7b-shape-vllm"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--raw-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--skip-raw", action="store_true", help="measure ours only (P2, P3; P1 is always paired)")
    ap.add_argument("--p1-only", action="store_true", help="measure P1 alone (default mode: graphs, ~150 s)")
    ap.add_argument(
        "--p1-modes",
        type=_p1.modes,
        default=None,
        help="P1 rows, comma-separated from graphs,eager,control (raw against raw: the start order's share); "
        "'' for none (default: graphs,eager; --p1-only: graphs)",
    )
    ap.add_argument("--p1-samples", type=_p1.samples, default=_p1.P1_SAMPLES, help="paired rounds per P1 row")
    ap.add_argument("--p1-child", choices=("ours", "raw"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--p1-graphs", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--p1-mem-util", type=float, default=_p1.P1_RAW_SHARE, help=argparse.SUPPRESS)
    ap.add_argument("--result-fd", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_child:
        raw_main(args.model, args.raw_child)
        return 0
    if args.p1_child:
        p1_child(args.model, args.p1_child, bool(args.p1_graphs), args.p1_mem_util, args.result_fd)
        return 0
    p1_modes = args.p1_modes if args.p1_modes is not None else ["graphs"] if args.p1_only else ["graphs", "eager"]
    import torch
    import vllm

    make_model_dir(args.model, tokenizer=False)
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "settings": {
            **CFG,
            "mem_util": MEM_UTIL,
            "context": CONTEXT,
            "options": OPTIONS,
            "p1": f"paired, {args.p1_samples} rounds after {_p1.P1_WARMUP}, modes {p1_modes}",
            "gen": f"{N_PROMPTS} x {PROMPT_LEN} ids, {NEW_TOKENS} new, greedy, ignore_eos",
        },
        "targets": TARGETS,
        "errors": {},
    }
    if p1_modes:
        log(f"P1, paired: {p1_modes} ...")
        report["p1"] = p1(args.model, p1_modes, args.p1_samples)
        for mode, row in report["p1"].items():
            if "error" in row:
                report["errors"][f"p1_{mode}"] = row["error"]
    if not args.skip_raw and not args.p1_only:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
            out = fh.name
        log("raw vllm.LLM in a child process ...")
        proc = subprocess.run([sys.executable, __file__, "--model", args.model, "--raw-child", out], check=False)
        try:
            with open(out) as fh:
                report["raw"] = json.load(fh)
        except (OSError, ValueError) as exc:
            report["errors"]["raw"] = f"child exited {proc.returncode}: {exc}"
    report["ours"] = {}
    if not args.p1_only:
        log("genengine's VLLMEngine in this process ...")
        try:
            ours(args.model, report["ours"])
        except Exception as exc:
            import traceback

            report["errors"]["ours"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
            log(report["errors"]["ours"])
    report["verdicts"] = verdicts(report)
    print(table(report), flush=True)
    print("verdicts: " + json.dumps(report["verdicts"]), flush=True)
    line = json.dumps(report, default=str)
    print("BENCH_VLLM_RESULT " + line, flush=True)
    paths = [args.json] if args.json else []
    if os.environ.get("OUT") and os.path.isdir(os.environ["OUT"]):
        paths.append(os.path.join(os.environ["OUT"], "bench_vllm.json"))
    for path in paths:
        with open(path, "w") as fh:
            fh.write(json.dumps(report, indent=1, default=str) + "\n")
    failed = report["errors"] or any(v is False for v in report["verdicts"].values())
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
