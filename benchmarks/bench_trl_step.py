"""One GRPO step of TRL 1.16's GRPOTrainer, split into generate / sync / sleep+wake / train: TRL's own colocate
vLLM against genengine's engines, same config.

    python3 benchmarks/bench_trl_step.py [--backend vllm|sglang] [--steps 5] [--json PATH]   # a GPU
        [--engine-option KEY=VALUE ...]   # genengine's side only, e.g. SGLang's sleep_on_idle=true
    python3 benchmarks/bench_trl_step.py --tiny                                             # a CPU (its default)

GPU config (issue 41): a Qwen2.5-1.5B-shaped policy with random bf16 weights on the GPU (config.json and a small
tokenizer only; the engines start from ``load_format="dummy"`` and get the policy's weights at the first sync),
64 completions of at most 256 tokens a step (8 prompts x ``num_generations=8``; ``per_device_train_batch_size=16``
x 4 gradient-accumulation micro-batches, one generation per step), sleep mode on (level 2 between generations,
as TRL does), ``vllm_gpu_memory_utilization=0.3``, CUDA graphs as each engine's default. One warm-up step, then
the median of ``--steps`` (>= 5).

Sides, each in a child process of its own (vLLM's sleep allocator serves one engine per process):

  trl         TRL's own ``VLLMGeneration`` (``use_vllm=True, vllm_mode="colocate"``), its ``vllm.LLM`` given
              ``load_format="dummy"``; only where vLLM is installed (the vllm run).
  genengine   ``genengine.integrations.trl.GRPOTrainer`` with ``genengine={"backend": B, ...}``, B = ``--backend``.

Where the time is hooked (instance attributes of the trainer's generator, exclusive times: a call inside another
counts once, for the inner one): ``generate`` (``vllm_generation.generate`` minus what it calls below),
``sync`` (``sync_weights``), ``sleep_wake`` (vLLM's ``llm.sleep``/``llm.wake_up``, genengine's
``engine.sleep``/``engine.wake``); the step is ``on_step_begin`` → ``on_step_end`` of a TrainerCallback and
``train`` is the rest of it (scoring, the policy's logprobs, backward, the optimizer). On a GPU every hooked call
is CUDA-synchronized on both ends, so queued work lands in the phase that issued it. Each step's row also has a
``probe``: ``train`` split (``TRAIN_SPLIT``), GC seconds, allocator retries, free GPU memory at the step's start and
the CPU seconds of the process's descendants (an engine's own processes).

Estimated seconds on one H200 (1.5B): a start of ~60 s per side (policy init, engine start with graphs), then
6 steps of ~4-6 s: ~2 min per side, ~4 min for the vllm run (two sides), ~2 min for sglang.

``--tiny`` (the default without CUDA): the tiny Qwen2 on the CPU, the embedded engine, 8 completions of 16 tokens,
2 steps after the warm-up (the figures mean nothing; it checks the hooks and the report). Prints a table and
``BENCH_TRL_STEP_RESULT {json}``; the JSON also goes to ``--json`` or ``$OUT/bench_trl_step_BACKEND.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import _bench_7b

_bench_7b.set_offline_env()

PARTS = ("generate", "sync", "sleep_wake", "train")
TRAIN_SPLIT = ("score", "loss", "backward", "optimizer")
"""``train``'s hooked pieces, in each row's probe (exclusive like the parts; ``rest`` is what none of them holds):
TRL's ``_generate_and_score_completions`` outside the engine calls, ``compute_loss``, the accelerator's
``backward``, and the optimizer step (``on_pre_optimizer_step`` → ``on_optimizer_step``)."""
CLOCKED = (*PARTS, *TRAIN_SPLIT)
"""What ``PhaseClock`` keeps seconds for (``train`` itself is the step's rest, never clocked)."""
QWEN25_15B = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
}
GPU_SHAPE = {"prompts": 8, "num_generations": 8, "max_completion_length": 256, "micro_batch": 16, "accumulation": 4}
TINY_SHAPE = {"prompts": 2, "num_generations": 4, "max_completion_length": 16, "micro_batch": 4, "accumulation": 2}
ENGINE_OPTIONS: dict[str, dict[str, Any]] = {
    "vllm": {"load_format": "dummy"},
    "sglang": {"load_format": "dummy", "log_level": "warning"},
    "transformers": {"device": "cpu"},
}


# ---- timing ------------------------------------------------------------------------------------------------------
class PhaseClock:
    """Exclusive seconds per part: a hooked call inside another hooked call is taken out of the outer one."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.spent: dict[str, float] = dict.fromkeys(CLOCKED, 0.0)
        self._stack: list[list[float]] = []  # [start, seconds of nested hooked calls]

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._sync()
            frame = [time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self._stack.pop()
                total = time.perf_counter() - frame[0]
                self.spent[part] += total - frame[1]
                if self._stack:
                    self._stack[-1][1] += total

        return timed

    def take(self) -> dict[str, float]:
        out, self.spent = self.spent, dict.fromkeys(CLOCKED, 0.0)
        return out


def hook(trainer: Any, clock: PhaseClock, side: str) -> None:
    """Wrap the generator's calls on the instances (nothing of TRL or the engines is edited)."""
    gen = trainer.vllm_generation
    gen.generate = clock.wrap("generate", gen.generate)
    gen.sync_weights = clock.wrap("sync", gen.sync_weights)
    if side == "trl":
        llm = gen.llm
        llm.sleep = clock.wrap("sleep_wake", llm.sleep)
        llm.wake_up = clock.wrap("sleep_wake", llm.wake_up)
    else:
        engine = gen.engine
        engine.sleep = clock.wrap("sleep_wake", engine.sleep)
        engine.wake = clock.wrap("sleep_wake", engine.wake)
    trainer._generate_and_score_completions = clock.wrap("score", trainer._generate_and_score_completions)
    trainer.compute_loss = clock.wrap("loss", trainer.compute_loss)
    trainer.accelerator.backward = clock.wrap("backward", trainer.accelerator.backward)


def descendants_cpu_s() -> float | None:
    """User + system CPU seconds of this process's descendants alive now (SGLang's scheduler and detokenizer
    run as children of the trainer's process); None where there is none."""
    from support import processes  # tests/support, on the path since _bench_7b

    seconds = [processes.cpu_seconds(p.pid) for p in processes.descendants(os.getpid())]
    found = [s for s in seconds if s is not None]
    return sum(found) if found else None


class StepProbe:
    """What can make one step's ``train`` slow that the parts do not show, per step: the seconds the interpreter
    spent in garbage collection, and on CUDA torch's allocator retries (a cudaMalloc that failed, the cache
    emptied, the malloc retried) and the free GPU memory when the step began. SGLang's side has shown two
    steps of 5-6 s train among steps of 1.2 s (docs/benchmarks.md, P8), which these ruled out on the H200
    (ninth session); the row also gets ``train`` split into ``TRAIN_SPLIT`` and the CPU seconds the process's
    descendants (an engine's own processes) used in the step."""

    def __init__(self, cuda: bool) -> None:
        import gc

        self.cuda = cuda
        self.gc_s = 0.0
        self._gc_start = 0.0
        self._at_begin: dict[str, float] = {}
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start:
            self.gc_s += time.perf_counter() - self._gc_start
            self._gc_start = 0.0

    def _retries(self) -> int:
        import torch

        return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))

    def begin(self) -> None:
        children = descendants_cpu_s()  # before the GC baseline: a collection the scan itself causes is no step's
        self._at_begin = {"gc_s": self.gc_s}
        if children is not None:
            self._at_begin["children_cpu_s"] = children
        if self.cuda:
            import torch

            self._at_begin["alloc_retries"] = self._retries()
            self._at_begin["free_gib_at_begin"] = torch.cuda.mem_get_info()[0] / (1 << 30)

    def end(self) -> dict[str, float]:
        row = {"gc_s": self.gc_s - self._at_begin["gc_s"]}
        children = descendants_cpu_s()
        if children is not None and "children_cpu_s" in self._at_begin:
            row["children_cpu_s"] = round(children - self._at_begin["children_cpu_s"], 2)  # a child gone: < 0
        if self.cuda:
            row["alloc_retries"] = self._retries() - self._at_begin["alloc_retries"]
            row["free_gib_at_begin"] = round(self._at_begin["free_gib_at_begin"], 2)
        return row


def step_rows(clock: PhaseClock, probe: StepProbe | None = None) -> tuple[Any, list[dict[str, Any]]]:
    """A TrainerCallback that closes one row per optimizer step: the hooked parts and ``train`` (the rest), and
    under ``probe`` what it saw in the step."""
    from transformers import TrainerCallback

    rows: list[dict[str, Any]] = []

    class Steps(TrainerCallback):  # type: ignore[misc]
        begin = 0.0
        optimizer_start = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock._sync()
            clock.take()  # what ran between steps (logging, the dataloader) is no step's
            if probe is not None:
                probe.begin()
            self.begin = time.perf_counter()

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock._sync()
            self.optimizer_start = time.perf_counter()

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock._sync()
            clock.spent["optimizer"] += time.perf_counter() - self.optimizer_start

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock._sync()
            total = time.perf_counter() - self.begin
            spent = clock.take()
            parts = {p: spent[p] for p in PARTS if p != "train"}
            parts["train"] = max(total - sum(parts.values()), 0.0)
            split = {p: spent[p] for p in TRAIN_SPLIT}
            split["rest"] = parts["train"] - sum(split.values())
            row: dict[str, Any] = {**parts, "total": total}
            if probe is not None:
                row["probe"] = {**probe.end(), "train_split": {k: round(v, 4) for k, v in split.items()}}
            rows.append(row)

    return Steps(), rows


def summarize(rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Medians per part over the steps after ``warmup``, and every step's row."""
    timed = rows[warmup:]
    if not timed:
        raise RuntimeError(f"no step after the {warmup} warm-up step(s): {len(rows)} step(s) in all")
    return {
        "median_s": {k: statistics.median(r[k] for r in timed) for k in (*PARTS, "total")},
        "steps": len(timed),
        "rows": rows,
    }


# ---- one side (child process) ------------------------------------------------------------------------------------
def side_main(
    side: str, backend: str, model_dir: str, device: str, steps: int, warmup: int, extra: dict[str, Any]
) -> dict[str, Any]:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    from genengine.cli.demos.sync import TRL_PROMPTS

    cuda = device == "cuda"
    shape = GPU_SHAPE if cuda else TINY_SHAPE
    if cuda:
        with torch.device("cuda"):
            policy = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
        policy.config._name_or_path = model_dir  # the engines read name_or_path
    else:
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total_steps = warmup + steps
    prompts = [TRL_PROMPTS[i % len(TRL_PROMPTS)] for i in range(shape["prompts"] * total_steps)]
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-step-"),
        per_device_train_batch_size=shape["micro_batch"],
        gradient_accumulation_steps=shape["accumulation"],
        num_generations=shape["num_generations"],
        max_completion_length=shape["max_completion_length"],
        learning_rate=1e-6,
        max_steps=total_steps,
        logging_steps=1,
        report_to=[],
        seed=0,
        use_cpu=not cuda,
        bf16=cuda,
        save_strategy="no",
        disable_tqdm=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=True,
        vllm_gpu_memory_utilization=0.3,
    )

    def reward(completion_ids: list[list[int]], **_: Any) -> list[float]:  # cheap and varied: GRPO needs a spread
        return [float(len(set(c))) / max(len(c), 1) for c in completion_ids]

    common: dict[str, Any] = {
        "model": policy,
        "reward_funcs": reward,
        "args": config,
        "train_dataset": Dataset.from_dict({"prompt": prompts}),
        "processing_class": AutoTokenizer.from_pretrained(model_dir),
    }
    start = time.perf_counter()
    if side == "trl":
        import functools

        import vllm
        from trl.generation import vllm_generation

        vllm_generation.LLM = functools.partial(vllm.LLM, load_format="dummy")  # the folder holds no weights
        trainer: Any = trl.GRPOTrainer(**common)
    else:
        from genengine.integrations.trl import GRPOTrainer

        engine_config = {
            "backend": backend,
            "dtype": "bfloat16" if cuda else "float32",
            "options": {**ENGINE_OPTIONS[backend], **extra},
        }
        trainer = GRPOTrainer(**common, genengine=engine_config)
    setup_s = time.perf_counter() - start
    trainer.remove_callback(PrinterCallback)
    clock = PhaseClock(cuda)
    hook(trainer, clock, side)
    callback, rows = step_rows(clock, StepProbe(cuda))
    trainer.add_callback(callback)
    try:
        trainer.train()
    finally:
        if side != "trl":
            trainer.vllm_generation.shutdown()
    completions = shape["prompts"] * shape["num_generations"]
    return {
        "side": side,
        "backend": "vllm" if side == "trl" else backend,
        "setup_s": setup_s,
        "completions_per_step": completions,
        **summarize(rows, warmup),
    }


def run_side(
    side: str, backend: str, model_dir: str, device: str, steps: int, timeout: float, extra: dict[str, Any]
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "side.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--backend", backend]
        cmd += ["--model-dir", model_dir, "--device", device, "--steps", str(steps), "--result", result]
        if extra and side == "genengine":
            cmd += ["--engine-options-json", json.dumps(extra)]
        print(f"--- {side} side: {' '.join(cmd[2:])}", flush=True)
        try:
            code = subprocess.run(cmd, timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            return {"error": f"the {side} side did not finish within {timeout:.0f} s"}
        if code != 0 or not os.path.exists(result):
            return {"error": f"the {side} side failed (exit {code}); its traceback is in the log"}
        with open(result, encoding="utf-8") as fh:
            return json.load(fh)  # type: ignore[no-any-return]


def make_model_dir(path: str) -> str:
    """The Qwen2.5-1.5B shape: _bench_7b's folder (a small tokenizer), its config.json rewritten."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _bench_7b import make_model_dir as make_7b

    make_7b(path, tokenizer=True)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    cfg.update(QWEN25_15B)
    cfg["max_window_layers"] = QWEN25_15B["num_hidden_layers"]
    with open(cfg_path, "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=1)
    return path


def table(results: dict[str, Any]) -> str:
    head = ("side", *PARTS, "step", "vs TRL")
    lines = [head]
    trl_total = (results.get("trl") or {}).get("median_s", {}).get("total")
    for name in ("trl", "genengine"):
        row = results.get(name)
        if row is None:
            continue
        label = "TRL colocate vLLM" if name == "trl" else f"genengine {row.get('backend', results['backend'])}"
        if "median_s" not in row:
            lines.append((label, f"failed: {row.get('error', '?')}"[:120], "", "", "", "", ""))
            continue
        m = row["median_s"]
        ratio = f"{m['total'] / trl_total:.3f}" if trl_total and name != "trl" else "-"
        lines.append((label, *[f"{m[p]:.3f} s" for p in PARTS], f"{m['total']:.3f} s", ratio))
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in lines)


def engine_options(ap: argparse.ArgumentParser, pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as options; the engine checks the keys (a typo is its ConfigError, before a GPU is used)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            ap.error(f"--engine-option {pair!r}: expected KEY=VALUE, e.g. sleep_on_idle=true")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["vllm", "sglang", "transformers"], default=None)
    ap.add_argument("--tiny", action="store_true", help="the tiny model on the CPU, with the embedded engine")
    ap.add_argument("--steps", type=int, default=None, help="timed steps after one warm-up (GPU 5, --tiny 2)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--side-timeout", type=float, default=420.0, help="seconds each side's process may take")
    ap.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine option for genengine's side only (VALUE read as JSON, else a string), e.g. sleep_on_idle=true",
    )
    ap.add_argument("--engine-options-json", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=["trl", "genengine"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--device", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side is not None:
        extra = json.loads(args.engine_options_json)
        result = side_main(args.side, args.backend, args.model_dir, args.device, args.steps, 1, extra)
        with open(args.result, "w", encoding="utf-8") as fh:
            json.dump(result, fh)
        return 0

    import torch

    cuda = torch.cuda.is_available()
    backend = args.backend or ("vllm" if cuda and not args.tiny else "transformers")
    tiny = args.tiny or backend == "transformers"
    if tiny and backend != "transformers":
        ap.error(f"--tiny runs the embedded engine (backend transformers), not --backend {backend}")
    if not tiny and not cuda:
        ap.error(f"--backend {backend} runs the 1.5B shape on a CUDA GPU and there is none; --tiny runs on the CPU")
    extra = engine_options(ap, args.engine_option)
    steps = args.steps if args.steps is not None else 2 if tiny else 5
    if steps < (1 if tiny else 5):
        ap.error(f"--steps {steps}: at least 5 timed steps on a GPU (the median of them is reported)")
    out = args.json or (
        os.path.join(os.environ["OUT"], f"bench_trl_step_{backend}.json") if os.environ.get("OUT") else None
    )
    if tiny:
        from genengine.models.tiny_model import tiny_model_dir

        model_dir, device = str(tiny_model_dir()), "cpu"
    else:
        model_dir, device = make_model_dir(os.path.join(tempfile.gettempdir(), "genengine-qwen25-1.5b-shape")), "cuda"
    results: dict[str, Any] = {
        "backend": backend,
        "device": device,
        "shape": "tiny Qwen2" if tiny else "Qwen2.5-1.5B (random bf16)",
        "per_step": TINY_SHAPE if tiny else GPU_SHAPE,
        "steps": steps,
        "warmup": 1,
        **({"engine_options": extra} if extra else {}),
    }
    t0 = time.perf_counter()
    if not tiny and backend == "vllm" and importlib.util.find_spec("vllm") is not None:
        results["trl"] = run_side("trl", backend, model_dir, device, steps, args.side_timeout, {})
    else:
        results["trl_not_run"] = "TRL's colocate path needs vLLM: the vllm run measures it"
    results["genengine"] = run_side("genengine", backend, model_dir, device, steps, args.side_timeout, extra)
    results["elapsed_s"] = round(time.perf_counter() - t0, 1)
    g, t = results["genengine"].get("median_s"), (results.get("trl") or {}).get("median_s")
    if g and t:
        results["step_ratio_vs_trl"] = g["total"] / t["total"]
    print(f"GRPO step, {results['shape']} on {device}: seconds, median of {steps} after a warm-up step")
    print(table(results))
    print("BENCH_TRL_STEP_RESULT " + json.dumps(results))
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
    failed = [k for k in ("trl", "genengine") if k in results and "error" in results[k]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
