"""Random-weight models of real HF architectures, with a real BPE tokenizer, built offline in seconds.

Tests, demos and benchmarks need a checkpoint that AutoModelForCausalLM, SGLang and vLLM all load, and
nothing may be downloaded. The defaults (Qwen2, hidden 256, 2 layers, 4 heads, 2 KV heads, vocab 512,
weights normal(0, 0.1)) are the shape proven in SGLang 0.5.17 and vLLM 0.26.0 on the GPU, whose kernel
cache was built for exactly these shapes, so keep them. Large weights make the logits peaked, so greedy
outputs vary from prompt to prompt instead of repeating one token.

The tokenizer depends only on ``vocab_size`` (never on ``seed``): two models that differ in seed share a
tokenizer, so the weights of one can be loaded into an engine serving the other.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from genengine.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["ARCHITECTURES", "CHAT_TEMPLATE", "EOS_TOKEN", "build_tiny_model", "count_params", "tiny_model_dir"]

ARCHITECTURES = ("qwen2", "qwen3", "llama")
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
"""``<|endoftext|>`` is id 0: EOS, padding and BOS. All-zero logits make greedy pick it (argmax takes the first)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_PRETOKENIZE_REGEX = (  # Qwen2's
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_DTYPES = ("bfloat16", "float16", "float32")
_NORM_SCALES = ("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")
"""1-D weights that start at 1 (RMSNorm and LayerNorm scales, the vision tower's included); others are 0."""
_SHARD_BYTES = 4 << 30
_COMMON_WORDS = (  # noqa: SIM905 (a word list reads better as text)
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but "
    "what all were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very after words called just "
    "where most know get through back much before go good new write our used me man too any day same right look "
    "think also around another came come work three word must because does part even place well such here take "
    "why things help put years different away again off went old number great tell men say small every found "
    "still between name should home big give air line set own under read last never us left end along while "
    "quick brown fox jumps lazy dog once upon a galaxy far hello world answer question story"
).split(" ")


# ---- shapes ------------------------------------------------------------------------------------------------
def _config_class(arch: str) -> Any:
    import transformers

    return {
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "llama": transformers.LlamaConfig,
    }[arch]


def _kv_heads_for(num_heads: int) -> int:
    """An even divisor of ``num_heads`` near a quarter of it (Qwen2-7B: 28 → 4), so TP=2 and TP=4 both split."""
    even = [kv for kv in range(2, num_heads + 1, 2) if num_heads % kv == 0 and kv <= max(2, num_heads // 4)]
    return max(even) if even else 1


def count_params(
    arch: str,
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
) -> int:
    """Parameters of a model of these shapes (what ``sum(p.numel() for p in model.parameters())`` gives)."""
    h, hd = hidden_size, head_dim or hidden_size // num_heads
    attn = h * num_heads * hd + 2 * h * num_kv_heads * hd + num_heads * hd * h
    if arch == "qwen2":
        attn += num_heads * hd + 2 * num_kv_heads * hd  # q/k/v biases
    if arch == "qwen3":
        attn += 2 * hd  # q_norm, k_norm
    layer = attn + 3 * h * intermediate_size + 2 * h
    embed = vocab_size * h * (1 if tie_word_embeddings else 2)
    return num_layers * layer + embed + h


def _shapes_for(arch: str, num_params: int, vocab_size: int, tie: bool) -> dict[str, int]:
    """Qwen2/Llama-like proportions (layers ≈ hidden/128, heads a multiple of 4) near ``num_params``."""
    ratio = 2.6875 if arch == "llama" else 5.25  # Llama-2-7B: 11008/4096; Qwen2-7B: 18944/3584
    best: dict[str, int] | None = None
    best_err = math.inf
    for hidden in range(256, 16384 + 1, 256):
        head_dim = 64 if hidden < 2048 else 128
        if hidden % (4 * head_dim):
            continue
        heads = hidden // head_dim
        base = max(2, round(hidden / 128))
        for layers in range(2, 2 * base + 3):
            shape = {
                "hidden_size": hidden,
                "intermediate_size": max(128, round(hidden * ratio / 128) * 128),
                "num_layers": layers,
                "num_heads": heads,
                "num_kv_heads": _kv_heads_for(heads),
            }
            n = count_params(arch, vocab_size=vocab_size, tie_word_embeddings=tie, **shape)
            # Mostly the parameter count; a little the depth/width proportion, so 7B does not become 3 wide layers.
            err = abs(math.log(n / num_params)) + 0.1 * abs(math.log(layers / base))
            if err < best_err - 1e-9:
                best, best_err = shape, err
    assert best is not None
    return best


# ---- tokenizer ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE trained on a fixed synthetic corpus; the same string for the same ``vocab_size``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    rnd = random.Random(1234)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rnd.choice(letters) for _ in range(rnd.randint(2, 8))) for _ in range(3000)]
    words += _COMMON_WORDS * 20
    corpus = [" ".join(rnd.choice(words) for _ in range(20)) for _ in range(5000)]
    corpus += ["Hello, World! 0123456789 (a+b)=c; x.y? 'z' \"q\" - _ / \\ : # @ * % & $ ^ ~ ` | < > [ ] { }"] * 50
    tok = Tokenizer(models.BPE())
    # Qwen2's normalizer and pre-tokenizer: transformers swaps in its Qwen2Tokenizer for qwen2 checkpoints,
    # which rebuilds these from its own code; using the same ones keeps every loader's tokenization identical.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return str(tok.to_str())


def write_tokenizer(path: Path, vocab_size: int, max_len: int) -> None:
    # Written by hand (not save_pretrained) so the files are the same under every transformers version:
    # the GPU machine runs an older transformers than this one.
    (path / "tokenizer.json").write_text(_tokenizer_json(vocab_size), encoding="utf-8")
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    tok_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": max_len,
        "pad_token": EOS_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    write_json(path / "tokenizer_config.json", tok_config)
    write_json(
        path / "special_tokens_map.json",
        {"additional_special_tokens": list(SPECIAL_TOKENS[1:]), "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN},
    )


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ---- weights -----------------------------------------------------------------------------------------------
def _tensor_seed(seed: int, name: str) -> int:
    """Per-tensor seed: a tensor's values do not depend on which other tensors exist or their order."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _init_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int, std: float) -> torch.Tensor:
    import torch

    if len(shape) >= 2:
        gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen).to(dtype)
    if name.endswith(_NORM_SCALES):
        return torch.ones(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)  # biases


def check_args(dtype: str, seed: int, ints: dict[str, int]) -> None:
    """The builders' argument errors, raised before anything is written."""
    if dtype not in _DTYPES:
        raise InvalidArgumentError(f"dtype={dtype!r} is not supported; allowed: {', '.join(_DTYPES)}")
    for key, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{key}={value!r} must be a positive integer")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidArgumentError(f"seed={seed!r} must be an integer")
    if ints["vocab_size"] < 300:  # the shared tokenizer's floor
        raise InvalidArgumentError(
            f"vocab_size={ints['vocab_size']} must be >= 300 (256 byte tokens + specials + merges)"
        )


def save_weights(
    path: Path, spec: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, seed: int, std: float
) -> None:
    from safetensors.torch import save_file

    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[str(dtype).removeprefix("torch.")]
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in spec:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    if len(shards) == 1:
        tensors = {name: _init_tensor(name, shape, dtype, seed, std) for name, shape in spec}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _init_tensor(name, shape, dtype, seed, std) for name, shape in shard}
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        for name, shape in shard:
            weight_map[name] = fname
            total += math.prod(shape) * itemsize
        del tensors
    write_json(path / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


# ---- public ------------------------------------------------------------------------------------------------
def build_tiny_model(
    path: str | os.PathLike[str],
    *,
    arch: str = "qwen2",
    vocab_size: int = 512,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: str = "bfloat16",
    num_params: int | None = None,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a random-weight ``arch`` model and its tokenizer as a normal HF directory; return its path.

    Same arguments → byte-identical files. 2-D weights are normal(0, 0.1·sqrt(256/hidden)) (0.1 at the
    default width; narrower at larger widths so activations stay finite), norms 1, biases 0.
    ``num_params`` overrides hidden/intermediate/layers/heads with Qwen2- or Llama-like proportions that
    reach about that many parameters (up to 7B-class shapes; weights above 4 GiB are sharded).
    """
    import torch
    import transformers

    if arch not in ARCHITECTURES:
        raise InvalidArgumentError(f"arch={arch!r} is not supported; allowed: {', '.join(ARCHITECTURES)}")
    ints = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
    }
    check_args(dtype, seed, ints)
    if num_params is not None:
        if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 100_000:
            raise InvalidArgumentError(f"num_params={num_params!r} must be an integer >= 100000")
        shape = _shapes_for(arch, num_params, vocab_size, tie_word_embeddings)
        hidden_size, intermediate_size = shape["hidden_size"], shape["intermediate_size"]
        num_layers, num_heads, num_kv_heads = shape["num_layers"], shape["num_heads"], shape["num_kv_heads"]
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise InvalidArgumentError(
            f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}, "
            f"and num_heads by num_kv_heads={num_kv_heads}"
        )

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    # The trained vocabulary can be at most the model's; a larger model vocabulary is padding, as in Qwen.
    tok_vocab = min(vocab_size, 4096)
    write_tokenizer(out, tok_vocab, max_position_embeddings)
    eos = 0
    head_dim = hidden_size // num_heads
    cfg_kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "dtype": dtype,
    }
    if arch == "qwen3":
        cfg_kwargs["head_dim"] = head_dim
    config = _config_class(arch)(**cfg_kwargs)
    model_cls = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[arch]
    config.architectures = [model_cls]
    config.save_pretrained(out)
    gen_config = transformers.GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    gen_config.save_pretrained(out)

    with torch.device("meta"):
        meta_model = getattr(transformers, model_cls)(config)
    spec = [(name, tuple(t.shape)) for name, t in meta_model.state_dict().items()]
    if tie_word_embeddings:
        spec = [(n, s) for n, s in spec if n != "lm_head.weight"]
    spec.sort()
    std = 0.1 * math.sqrt(256 / hidden_size)
    save_weights(out, spec, getattr(torch, dtype), seed, std)
    return out


_CACHE: dict[str, Path] = {}


def built_once(kind: str, build: Callable[..., Path], kwargs: dict[str, Any]) -> Path:
    """``build(dir, **kwargs)`` once per process, under a temporary directory keyed by ``kind`` and the
    arguments (removed at exit); rebuilt if something deleted it."""
    key = json.dumps({"kind": kind, **kwargs}, sort_keys=True, default=str)
    path = _CACHE.get(key)
    if path is None or not (path / "config.json").exists():
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        root = Path(tempfile.mkdtemp(prefix=f"genengine-{kind}-{digest}-"))
        atexit.register(shutil.rmtree, root, True)
        path = build(root / "model", **kwargs)
        _CACHE[key] = path
    return path


def tiny_model_dir(**kwargs: Any) -> Path:
    """``build_tiny_model(**kwargs)`` once per process, under a temporary directory keyed by the arguments."""
    return built_once("tiny", build_tiny_model, kwargs)
