"""A worked RL loop on any backend: the four calls a colocated trainer makes each step.

    results = engine.generate(prompts, SamplingParams(..., logprobs=True))   # rollouts
    engine.sleep(level=2)                                                    # trainer steps
    engine.wake(["weights"]); engine.load_weights(policy.state_dict().items())
    engine.wake()                                                            # KV cache (and the rest) last

The policy is a Hugging Face model trained with a GRPO-style objective on a toy reward (the share of
completion tokens containing the letter "e"), so the reward visibly moves in a few steps. The engine's
logprobs are the importance-sampling denominator; their drift from the trainer's own logprobs is printed
each step (it is the number that degrades RL when an engine returns the wrong kind of logprobs, or serves
stale weights). The per-backend scripts (``rl_loop_transformers.py`` and friends) only pick a config.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello world", "the answer is"]


def _init_distributed(device: str) -> tuple[int, int]:
    """Under torchrun the trainer owns the default process group, as in any RL trainer."""
    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    if not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return dist.get_rank(), dist.get_world_size()


def _model_path(arg: str | None, rank: int, world: int) -> str:
    """The given model, or a tiny random one built once and shared with every rank."""
    if arg is not None:
        return arg
    path = None
    if rank == 0:
        from genengine.models.tiny_model import build_tiny_model

        path = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="genengine-rl-")) / "model", dtype="float32"))
    if world > 1:
        import torch.distributed as dist

        box = [path]
        dist.broadcast_object_list(box, src=0)
        path = box[0]
    assert path is not None
    return path


def _completion_logprobs(policy: Any, prompt: Sequence[int], completion: Sequence[int], device: str) -> Any:
    """The trainer's log-probability of each completion token (teacher forcing, temperature 1)."""
    import torch

    ids = torch.tensor([list(prompt) + list(completion)], device=device)
    logits = policy(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion, device=device)[:, None])[:, 0]


def main(argv: Sequence[str] | None = None, *, config_file: str, device: str = "cpu") -> list[dict[str, float]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import genengine
    from genengine import EngineConfig, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="local HF model folder (default: build a tiny random model)")
    parser.add_argument("--config", default=config_file, help="engine config YAML (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt (the GRPO group)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)

    rank, world = _init_distributed(device)
    if device.startswith("cuda"):
        device = f"cuda:{torch.cuda.current_device()}"
    model = _model_path(args.model, rank, world)
    # The engine section of the trainer's config, from YAML; the model path comes from the command line.
    config = EngineConfig.from_yaml(args.config).replace(model=model)

    torch.manual_seed(0)
    policy: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    policy = policy.to(device)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    good = {i for i, tok in enumerate(vocab) if tok and "e" in tok.lower()}

    history: list[dict[str, float]] = []
    with genengine.create_engine(config) as engine:
        for step in range(args.steps):
            # 1. rollouts, with the engine's (processed) logprobs of every sampled token
            t0 = time.perf_counter()
            params = SamplingParams(
                temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.samples, logprobs=True, seed=step
            )
            results = engine.generate(PROMPTS, params)
            t_generate = time.perf_counter() - t0

            # 2. the engine gives its memory back while the trainer computes and steps
            engine.sleep(level=2)
            t0 = time.perf_counter()
            policy.train()
            losses, rewards, drift, n_tokens = [], [], [], 0
            for result in results:
                group = [o for o in result.outputs if o.token_ids]
                r = torch.tensor([sum(t in good for t in o.token_ids) / len(o.token_ids) for o in group])
                advantages = (r - r.mean()) / (r.std() + 1e-6) if len(group) > 1 else torch.zeros_like(r)
                rewards += r.tolist()
                for out, adv in zip(group, advantages, strict=True):
                    new = _completion_logprobs(policy, result.prompt_token_ids, out.token_ids, device)
                    old = torch.tensor(out.logprobs, device=device)
                    drift.append((new.detach() - old).abs().mean().item())
                    ratio = torch.exp(new - old)  # importance ratio against the engine's logprobs
                    losses.append(-(adv.to(device) * ratio).sum())
                    n_tokens += len(out.token_ids)
            loss = torch.stack(losses).sum() / n_tokens
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            t_train = time.perf_counter() - t0

            # 3. staged wake: weights, the trainer's new weights, then the KV cache
            t0 = time.perf_counter()
            engine.wake(["weights"])
            report = engine.load_weights(policy.state_dict().items())
            engine.wake()
            t_sync = time.perf_counter() - t0

            row = {
                "step": step,
                "reward": sum(rewards) / len(rewards),
                "logprob_drift": sum(drift) / len(drift),
                "generate_s": t_generate,
                "train_s": t_train,
                "sync_s": t_sync,
                "sync_gb": report.num_bytes / 1e9,
            }
            history.append(row)
            if rank == 0:
                print(
                    f"step {step}: reward {row['reward']:.3f}  |engine-trainer logprob| {row['logprob_drift']:.2e}  "
                    f"generate {t_generate:.2f}s  train {t_train:.2f}s  "
                    f"wake→load_weights→wake {t_sync:.3f}s ({report.num_tensors} tensors, {row['sync_gb']:.3f} GB)",
                    flush=True,
                )
    return history
