"""What bench_sglang.py and bench_vllm.py share: the Qwen2-7B-shaped model, the trainer's tensors, the
prompts, the timers and the GPU-memory readings. One copy, so the two engines are measured the same way.

Imported by the bench scripts (``python3 benchmarks/bench_X.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if _TESTS not in sys.path:  # the repo's test helpers (tests/support), shared with the GPU tests
    sys.path.insert(0, _TESTS)

from support.gpu_checks import free_gpu_memory as free_bytes  # noqa: E402

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


def make_model_dir(path: str, *, tokenizer: bool) -> str:
    """Qwen2-7B's config.json (``load_format="dummy"`` makes the weights), plus a small BPE tokenizer when
    the engine loads one."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    eos = 151643
    if tokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        rnd = random.Random(0)
        words = [
            "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 8))) for _ in range(3000)
        ]
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
        found = tok.token_to_id("<|endoftext|>")
        assert found is not None, "the trained tokenizer has no <|endoftext|>"
        eos = found
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
    """Every tensor of a Qwen2-7B checkpoint under its HF name (339 of them, 15.23 GB in bf16)."""
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
    """The trainer's weights: random bf16 CUDA tensors under the HF names (norms at 1), each its own
    allocation, as a trainer's parameters are."""
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


def warm_trainer_process() -> None:
    """What any trainer process has done before it builds an engine: bf16 matmuls (cuBLAS/cuBLASLt loaded,
    their workspaces allocated). Without it the engine's share would include the trainer's own libraries."""
    import torch

    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    (a @ a).float().sum().item()
    torch.nn.functional.linear(a, a).sum().item()
    del a
    torch.cuda.synchronize()


def staged_sleep_wake(
    engine: Any, level: int, items: list[tuple[str, Any]], while_asleep: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """One sleep(level) → wake(weights) → (level 2: load_weights) → wake(kv_cache), the trainer's order:
    bytes freed, each step's seconds, and what ``while_asleep`` reads before the wake (who keeps what)."""
    awake = free_bytes()
    t = time.perf_counter()
    engine.sleep(level)
    sleep_s = time.perf_counter() - t
    freed = free_bytes() - awake
    asleep = while_asleep() if while_asleep is not None else None
    t = time.perf_counter()
    engine.wake(["weights"])
    wake_weights_s = time.perf_counter() - t
    if level == 2:
        engine.load_weights(items)
    t = time.perf_counter()
    engine.wake(["kv_cache"])
    return {
        "freed": freed,
        "asleep": asleep,
        "sleep_s": sleep_s,
        "wake_weights_s": wake_weights_s,
        "wake_kv_s": time.perf_counter() - t,
    }


def timed(fn: Callable[[], Any], reps: int = 3, warmup: int = 1) -> list[float]:
    """Seconds of each timed call (CUDA synchronized around it), after ``warmup`` untimed ones."""
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
    """Output tokens/s of ``gen`` on five batches of fresh prompts, after a warm-up batch (the median: single
    runs varied by ±8% on the H200 for both engines alike)."""
    gen(prompts(1000))
    runs = []
    for i in range(5):
        t = time.perf_counter()
        n = gen(prompts(i))
        runs.append(n / (time.perf_counter() - t))
    return {"tok_per_s": round(statistics.median(runs), 1), "all": [round(x, 1) for x in runs]}


def torch_memory_breakdown(exclude: list[Any] | None = None, top: int = 8) -> dict[str, Any]:
    """This process's torch memory by pool (reserved GiB per pool id; vLLM's sleep pool is its own) and
    the largest live CUDA tensors not in ``exclude``: what a sleep left behind, and who holds it."""
    import gc

    import torch

    pools: dict[str, float] = {}
    for seg in torch.cuda.memory_snapshot():
        key = str(seg.get("segment_pool_id", "?"))
        pools[key] = round(pools.get(key, 0.0) + seg["total_size"] / GIB, 3)
    skip = {id(t) for t in exclude or []}
    tensors: list[tuple[int, str]] = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda and id(obj) not in skip:
                size = obj.untyped_storage().nbytes()
                if size >= 16 << 20:
                    tensors.append((size, f"{tuple(obj.shape)} {obj.dtype}"))
        except Exception:  # freed storages, meta tensors: not what we look for
            continue
    tensors.sort(reverse=True)
    return {
        "allocated_gib": round(torch.cuda.memory_allocated() / GIB, 3),
        "reserved_gib": round(torch.cuda.memory_reserved() / GIB, 3),
        "pools_reserved_gib": pools,
        "largest_live_tensors": [f"{s / GIB:.3f} GiB {d}" for s, d in tensors[:top]],
    }


def set_offline_env() -> None:
    """The GPU machine has no network: every hub lookup would wait out its retries. Set before the engines import."""
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_NO_USAGE_STATS": "1",
    }.items():
        os.environ.setdefault(key, value)
