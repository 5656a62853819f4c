"""TRL's GRPOTrainer on any genengine backend: ``python examples/trl_grpo.py --backend sglang --model DIR --steps 3``.

The script is a plain TRL GRPO script; the one line that differs is ``genengine=...`` (the engine config, here
the project's YAML for the backend). The reward is the demo's toy reward: the share of completion tokens equal
to the token the untrained model samples most often, so it visibly rises in a few dozen steps on the tiny model.

``--backend transformers`` runs on the CPU (the embedded engine); ``sglang`` and ``vllm`` need a GPU and
``pip install 'genengine[sglang]'`` / ``'genengine[vllm]'``. Without ``--model`` a tiny random Qwen2 is built.
``--compare`` also runs TRL's own generation (``use_vllm=False``) from the same seed and ``--plot`` draws both
reward curves side by side (docs/trl.md shows that figure). The per-step numbers go to ``--json`` or, when ``$OUT``
is set (tools/gpu/verify.sh's ``trl`` part), to ``$OUT/trl_grpo_BACKEND.json``, with ``error`` if the run failed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from genengine.cli.demos.sync import TRL_PROMPTS as PROMPTS  # the demo's prompts: the same toy task

CONFIGS = Path(__file__).resolve().parent / "configs"


def engine_config(backend: str, mem_util: float | None) -> dict[str, Any]:
    """The backend's example YAML as a dict (it names no model: the engine serves the model TRL trains), without
    ``mem_util`` unless given (TRL's ``vllm_gpu_memory_utilization`` then applies, as for vLLM)."""
    config: dict[str, Any] = yaml.safe_load((CONFIGS / f"{backend}.yaml").read_text())
    config.pop("mem_util", None)
    if backend == "transformers":
        config["dtype"] = "float32"  # exact logprobs on the CPU: TRL's logprob-gap metric reads ~1e-6
    if mem_util is not None:
        config["mem_util"] = mem_util
    return config


def pick_target_token(model_dir: str, tokenizer: Any) -> int:
    """The demo's target token, picked with an embedded engine so that every backend trains towards the same one."""
    import genengine
    from genengine.cli.demos.sync import pick_target

    with genengine.create_engine(backend="transformers", model=model_dir, dtype="float32", device="cpu") as engine:
        return pick_target(engine, tokenizer, 16)[0]


def target_share(target: int) -> Any:
    from genengine.cli.demos.sync import rewards_and_advantages

    def reward(completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
        rewards, _ = rewards_and_advantages([([], list(c), []) for c in completion_ids], target, len(completion_ids))
        return [float(r) for r in rewards]

    reward.__name__ = "target_share"
    return reward


def run(args: argparse.Namespace, model_dir: str, target: int, *, use_genengine: bool) -> dict[str, Any]:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    from genengine.integrations.trl import GRPOTrainer

    on_gpu = args.backend != "transformers" and torch.cuda.is_available()
    config = trl.GRPOConfig(
        output_dir=str(Path(args.out_dir) / ("genengine" if use_genengine else "trl")),
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=16,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_steps=args.steps,
        logging_steps=1,
        report_to=[],
        seed=args.seed,
        use_cpu=not on_gpu,
        bf16=on_gpu,
        save_strategy="no",
        disable_tqdm=True,
        vllm_enable_sleep_mode=args.sleep,
        vllm_gpu_memory_utilization=0.3,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if on_gpu else torch.float32)
    common: dict[str, Any] = {
        "model": policy,
        "reward_funcs": target_share(target),
        "args": config,
        "train_dataset": Dataset.from_dict({"prompt": PROMPTS}),
        "processing_class": tokenizer,
    }
    built = time.perf_counter()  # the trainer's construction starts the engine
    if use_genengine:
        trainer: Any = GRPOTrainer(**common, genengine=engine_config(args.backend, args.mem_util))  # the one line
    else:
        trainer = trl.GRPOTrainer(**common)  # TRL's own generation, with the policy's generate()
    trainer.remove_callback(PrinterCallback)  # the per-step dicts; the summary below says what matters
    setup = time.perf_counter() - built
    start = time.perf_counter()
    try:
        trainer.train()
        load = trainer.vllm_generation.last_load if use_genengine else None
    finally:
        if use_genengine:
            trainer.vllm_generation.shutdown()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "path": f"genengine {args.backend}" if use_genengine else "TRL use_vllm=False",
        "seconds": time.perf_counter() - start,
        "setup_s": setup,
        "reward": [h["reward"] for h in logs],
        "loss": [h["loss"] for h in logs],
        "logp_gap_max": [h.get("sampling/sampling_logp_difference/max") for h in logs],
        "last_sync": None
        if load is None
        else {
            "tensors": load.num_tensors,
            "buckets": load.num_buckets,
            "bytes": load.num_bytes,
            "seconds": load.seconds,
        },
    }


def plot(runs: list[dict[str, Any]], path: str, target_text: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for r in runs:
        ax.plot(range(1, len(r["reward"]) + 1), r["reward"], marker="o", markersize=3, label=r["path"])
    ax.set_xlabel("GRPO step (TRL 1.16 GRPOTrainer)")
    ax.set_ylabel(f"share of completion tokens = {target_text!r}")
    ax.set_ylim(0, 1.02)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("Same script, same seed: genengine's engine vs TRL's own generation")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["transformers", "sglang", "vllm"], default="transformers")
    parser.add_argument("--model", help="a Hugging Face model folder (default: a tiny random Qwen2, built here)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sleep", action="store_true", help="vllm_enable_sleep_mode: a level-2 sleep between rollouts")
    parser.add_argument("--mem-util", type=float, help="the engine's share of the GPU (default: TRL's, 0.3)")
    parser.add_argument("--compare", action="store_true", help="also run TRL's own generation from the same seed")
    parser.add_argument("--plot", help="write the reward curve(s) to this PNG")
    parser.add_argument("--json", help="write the per-step numbers to this file")
    parser.add_argument("--out-dir", default="out/trl_grpo")
    args = parser.parse_args(argv)
    out = args.json or (
        os.path.join(os.environ["OUT"], f"trl_grpo_{args.backend}.json") if os.environ.get("OUT") else None
    )
    report: dict[str, Any] = {"backend": args.backend, "steps": args.steps, "seed": args.seed, "lr": args.lr}
    report["versions"] = _versions(["trl", "transformers", "datasets", "accelerate", "torch", args.backend])
    t0 = time.perf_counter()
    try:
        runs = _main(args, report)
    except Exception as exc:  # the JSON says what failed; the exit status too (the exception goes on)
        report.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
        raise
    finally:
        report["elapsed_s"] = round(time.perf_counter() - t0, 1)
        if out:
            Path(out).write_text(json.dumps(report, indent=1))
    return runs


def _versions(names: list[str]) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in dict.fromkeys(names):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _main(args: argparse.Namespace, report: dict[str, Any]) -> list[dict[str, Any]]:
    import torch
    import transformers

    from genengine.models.tiny_model import tiny_model_dir

    if args.backend == "transformers":
        torch.set_num_threads(1)  # a tiny model on a CPU: one thread is fastest, as in the demo
    transformers.utils.logging.set_verbosity_error()
    model_dir = args.model or str(tiny_model_dir())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    target = pick_target_token(model_dir, tokenizer)
    report["target"] = target
    report["runs"] = runs = [run(args, model_dir, target, use_genengine=True)]
    if args.compare:
        runs.append(run(args, model_dir, target, use_genengine=False))
    for r in runs:
        k = max(1, len(r["reward"]) // 4)
        first, last = sum(r["reward"][:k]) / k, sum(r["reward"][-k:]) / k
        print(
            f"{r['path']}: reward {first:.3f} -> {last:.3f} in {r['seconds']:.1f} s (trainer built in "
            f"{r['setup_s']:.1f} s); per step " + " ".join(f"{x:.2f}" for x in r["reward"])
        )
        if r["last_sync"] is not None:
            print(f"  last sync: {r['last_sync']}; max |engine - policy| logprob per step: {r['logp_gap_max']}")
        if not all(math.isfinite(x) for x in r["loss"]):
            raise RuntimeError(f"{r['path']}: a loss is not finite: {r['loss']}")
    if args.plot:
        plot(runs, args.plot, str(tokenizer.decode([target])))
        print(f"plot: {args.plot}")
    return runs


if __name__ == "__main__":
    main()
