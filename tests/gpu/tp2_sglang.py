#!/usr/bin/env python3
"""The sglang backend at tp_size=2, as a trainer runs it: two torchrun ranks, one engine on both GPUs.

    PYTHONPATH=/tmp/site-proj:/tmp/site-sglang:$PWD/tests python3 -m torch.distributed.run --nproc-per-node 2 \\
        tests/gpu/tp2_sglang.py [--mem 0.3] [--tol 0.02] [--json PATH]

(tools/gpu/run_tests.sh sglang --tp2 does exactly this.) Rank 0 leads the TP group and owns the engine;
rank 1 holds none and gets every result by broadcast. Checks, with PASS/FAIL lines, exit code 1 on any
failure: both ranks get identical greedy tokens and logprobs, close to transformers' forward; the
reference face with ``gather_inputs`` gives each rank its own prompts' outputs; sleep(2) frees memory on
both GPUs; the staged wake (weights → load_weights from each rank's CUDA tensors → kv_cache) reproduces the
outputs; every weight-sync mode loads other weights identically; a zeroed final norm gives uniform logprobs
on every TP shard; the reference's per-parameter update restores the weights; shutdown leaves the trainer's
default group working.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any

for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # NVLink multicast stays off on the shared multi-GPU hosts (device README)
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}.items():
    os.environ.setdefault(_key, _value)

from support.tp2_run import Tp2Run, exit_with  # noqa: E402

RUN = Tp2Run("tp2-sglang")
RANK = RUN.rank
log, check = RUN.log, RUN.check
PROMPTS = ["The quick brown fox", "Once upon a time", "In a distant galaxy far away", "Hello", "my name is", "one two"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "logprobs": True}
MODEL_DIR = "/tmp/genengine-tp2-sglang/model"
OTHER_DIR = "/tmp/genengine-tp2-sglang/other"
GIB = 1 << 30


def tokens(results: list[Any]) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in results]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mem", type=float, default=0.3)
    ap.add_argument("--tol", type=float, default=0.01, help="mean |logprob - HF| allowed (or 1.25x HF's bf16 gap)")
    ap.add_argument("--json", default=None, help="rank 0 writes both ranks' results here")
    a = ap.parse_args()

    import torch
    import torch.distributed as dist

    world = RUN.start(bind_device=True)
    if world != 2:
        log(f"needs exactly 2 ranks (torchrun --nproc-per-node 2), got {world}")
        return 2
    gather = RUN.gather

    if RANK == 0:
        from genengine.models.tiny_model import build_tiny_model

        build_tiny_model(MODEL_DIR, seed=0)  # 4 heads, 2 KV heads: both divide by tp_size 2
        build_tiny_model(OTHER_DIR, seed=1)
    dist.barrier()
    from safetensors.torch import load_file

    orig = {k: v.cuda() for k, v in load_file(os.path.join(MODEL_DIR, "model.safetensors")).items()}
    other = {k: v.cuda() for k, v in load_file(os.path.join(OTHER_DIR, "model.safetensors")).items()}
    with open(os.path.join(MODEL_DIR, "config.json"), encoding="utf-8") as fh:
        vocab = json.load(fh)["vocab_size"]

    from genengine_sglang import get_sglang_engine

    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    t = time.time()
    engine = get_sglang_engine(MODEL_DIR, a.mem, tp_size=2, disable_cuda_graph=True)
    log(f"engine started in {time.time() - t:.1f} s; leader={engine.group.is_leader}")
    torch.cuda.synchronize()
    held = free0 - torch.cuda.mem_get_info()[0]
    log(f"engine memory on this GPU: {held / GIB:.2f} GiB")

    r1 = engine.generate(PROMPTS, GREEDY)
    everyone = gather([(r.prompt_token_ids, [(o.token_ids, o.logprobs) for o in r.outputs]) for r in r1])
    check(everyone[0] == everyone[1], "both ranks got identical tokens and logprobs")
    check(
        all(len(r.outputs[0].token_ids) >= 1 and all(math.isfinite(x) for x in r.outputs[0].logprobs) for r in r1),
        "outputs have tokens and finite logprobs",
    )
    if RANK == 0:
        import transformers

        # the same bf16 weights, computed in float32: the difference is the engine's arithmetic alone
        hf: Any = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
        hf = hf.to("cuda").eval()
        from genengine.testing.parity import bf16_copy, mean_logprob_gap, parity_bound

        mean = mean_logprob_gap(r1, hf)
        floor = mean_logprob_gap(r1, hf, bf16_copy(hf))
        bound = max(a.tol, parity_bound(floor))
        check(
            mean <= bound,
            f"mean |logprob(tp2) - logprob(transformers)| = {mean:.4f} <= {bound:.4f} "
            f"(transformers bf16 vs float32: {floor:.4f})",
        )
        del hf

    # The reference's face: each rank brings its own prompts, gather_inputs runs them together.
    ids = [r.prompt_token_ids for r in r1]
    mine = ids[RANK::2]
    outs = engine.generate(
        input_ids=mine, sampling_params={"temperature": 0.0, "max_new_tokens": 12}, gather_inputs=True
    )
    want = [r.outputs[0].token_ids for r in r1][RANK::2]
    check([o["output_ids"] for o in outs] == want, "gather_inputs: each rank got its own prompts' outputs")

    # Sleep level 2 and the staged wake, weights from each rank's own CUDA tensors.
    torch.cuda.synchronize()
    awake = torch.cuda.mem_get_info()[0]
    t = time.time()
    engine.sleep(2)
    sleep_s = time.time() - t
    asleep = torch.cuda.mem_get_info()[0]
    freed = asleep - awake
    log(f"sleep(2) {sleep_s:.3f} s freed {freed / GIB:.2f} of {held / GIB:.2f} GiB on this GPU")
    check(freed > GIB, "sleep(2) frees more than 1 GiB on this rank's GPU")
    for cycle in range(3):  # the first staged wake after start-up was 3 s here once: show where it goes
        if cycle:
            engine.sleep(2)
        parts = []
        for step in (
            lambda: engine.wake(["weights"]),
            lambda: engine.load_weights(orig.items()),
            lambda: engine.wake(["kv_cache"]),
        ):
            t = time.time()
            step()
            parts.append(time.time() - t)
        log(f"cycle {cycle}: wake(weights) {parts[0]:.3f} s, load {parts[1]:.3f} s, wake(kv_cache) {parts[2]:.3f} s")
        check(
            tokens(engine.generate(PROMPTS, GREEDY)) == tokens(r1),
            f"staged wake {cycle} after sleep(2) reproduces run 1",
        )

    for mode in ("handles", "flattened", "per_param"):
        engine.weight_sync_mode = mode
        engine.load_weights(other.items(), bucket_bytes=1 << 20)
        got = tokens(engine.generate(PROMPTS, GREEDY))
        if mode == "handles":
            other_tokens = got
            check(got != tokens(r1), "other weights give other outputs")
        else:
            check(got == other_tokens, f"weight_sync_mode={mode} loads what handles loads")
    engine.weight_sync_mode = "handles"

    zeros = dict(orig)
    zeros["model.norm.weight"] = torch.zeros_like(orig["model.norm.weight"])
    engine.load_weights(zeros.items())
    lps = [x for r in engine.generate(PROMPTS, {**GREEDY, "ignore_eos": True}) for x in r.outputs[0].logprobs]
    check(all(abs(x + math.log(vocab)) < 1e-3 for x in lps), "zeroed final norm: uniform logprobs on every shard")

    for i, (name, tensor) in enumerate(orig.items()):  # the reference's per-parameter update
        engine.update_weights_from_tensor(name, tensor, flush_cache=i == len(orig) - 1)
    check(tokens(engine.generate(PROMPTS, GREEDY)) == tokens(r1), "reference per-parameter update restores run 1")

    t = time.time()
    engine.shutdown()
    log(f"shutdown {time.time() - t:.2f} s")
    torch.cuda.synchronize()
    after = torch.cuda.mem_get_info()[0]
    check(after - awake >= 0.9 * held, f"shutdown gave back {(after - awake) / GIB:.2f} GiB of {held / GIB:.2f}")
    RUN.result.update(held_gib=round(held / GIB, 2), freed_gib=round(freed / GIB, 2))
    return RUN.finish(a.json)


if __name__ == "__main__":
    exit_with(RUN, main)
