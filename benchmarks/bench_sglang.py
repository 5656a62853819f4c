"""The sglang backend at 7B scale on one GPU, with a raw ``sglang.Engine`` measured beside it in the same run.

    PYTHONPATH=/tmp/site-proj:/tmp/site-sglang python3 benchmarks/bench_sglang.py [--json PATH] [--strict]
    (or: bash tools/gpu/run_tests.sh sglang --bench)

Model: Qwen2-7B shapes (config.json and a small tokenizer only, ``load_format="dummy"``: random bf16 weights,
15.2 GB, 339 tensors), memory fraction 0.6, no CUDA graphs, no radix cache, token-id prompts, as
shared/gpu/anchor_bench.py. Machine settings (triton attention, pytorch sampling on the H200 kit) come from
``$GENENGINE_SGLANG_OPTIONS`` and apply to both engines. The raw engine runs first, in a child process, with
exactly the server arguments genengine passes (minus its own loader and logit-filter hooks); then ours, in
this process, driven as a trainer drives it.

  P1  generate: 64 prompts x 128 random ids, 128 new tokens, greedy, ignore_eos; output tokens/s, median of
      3 after a warm-up. Target: ours / raw >= 0.99.
  P2  load_weights of all 339 tensors from trainer-held CUDA tensors, per weight-sync mode (handles,
      flattened 512 MiB buckets, per-parameter as LightRFT): wall time of the call (it returns once SGLang
      has read the tensors), and the time until a 1-token generate sees them (call + generate - the
      generate alone); checked once per mode by loading a zeroed final norm and reading uniform logprobs.
      Extra GPU memory: peak of this process's caching allocator over the load. The raw engine's one-call
      and per-parameter ``update_weights_from_tensor`` (each followed by a 1-token generate) beside them.
      Targets: handles <= 0.10 s, >= 9x faster than per-parameter, <= 1 GiB extra.
  P3  sleep: share of the engine's memory (free memory before it started minus free memory awake) that
      level 1 (weights kept on the GPU) and level 2 give back; wake times. RL cycle: sleep(2) + wake(weights)
      + load_weights + wake(kv_cache), median of 3 after a warm-up. Targets: level 2 >= 99%; cycle <= 0.5 s.

Prints a table and ``BENCH_SGLANG_RESULT {json}``; ``--json`` writes the same JSON to a file. ``--strict``
exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

for _key, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)

GIB = 1 << 30
CFG = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
}
MEM_UTIL = 0.6
CONTEXT = 2048
N_PROMPTS, PROMPT_LEN, NEW_TOKENS = 64, 128, 128
OPTIONS: dict[str, Any] = {
    "load_format": "dummy",
    "disable_cuda_graph": True,
    "disable_radix_cache": True,
    "context_length": CONTEXT,
    "log_level": "warning",
}
MODES = ("handles", "flattened", "per_param")
TARGETS = {
    "p1_ratio": 0.99,
    "p2_seconds": 0.10,
    "p2_speedup": 9.0,
    "p2_extra_gib": 1.0,
    "p3_share": 0.99,
    "cycle_seconds": 0.5,
}
T0 = time.time()


def log(msg: str) -> None:
    print(f"[bench-sglang {time.time() - T0:7.1f}s] {msg}", flush=True)


# ---- model, prompts, trainer state ----------------------------------------------------------------------------
def make_model_dir(path: str) -> str:
    """Qwen2-7B config.json plus a small BPE tokenizer (SGLang loads one); no weight files."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rnd = random.Random(0)
    words = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 8))) for _ in range(3000)]
    corpus = [" ".join(rnd.choice(words) for _ in range(20)) for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    ).save_pretrained(path)
    eos = tok.token_to_id("<|endoftext|>")
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **CFG,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=1)
    return path


def hf_param_shapes() -> list[tuple[str, tuple[int, ...]]]:
    h, inter, layers = CFG["hidden_size"], CFG["intermediate_size"], CFG["num_hidden_layers"]
    nh, nkv, vocab = CFG["num_attention_heads"], CFG["num_key_value_heads"], CFG["vocab_size"]
    hd = h // nh
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (nh * hd, h)),
            (p + "self_attn.q_proj.bias", (nh * hd,)),
            (p + "self_attn.k_proj.weight", (nkv * hd, h)),
            (p + "self_attn.k_proj.bias", (nkv * hd,)),
            (p + "self_attn.v_proj.weight", (nkv * hd, h)),
            (p + "self_attn.v_proj.bias", (nkv * hd,)),
            (p + "self_attn.o_proj.weight", (h, nh * hd)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def trainer_state() -> list[tuple[str, Any]]:
    """The trainer's weights: random bf16 CUDA tensors under the HF names (norms at 1)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    items = []
    for name, shape in hf_param_shapes():
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        items.append((name, t))
    torch.cuda.synchronize()
    return items


def prompts(seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(1, CFG["vocab_size"]) for _ in range(PROMPT_LEN)] for _ in range(N_PROMPTS)]


def free_bytes() -> int:
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0])


def timed(fn: Callable[[], Any], reps: int = 3, warmup: int = 1) -> list[float]:
    import torch

    out = []
    for i in range(warmup + reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - t)
    return out


def tokens_per_s(gen: Callable[[list[list[int]]], int]) -> dict[str, Any]:
    gen(prompts(1000))  # warm-up
    runs = []
    for i in range(3):
        t = time.perf_counter()
        n = gen(prompts(i))
        runs.append(n / (time.perf_counter() - t))
    return {"tok_per_s": round(statistics.median(runs), 1), "all": [round(x, 1) for x in runs]}


def engine_config(model: str) -> Any:
    from genengine.config import EngineConfig

    return EngineConfig(backend="sglang", model=model, mem_util=MEM_UTIL, options=dict(OPTIONS))


# ---- the raw engine (child process) ---------------------------------------------------------------------------
def raw_main(model: str, out: str) -> None:
    from genengine_sglang.raw import start_raw_engine, stop_raw_engine

    result: dict[str, Any] = {}
    try:
        import sglang

        result["sglang"] = sglang.__version__
        free0 = free_bytes()
        engine = start_raw_engine(engine_config(model))
        result["engine_gib"] = round((free0 - free_bytes()) / GIB, 2)
        greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        one = {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True}

        def gen(ps: list[list[int]]) -> int:
            outs = engine.generate(input_ids=ps, sampling_params=greedy)
            return sum(int(o["meta_info"]["completion_tokens"]) for o in outs)

        result["p1"] = tokens_per_s(gen)
        log(f"raw P1: {result['p1']['tok_per_s']} tok/s")
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


# ---- ours (this process) ----------------------------------------------------------------------------------------
def ours(model: str, modes: list[str], report: dict[str, Any]) -> None:
    import torch

    from genengine.protocol import SamplingParams
    from genengine_sglang.engine import RLGenerationEngine

    free0 = free_bytes()
    t = time.perf_counter()
    engine = RLGenerationEngine.from_config(engine_config(model))
    report["start_s"] = round(time.perf_counter() - t, 1)
    awake = free_bytes()
    held = free0 - awake
    report["engine_gib"] = round(held / GIB, 2)
    log(f"ours started in {report['start_s']} s, holds {held / GIB:.2f} GiB")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True, logprobs=True)

    def gen(ps: list[list[int]]) -> int:
        return sum(len(r.outputs[0].token_ids) for r in engine.generate(prompt_token_ids=ps, sampling_params=greedy))

    report["p1"] = tokens_per_s(gen)
    log(f"ours P1: {report['p1']['tok_per_s']} tok/s")

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
    for mode in modes:
        engine.weight_sync_mode = mode
        engine.load_weights(zeroed)  # also the warm-up
        lp = barrier()[0].outputs[0].logprobs[0]
        seen = abs(lp - uniform) < 1e-2
        engine.load_weights(items)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loads, visible = [], []
        reps = 1 if mode == "per_param" else 3
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            report_ = engine.load_weights(items)
            loads.append(time.perf_counter() - t)
            barrier()
            visible.append(time.perf_counter() - t - barrier_s)
        extra = (torch.cuda.max_memory_allocated() - base) / GIB
        p2[mode] = {
            "load_s": round(statistics.median(loads), 4),
            "until_visible_s": round(max(statistics.median(visible), statistics.median(loads)), 4),
            "gbps": round(nbytes / statistics.median(loads) / 1e9, 1),
            "buckets": report_.num_buckets,
            "extra_gib": round(extra, 3),
            "new_weights_seen": seen,
        }
        log(f"ours P2 {mode}: {p2[mode]}")
    engine.weight_sync_mode = "handles"
    if "handles" in p2 and "per_param" in p2:
        p2["speedup_vs_per_param"] = round(p2["per_param"]["load_s"] / p2["handles"]["load_s"], 1)
    report["p2"] = p2

    p3: dict[str, Any] = {}
    for level in (1, 2):
        awake = free_bytes()
        t = time.perf_counter()
        engine.sleep(level)
        sleep_s = time.perf_counter() - t
        asleep = free_bytes()
        t = time.perf_counter()
        engine.wake(["weights"])
        wake_w = time.perf_counter() - t
        if level == 2:
            engine.load_weights(items)
        t = time.perf_counter()
        engine.wake(["kv_cache"])
        wake_kv = time.perf_counter() - t
        p3[f"level{level}"] = {
            "freed_gib": round((asleep - awake) / GIB, 2),
            "share": round((asleep - awake) / held, 4),
            "sleep_s": round(sleep_s, 3),
            "wake_weights_s": round(wake_w, 3),
            "wake_kv_s": round(wake_kv, 3),
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
    items.clear()
    zeroed.clear()
    gc.collect()
    engine.shutdown()


# ---- report -----------------------------------------------------------------------------------------------------
def verdicts(r: dict[str, Any]) -> dict[str, bool | None]:
    raw = (r.get("raw") or {}).get("p1", {}).get("tok_per_s")
    ours_tps = (r.get("p1") or {}).get("tok_per_s")
    p2, p3 = r.get("p2") or {}, r.get("p3") or {}
    handles = p2.get("handles") or {}
    return {
        "p1_ratio": None if not (raw and ours_tps) else ours_tps / raw >= TARGETS["p1_ratio"],
        "p2_seconds": None if not handles else handles["until_visible_s"] <= TARGETS["p2_seconds"],
        "p2_speedup": None if "speedup_vs_per_param" not in p2 else p2["speedup_vs_per_param"] >= TARGETS["p2_speedup"],
        "p2_extra_gib": None
        if not handles
        else max(p2[m]["extra_gib"] for m in MODES if m in p2) <= TARGETS["p2_extra_gib"],
        "p2_weights_seen": None if not handles else all(p2[m]["new_weights_seen"] for m in MODES if m in p2),
        "p3_share": None if "level2" not in p3 else p3["level2"]["share"] >= TARGETS["p3_share"],
        "cycle_seconds": None if "cycle_s" not in p3 else p3["cycle_s"] <= TARGETS["cycle_seconds"],
    }


def table(r: dict[str, Any]) -> str:
    rows: list[tuple[str, str, str]] = []
    raw = r.get("raw") or {}
    p1, p2, p3 = r.get("p1") or {}, r.get("p2") or {}, r.get("p3") or {}
    if p1:
        raw_tps = (raw.get("p1") or {}).get("tok_per_s")
        ratio = f" (ours/raw {p1['tok_per_s'] / raw_tps:.3f})" if raw_tps else ""
        rows.append(("P1 generate tok/s", f"{p1['tok_per_s']}{ratio}", str(raw_tps or raw.get("error", "-"))))
    for mode in MODES:
        if mode in p2:
            m = p2[mode]
            rows.append(
                (
                    f"P2 load_weights {mode}",
                    f"{m['load_s']} s call, {m['until_visible_s']} s visible, {m['gbps']} GB/s, "
                    f"{m['buckets']} buckets, +{m['extra_gib']} GiB, seen={m['new_weights_seen']}",
                    "",
                )
            )
    rp2 = raw.get("p2") or {}
    if rp2:
        rows.append(
            ("P2 raw one call / per-param", "", f"{rp2['one_call_visible_s']} s / {rp2['per_param_visible_s']} s")
        )
    if "speedup_vs_per_param" in p2:
        rows.append(("P2 handles vs per-param", f"{p2['speedup_vs_per_param']}x", ""))
    for level in (1, 2):
        m = p3.get(f"level{level}")
        if m:
            rows.append(
                (
                    f"P3 sleep({level})",
                    f"frees {m['freed_gib']} GiB = {m['share']:.1%}; sleep {m['sleep_s']} s, wake weights "
                    f"{m['wake_weights_s']} s, wake kv {m['wake_kv_s']} s",
                    "",
                )
            )
    if "cycle_s" in p3:
        rows.append(("P3 RL cycle", f"{p3['cycle_s']} s (sleep 2, wake weights, load, wake kv)", ""))
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
    ap.add_argument("--model", default=os.path.join(tempfile.gettempdir(), "genengine-qwen2-7b-shape"))
    ap.add_argument("--json", default=None, help="write the result JSON here")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--skip-raw", action="store_true", help="measure ours only")
    ap.add_argument("--modes", default=",".join(MODES), help="weight-sync modes to measure (comma-separated)")
    ap.add_argument("--raw-child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    make_model_dir(a.model)
    if a.raw_child:
        raw_main(a.model, a.raw_child)
        return 0
    import torch

    modes = [m for m in a.modes.split(",") if m]
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "settings": {**CFG, "mem_util": MEM_UTIL, **OPTIONS, "machine": os.environ.get("GENENGINE_SGLANG_OPTIONS")},
        "targets": TARGETS,
    }
    if not a.skip_raw:
        log("raw sglang.Engine, in a child process")
        report["raw"] = run_raw(a.model)
    try:
        ours(a.model, modes, report)
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
