"""The vllm backend at tensor parallelism 2, colocated as a trainer runs it: one engine rank per process.

    PYTHONPATH=tests torchrun --nproc-per-node 2 tests/gpu/tp2_vllm.py [--model DIR] [--json PATH]

Asserts, on both ranks: identical outputs (greedy, seeded and unseeded sampling, even after the ranks
consume their global RNGs differently); a prompt or an engine state that differs on one rank is caught
by the consistency check (InconsistentInputsError naming that rank, on every rank, no hang) and the
engine keeps working; sleep level 1 and 2, staged wake and load_weights from CUDA tensors reproduce the
outputs; new weights take effect on both ranks; shutdown leaves the trainer's default group usable.
Exits 1 if any check failed (every rank prints its PASS/FAIL lines and a TP2_VLLM_RESULT json line).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import time
from typing import Any

for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "GENENGINE_COLLECTIVE_TIMEOUT_S": "180",  # a diverged rank fails the run in minutes, not half an hour
}.items():
    os.environ.setdefault(_key, _value)
if importlib.util.find_spec("flashinfer") is None:  # a setting of the GPU kit, which does not carry flashinfer
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

from support.tp2_run import Tp2Run, exit_with  # noqa: E402

RUN = Tp2Run("tp2-vllm")
RANK, RESULT = RUN.rank, RUN.result
log, check = RUN.log, RUN.check
PROMPTS = ["The quick brown fox", "Once upon a time", "In a distant galaxy far away", "Hello"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/genengine-tp2-vllm-tiny")
    ap.add_argument("--mem", type=float, default=0.3)
    ap.add_argument("--json", default=None, help="rank 0 writes the combined results here")
    args = ap.parse_args()

    import numpy as np
    import torch
    import torch.distributed as dist

    size = RUN.start(bind_device=False)  # the trainer's world
    check(size == 2, f"world size is 2 (got {size})")
    gather = RUN.gather
    gloo = RUN.gloo

    from support.gpu_checks import free_gpu_memory

    from genengine.errors import InconsistentInputsError
    from genengine.models.tiny_model import build_tiny_model
    from genengine.protocol import SamplingParams
    from genengine_vllm import get_vllm_engine

    if RANK == 0 and not os.path.exists(os.path.join(args.model, "config.json")):
        build_tiny_model(args.model)  # 4 heads, 2 KV heads: splits over 2 GPUs
    dist.barrier(group=gloo)
    from safetensors.torch import load_file

    original = {n: t.cuda() for n, t in load_file(os.path.join(args.model, "model.safetensors")).items()}
    with open(os.path.join(args.model, "config.json")) as fh:
        vocab = json.load(fh)["vocab_size"]

    t = time.time()
    engine = get_vllm_engine(args.model, args.mem, tp_size=2, disable_cuda_graph=True, max_model_len=1024)
    RESULT["start_s"] = round(time.time() - t, 2)
    log(f"engine started in {RESULT['start_s']} s: {engine!r}")

    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, logprobs=True, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, logprobs=True, n=2, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=16, seed=7, ignore_eos=True)

    def run(name: str, params: Any = greedy) -> list[Any]:
        results = engine.generate(PROMPTS, params)
        flat = [[(o.token_ids, o.logprobs, o.text) for o in r.outputs] for r in results]
        everyone = gather(flat)
        check(all(x == everyone[0] for x in everyone), f"{name}: identical tokens, logprobs and text on both ranks")
        return flat

    base = run("greedy")
    check(all(len(o[0]) == 16 for r in base for o in r), "greedy: 16 tokens per prompt")
    check(run("greedy again") == base, "greedy is reproducible")
    np.random.seed(100 + RANK)  # the trainer's RNGs now differ between the ranks
    torch.manual_seed(100 + RANK)
    _ = np.random.rand(10 + RANK), torch.rand(3 + RANK)
    run("unseeded sampling after the ranks' RNGs diverged", sampled)
    first = run("seeded sampling", seeded)
    check(run("seeded sampling again", seeded) == first, "seeded sampling is reproducible")

    # --- inputs or state that differ on one rank: caught on every rank, the engine keeps working -------------
    def expect_inconsistent(name: str, call: Any) -> None:
        try:
            call()
            check(False, f"{name}: no error")
        except InconsistentInputsError as exc:
            check("rank(s) [1]" in str(exc), f"{name}: InconsistentInputsError names rank 1 ({exc})")
        except Exception as exc:
            check(False, f"{name}: wrong error {type(exc).__name__}: {exc}")

    prompts = PROMPTS if RANK == 0 else [*PROMPTS[:-1], "Hello!"]
    expect_inconsistent("a prompt differs on rank 1", lambda: engine.generate(prompts, greedy))
    params = greedy if RANK == 0 else SamplingParams(temperature=0.0, max_new_tokens=15, logprobs=True)
    expect_inconsistent("sampling parameters differ on rank 1", lambda: engine.generate(PROMPTS, params))
    if RANK == 1:
        engine.sleep(1)
    expect_inconsistent("rank 1 asleep while rank 0 generates", lambda: engine.generate(PROMPTS, greedy))
    if RANK == 1:
        engine.wake()
    check(run("greedy after the refused calls") == base, "the engine works after the refused calls")

    # --- sleep / staged wake / load_weights --------------------------------------------------------------------
    free = free_gpu_memory
    for level in (1, 2):
        awake = free()
        t = time.time()
        engine.sleep(level)
        sleep_s = time.time() - t
        freed = free() - awake
        t = time.time()
        engine.wake(["weights"])
        if level == 2:
            report = engine.load_weights(original.items())
            check(report.num_tensors == len(original), f"level 2: load_weights took {report.num_tensors} tensors")
        engine.wake(["kv_cache"])
        RESULT[f"level{level}"] = {
            "freed_gib": round(freed / 2**30, 2),
            "sleep_s": round(sleep_s, 3),
            "wake_and_load_s": round(time.time() - t, 3),
        }
        log(f"level {level}: {RESULT[f'level{level}']}")
        check(freed > 2**30, f"level {level}: sleep freed {freed / 2**30:.2f} GiB on this rank")
        check(run(f"greedy after level-{level} sleep") == base, f"level {level}: outputs reproduced")

    zeroed = dict(original)
    zeroed["model.norm.weight"] = torch.zeros_like(original["model.norm.weight"])
    engine.load_weights(zeroed.items())
    uniform = run("greedy with the final norm zeroed")
    want = -math.log(vocab)
    check(
        all(abs(lp - want) < 1e-3 for r in uniform for o in r for lp in o[1]), "new weights in effect: uniform logprobs"
    )
    engine.load_weights(original.items())
    check(run("greedy with the original weights again") == base, "original weights restored")

    # --- shutdown keeps the trainer's world ------------------------------------------------------------------
    engine.shutdown()
    return RUN.finish(args.json)


if __name__ == "__main__":
    exit_with(RUN, main)
