"""TRL's AsyncGRPOTrainer on any genengine backend: ``python examples/trl_async_grpo.py --backend vllm --steps 5``.

A plain TRL ``AsyncGRPOTrainer`` script: the rollout worker and the weight transfer come from
``genengine.integrations.trl_async.make_async_backend`` (the engine runs in this process, on the training GPU:
colocated, ``--mem-util`` of its memory) instead of TRL's ``vllm serve`` client. The task is the demo's toy reward
(the share of completion tokens equal to the token the untrained model samples most often), on the tiny random
Qwen2 built here unless ``--model`` names a folder.

Per step it prints and records the reward, the samples trained, the step's seconds and samples/s, the staleness
of what was trained (mean, max) and the weight sync's seconds. The JSON goes to ``--json`` or, when ``$OUT`` is
set (tools/gpu/run_tests.sh), to ``$OUT/trl_async_grpo_BACKEND.json``, with ``error`` if the run failed.
``--backend transformers`` runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_grpo import PROMPTS, _versions, engine_config, pick_target_token, target_share

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""What ``--lora`` adapts: the attention and MLP projections."""


def lora_options(backend: str, rank: int, max_staleness: int) -> dict[str, Any]:
    """The engine options that make it serve the adapter (the engines' own arguments; the embedded one needs none)."""
    if backend == "sglang":
        return {"enable_lora": True, "max_lora_rank": rank, "lora_target_modules": LORA_TARGETS}
    if backend == "vllm":
        # The adapter a held request still uses beside the new one, per version a sample may lag (as TRL sizes it).
        return {"enable_lora": True, "max_lora_rank": rank, "max_loras": max_staleness + 2, "max_cpu_loras": 8}
    return {}


def step_rows(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per optimizer step from TRL's logs: what the lead's table needs."""
    rows = []
    for h in log_history:
        if "reward" not in h:
            continue
        samples, seconds = h.get("batch/samples_per_step"), h.get("perf/step_s")
        rows.append(
            {
                "step": h.get("step"),
                "reward": h["reward"],
                "samples": samples,
                "step_s": seconds,
                "samples_per_s": samples / seconds if samples and seconds else None,
                "staleness_mean": h.get("sample/staleness_mean"),
                "staleness_max": h.get("sample/staleness_max"),
                "dropped_stale": h.get("sample/dropped_stale_total", 0.0) + h.get("rollout/dropped_stale_total", 0.0),
                "mixed_version_samples": h.get("rollout/mixed_version_samples_total", 0.0),
                "weight_sync_s": h.get("perf/weight_sync_s"),
                "rollout_wait_s": h.get("perf/rollout_wait_s"),
            }
        )
    return rows


def run(args: argparse.Namespace, report: dict[str, Any]) -> list[dict[str, Any]]:
    import torch
    import transformers
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from genengine.integrations.trl_async import make_async_backend
    from genengine.models.tiny_model import tiny_model_dir

    on_gpu = args.backend != "transformers" and torch.cuda.is_available()
    if not on_gpu:
        torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    model_dir = args.model or str(tiny_model_dir())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    target = pick_target_token(model_dir, tokenizer)
    report["target"] = target
    config = AsyncGRPOConfig(
        output_dir=args.out_dir,
        per_device_train_batch_size=args.batch,
        num_generations=8,
        max_completion_length=args.max_tokens,
        learning_rate=args.lr,
        max_steps=args.steps,
        max_staleness=args.max_staleness,
        token_budget=0,  # fixed-count batches: --batch samples per step
        logging_steps=1,
        report_to=[],
        seed=args.seed,
        use_cpu=not on_gpu,
        bf16=on_gpu,
        gradient_checkpointing=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    reward = target_share(target)
    engine = engine_config(args.backend, args.mem_util if on_gpu else None)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        engine["options"] = {**engine.get("options", {}), **lora_options(args.backend, args.lora, args.max_staleness)}
        peft_config = LoraConfig(
            r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"
        )
    t0 = time.perf_counter()
    worker, transfer = make_async_backend(
        engine,
        model=model_dir,
        args=config,
        train_dataset=dataset,
        reward_funcs=reward,
        processing_class=tokenizer,
        tree_attention=args.tree_attention,
    )
    report["engine_start_s"] = round(time.perf_counter() - t0, 1)
    try:
        trainer = AsyncGRPOTrainer(
            model=model_dir,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
            rollout_worker=worker,
            weight_transfer=transfer,
            callbacks=[transfer],  # the transfer sees a PEFT policy: adapter-only sync where the engine serves it
        )
        trainer.remove_callback(PrinterCallback)
        start = time.perf_counter()
        trainer.train()
        report["train_s"] = round(time.perf_counter() - start, 1)
        # The policy version the engine serves: its weights', or under adapter-only sync its adapter's.
        adapter_sync = transfer.sync_mode == "adapter"
        served = worker.engine.adapters["policy"].version if adapter_sync else worker.engine.weight_version
        report["engine_weight_version"] = served
        report["trainer_model_version"] = trainer.model_version
        report["syncs"] = len(transfer.versions)
        report["sync_mode"] = transfer.sync_mode
        load = transfer.last_load
        if load is not None:  # under adapter-only sync: the base weights, sent once
            report["last_sync"] = {"tensors": load.num_tensors, "bytes": load.num_bytes, "seconds": load.seconds}
        adapter = transfer.last_adapter
        if adapter is not None:
            report["last_adapter"] = {
                "tensors": adapter.num_tensors,
                "bytes": adapter.num_bytes,
                "seconds": adapter.seconds,
            }
    finally:
        worker.shutdown()
    report["steps_log"] = rows = step_rows(trainer.state.log_history)
    for r in rows:
        print(
            f"step {r['step']}: reward {r['reward']:.3f}, {r['samples']:.0f} samples in {r['step_s'] or 0:.2f} s "
            f"({r['samples_per_s'] or 0:.1f}/s), staleness mean {r['staleness_mean']:.2f} max "
            f"{r['staleness_max']:.0f}, sync {r['weight_sync_s'] or 0:.3f} s"
        )
    if report["engine_weight_version"] != report["trainer_model_version"]:
        raise RuntimeError(
            f"engine at version {report['engine_weight_version']}, trainer at {report['trainer_model_version']}"
        )
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["transformers", "sglang", "vllm"], default="transformers")
    parser.add_argument("--model", help="a Hugging Face model folder (default: a tiny random Qwen2, built here)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16, help="samples per step (num_generations is 8)")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_completion_length")
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--mem-util", type=float, default=0.3, help="the engine's share of the GPU")
    parser.add_argument(
        "--tree-attention",
        choices=["auto", "torch", "fa3"],
        default="torch",
        help="TRL's tree attention: fa3 fetches a kernel from the Hub (the GPU machines cannot); torch runs anywhere",
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="train a LoRA adapter of this rank on the attention and MLP projections (peft_config=), synced "
        "adapter-only (the engine started with LoRA enabled); 0: the whole model",
    )
    parser.add_argument("--json", help="write the per-step numbers to this file")
    parser.add_argument("--out-dir", default="out/trl_async_grpo")
    args = parser.parse_args(argv)
    out = args.json or (
        os.path.join(os.environ["OUT"], f"trl_async_grpo_{args.backend}{'_lora' if args.lora else ''}.json")
        if os.environ.get("OUT")
        else None
    )
    report: dict[str, Any] = {"backend": args.backend, "steps": args.steps, "seed": args.seed, "lr": args.lr}
    report["lora_rank"] = args.lora
    report["versions"] = _versions(["trl", "transformers", "accelerate", "torch", "peft", args.backend])
    t0 = time.perf_counter()
    try:
        return run(args, report)
    except Exception as exc:  # the JSON says what failed; the exit status too (the exception goes on)
        report.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
        raise
    finally:
        report["elapsed_s"] = round(time.perf_counter() - t0, 1)
        if out:
            Path(out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
