"""Two engines on one host, colocated as a data-parallel trainer runs them: tp_size=1 in a world of 2.

    PYTHONPATH=tests torchrun --nproc-per-node 2 tests/gpu/dp2.py --backend sglang|vllm [--mem 0.3] [--json PATH]

(``tools/gpu/run_tests.sh ENGINE --torchrun2 tests/gpu/dp2.py --backend ENGINE`` runs it with the
machine's settings.) Each rank is the leader of its own TP group of one and owns an engine on its own GPU.
Checks, with PASS/FAIL lines and exit code 1 on any failure:
- both engines start: no port or GPU collision;
- each engine's memory sits on its rank's GPU only (NVML, by process tree);
- same prompts give the same greedy tokens on both engines, and each rank gets its own prompts' outputs;
- unseeded sampling of the same prompts differs between the engines (each samples from seed + its group index);
- the engines are independent: rank 0 sleeps, takes other weights and wakes while rank 1 generates
  unchanged, then rank 0 restores its weights;
- shutdown gives each GPU's memory back and leaves the trainer's default group working.
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
    "GENENGINE_COLLECTIVE_TIMEOUT_S": "180",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}.items():
    os.environ.setdefault(_key, _value)
if importlib.util.find_spec("flashinfer") is None:  # a setting of the GPU kit, as in tp2_vllm.py
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

from support.tp2_run import Tp2Run, exit_with  # noqa: E402

RUN = Tp2Run("dp2")
RANK, RESULT = RUN.rank, RUN.result
log, check = RUN.log, RUN.check
PROMPTS = ["The quick brown fox", "Once upon a time", "In a distant galaxy far away", "Hello", "my name is", "one"]
MODEL_DIR = "/tmp/genengine-dp2/model"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("sglang", "vllm"), required=True)
    ap.add_argument("--mem", type=float, default=0.3)
    ap.add_argument("--json", default=None, help="rank 0 writes both ranks' results here")
    a = ap.parse_args()

    import torch
    import torch.distributed as dist

    size = RUN.start(bind_device=False)
    check(size == 2, f"world size is 2 (got {size})")
    gather, gloo = RUN.gather, RUN.gloo

    from support.gpu_checks import (
        GIB,
        current_gpu_uuid,
        free_gpu_memory,
        gpu_memory_by_process_per_gpu,
    )
    from support.processes import descendants

    from genengine import create_engine
    from genengine.models.tiny_model import build_tiny_model
    from genengine.protocol import SamplingParams
    from genengine.testing.conformance import load_checkpoint

    if RANK == 0:
        build_tiny_model(MODEL_DIR, seed=0)
    dist.barrier(group=gloo)
    my_uuid = current_gpu_uuid()
    free = free_gpu_memory
    free0 = free()
    options: dict[str, Any] = {"tp_size": 1, "mem_util": a.mem, "disable_cuda_graph": True}
    if a.backend == "vllm":
        options["max_model_len"] = 1024
    t = time.time()
    engine = create_engine(backend=a.backend, model=MODEL_DIR, **options)
    RESULT["start_s"] = round(time.time() - t, 2)
    held = free0 - free()
    RESULT["engine_gib"] = round(held / GIB, 2)
    check(held > 0.2 * torch.cuda.mem_get_info()[1], f"the engine holds {held / GIB:.1f} GiB of this rank's GPU")
    server_args = getattr(getattr(engine, "_engine", None), "server_args", None)  # SGLang's, on its leader
    RESULT["port"] = getattr(server_args, "port", None)
    log(f"engine started in {RESULT['start_s']} s, {RESULT['engine_gib']} GiB, port {RESULT['port']}")
    dist.barrier(group=gloo)

    # --- placement: each rank's process tree holds memory on its own GPU only ------------------------------
    tree = [os.getpid(), *(p.pid for p in descendants(os.getpid()))]
    everyone = gather({"uuid": my_uuid, "tree": tree})
    if RANK == 0:
        usage = gpu_memory_by_process_per_gpu()
        RESULT["nvml_gib"] = usage
        for r, info in enumerate(everyone):
            mine = sum(g for pid, g in usage.get(info["uuid"], {}).items() if pid in info["tree"])
            elsewhere = sum(
                g
                for uuid, procs in usage.items()
                if uuid != info["uuid"]
                for pid, g in procs.items()
                if pid in info["tree"]
            )
            check(mine > 5.0, f"rank {r}'s processes hold {mine:.1f} GiB on its own GPU")
            check(elsewhere < 1.0, f"rank {r}'s processes hold {elsewhere:.2f} GiB on the other GPU (contexts at most)")
        check(everyone[0]["uuid"] != everyone[1]["uuid"], "the two ranks' engines are on different GPUs")
    ports = gather(RESULT["port"])
    if a.backend == "sglang":
        check(None not in ports and len(set(ports)) == 2, f"the two SGLang engines listen on distinct ports {ports}")

    # --- same prompts, same tokens; own prompts, own outputs --------------------------------------------------
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, logprobs=True, ignore_eos=True)

    def run(prompts: list[str]) -> list[tuple[list[int], list[float]]]:
        return [(r.outputs[0].token_ids, list(r.outputs[0].logprobs or [])) for r in engine.generate(prompts, greedy)]

    def same(x: list[tuple[list[int], list[float]]], y: list[tuple[list[int], list[float]]]) -> bool:
        """The same tokens, and logprobs within what batching order changes."""
        return [t for t, _ in x] == [t for t, _ in y] and all(
            abs(p - q) <= 1e-3 for (_, lx), (_, ly) in zip(x, y, strict=True) for p, q in zip(lx, ly, strict=True)
        )

    base = run(PROMPTS)
    both = gather(base)
    check([t for t, _ in both[0]] == [t for t, _ in both[1]], "same prompts: the same greedy tokens on both engines")
    gap = max(
        abs(x - y) for (_, la), (_, lb) in zip(both[0], both[1], strict=True) for x, y in zip(la, lb, strict=True)
    )
    RESULT["logprob_gap_between_engines"] = gap
    check(gap < 0.02, f"same prompts: logprobs agree between the engines (max gap {gap:.4f})")
    own = run(PROMPTS[RANK::2])
    check(
        [t for t, _ in own] == [t for t, _ in base[RANK::2]],
        f"rank {RANK} gets its own prompts' outputs ({len(own)} prompts)",
    )

    # --- unseeded sampling: each engine its own stream (the config's seed plus the TP group's index) -------------
    sampled = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    draws = gather([r.outputs[0].token_ids for r in engine.generate(PROMPTS, sampled)])
    check(draws[0] != draws[1], "same prompts, unseeded sampling: the two engines draw different tokens")

    # --- independence: rank 0 sleeps and takes other weights while rank 1 generates -------------------------
    weights = {n: t.cuda() for n, t in load_checkpoint(MODEL_DIR).items()}
    with open(os.path.join(MODEL_DIR, "config.json"), encoding="utf-8") as fh:
        vocab = int(json.load(fh)["vocab_size"])
    if RANK == 0:
        awake = free()
        engine.sleep(2)
        freed = free() - awake
        RESULT["rank0_sleep_freed_gib"] = round(freed / GIB, 2)
        check(freed > 0.5 * held, f"rank 0 asleep: freed {freed / GIB:.1f} GiB on GPU 0")
    dist.barrier(group=gloo)
    if RANK == 1:  # flushed: a prefix-cache hit is another kernel path, with other last bits
        engine.flush_cache()
        check(same(run(PROMPTS), base), "rank 1 generates unchanged while rank 0 sleeps")
    dist.barrier(group=gloo)
    if RANK == 0:
        engine.wake(["weights"])
        zeroed = dict(weights)
        zeroed["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
        engine.load_weights(zeroed.items())
        engine.wake(["kv_cache"])
        uniform = run(PROMPTS)
        want = -math.log(vocab)
        check(
            all(abs(lp - want) < 1e-3 for _, lps in uniform for lp in lps),
            "rank 0 took other weights: uniform logprobs",
        )
    dist.barrier(group=gloo)
    if RANK == 1:
        engine.flush_cache()
        check(same(run(PROMPTS), base), "rank 1's weights are unchanged after rank 0's load")
    dist.barrier(group=gloo)
    if RANK == 0:
        engine.load_weights(weights.items())
        check(same(run(PROMPTS), base), "rank 0's original weights restored")
    weights.clear()
    dist.barrier(group=gloo)

    # --- shutdown: the engine's memory back, none of this rank's processes left on a GPU ---------------------
    before = free()
    engine.shutdown()
    returned = free() - before
    RESULT["returned_gib"] = round(returned / GIB, 2)
    took = f"{returned / GIB:.2f} of the {held / GIB:.2f} GiB the engine took"
    check(returned >= 0.98 * held, f"shutdown gave back {took}")
    tree_now = {p.pid for p in descendants(os.getpid())}
    usage = gpu_memory_by_process_per_gpu()
    RESULT["trainer_gib_after_shutdown"] = usage.get(my_uuid, {}).get(os.getpid())
    on_gpu = {pid: g for procs in usage.values() for pid, g in procs.items() if pid in tree_now}
    check(not on_gpu, f"no process started by this rank holds GPU memory after shutdown ({on_gpu})")
    return RUN.finish(a.json)


if __name__ == "__main__":
    exit_with(RUN, main)
