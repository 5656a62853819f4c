"""A random-weight Qwen2-VL (``Qwen2VLForConditionalGeneration``) with a real BPE tokenizer, built offline.

GPU tests drive the image-prompt path of SGLang and vLLM, which need a real HF vision-language
architecture: a ``config.json`` with a ``vision_config``, a Qwen2-VL image processor, the vision special
tokens, and a chat template that puts ``<|vision_start|><|image_pad|><|vision_end|>`` where an image goes.

Every file is written by hand in the layout of the published Qwen2-VL checkpoints (a flat text config,
``rope_scaling`` of type ``mrope``, weights named ``visual.*``/``model.*``/``lm_head.*``): every loader
version reads that layout, while ``save_pretrained`` of this transformers writes a newer one.

The defaults keep the text shapes of ``tiny_model`` (hidden 256, 4 heads, 2 KV heads: head dim 64, which
every attention kernel supports and the GPU kernel cache was built for); the vision tower is depth 2,
width 128, 2 heads (head dim 64, for the same reason). A 56x56 image is 4x4 patches, 4 image tokens.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from genengine.errors import InvalidArgumentError
from genengine.models.tiny_model import (
    EOS_TOKEN,
    SPECIAL_TOKENS,
    built_once,
    check_args,
    save_weights,
    write_json,
    write_tokenizer,
)

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "ARCHITECTURE",
    "IMAGE_TOKEN",
    "VIDEO_TOKEN",
    "VISION_END_TOKEN",
    "VISION_START_TOKEN",
    "VLM_CHAT_TEMPLATE",
    "build_tiny_vlm",
    "tiny_image",
    "tiny_image_png",
    "tiny_vlm_dir",
]

ARCHITECTURE = "Qwen2VLForConditionalGeneration"
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
VISION_PAD_TOKEN = "<|vision_pad|>"
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_TOKENS = (VISION_START_TOKEN, VISION_END_TOKEN, VISION_PAD_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN)
"""Added after the trained vocabulary, in Qwen2-VL's order; the config's ``*_token_id`` fields name them."""

VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""``tiny_model``'s template for string content; content parts as Qwen2-VL's (no default system prompt)."""

PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
MIN_PIXELS = 56 * 56
"""One merged 2x2 block of 14-pixel patches twice over: the smallest image is 4 image tokens."""
MAX_PIXELS = 112 * 112
"""At most 64 patches, 16 image tokens: vLLM profiles memory with an image this large."""
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's, as Qwen2-VL's processor
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _mrope_section(head_dim: int) -> list[int]:
    """Temporal/height/width split of the rotary half-dim in Qwen2-VL's 16:24:24 proportion (64 → 8, 12, 12)."""
    half = head_dim // 2
    hw = (half - half // 4) // 2
    return [half - 2 * hw, hw, hw]


def _write_vlm_tokenizer(path: Path, vocab_size: int, max_len: int) -> dict[str, int]:
    """``tiny_model``'s tokenizer trained to ``vocab_size`` minus the vision tokens, which follow it; their ids."""
    from tokenizers import AddedToken, Tokenizer

    write_tokenizer(path, vocab_size - len(VISION_TOKENS), max_len)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    (path / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    ids: dict[str, int] = {}
    for t in (*SPECIAL_TOKENS, *VISION_TOKENS):
        tid = tok.token_to_id(t)
        if tid is None or tid >= vocab_size:
            raise AssertionError(f"token {t!r} got id {tid}, outside the model's vocabulary of {vocab_size}")
        ids[t] = tid

    tok_config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    for t in VISION_TOKENS:
        tok_config["added_tokens_decoder"][str(ids[t])] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    extra = [*SPECIAL_TOKENS[1:], *VISION_TOKENS]
    tok_config.update(additional_special_tokens=extra, chat_template=VLM_CHAT_TEMPLATE)
    tok_config["processor_class"] = "Qwen2VLProcessor"
    write_json(path / "tokenizer_config.json", tok_config)
    special_map = {"additional_special_tokens": extra, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    write_json(path / "special_tokens_map.json", special_map)
    return ids


def _write_processor(path: Path) -> None:
    # min/max pixels both as the old fields and as ``size``: each transformers version reads one of them.
    write_json(
        path / "preprocessor_config.json",
        {
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": list(_CLIP_MEAN),
            "image_processor_type": "Qwen2VLImageProcessor",
            "image_std": list(_CLIP_STD),
            "max_pixels": MAX_PIXELS,
            "merge_size": MERGE_SIZE,
            "min_pixels": MIN_PIXELS,
            "patch_size": PATCH_SIZE,
            "processor_class": "Qwen2VLProcessor",
            "resample": 3,
            "rescale_factor": 1 / 255,
            "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        },
    )
    write_json(path / "chat_template.json", {"chat_template": VLM_CHAT_TEMPLATE})


def _hub_name(name: str) -> str:
    """The published checkpoints' weight name of a parameter (transformers ≥ 4.52 nests both towers in ``model``)."""
    for new, old in (("model.visual.", "visual."), ("model.language_model.", "model.")):
        if name.startswith(new):
            return old + name.removeprefix(new)
    return name


def build_tiny_vlm(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vision_embed_dim: int = 128,
    vision_depth: int = 2,
    vision_num_heads: int = 2,
    max_position_embeddings: int = 1024,
    dtype: str = "bfloat16",
) -> Path:
    """Write a random-weight Qwen2-VL with its tokenizer and image processor as an HF directory; return its path.

    Same arguments → byte-identical files; the tokenizer depends on ``vocab_size`` only. 2-D (and conv)
    weights are normal(0, 0.1·sqrt(256/hidden)), norm scales 1, biases 0 (``tiny_model``'s init), so images
    change the greedy output. The merger projects to ``hidden_size``, as the language model needs.
    """
    import torch
    import transformers

    ints = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "vision_embed_dim": vision_embed_dim,
        "vision_depth": vision_depth,
        "vision_num_heads": vision_num_heads,
        "max_position_embeddings": max_position_embeddings,
    }
    check_args(dtype, seed, ints)
    if hidden_size % num_heads or num_heads % num_kv_heads or (hidden_size // num_heads) % 8:
        raise InvalidArgumentError(
            f"hidden_size={hidden_size} must be num_heads={num_heads} times a multiple of 8 (mrope splits "
            f"the head dim in three), and num_heads a multiple of num_kv_heads={num_kv_heads}"
        )
    if vision_embed_dim % vision_num_heads or (vision_embed_dim // vision_num_heads) % 4:
        raise InvalidArgumentError(
            f"vision_embed_dim={vision_embed_dim} must be vision_num_heads={vision_num_heads} times a multiple "
            "of 4 (the 2-D rotary embedding splits the head dim in four)"
        )

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    ids = _write_vlm_tokenizer(out, min(vocab_size, 4096), max_position_embeddings)
    _write_processor(out)
    eos = ids[EOS_TOKEN]
    vision_config = {
        "depth": vision_depth,
        "embed_dim": vision_embed_dim,
        "hidden_act": "quick_gelu",
        "hidden_size": hidden_size,
        "in_channels": 3,  # the name transformers ≥ 4.50 and vLLM read
        "in_chans": 3,  # the name of the published config, which SGLang reads
        "mlp_ratio": 4,
        "num_heads": vision_num_heads,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "spatial_patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    }
    config = {
        "architectures": [ARCHITECTURE],
        "attention_dropout": 0.0,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "image_token_id": ids[IMAGE_TOKEN],
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "max_window_layers": num_layers,
        "model_type": "qwen2_vl",
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "pad_token_id": eos,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {"mrope_section": _mrope_section(hidden_size // num_heads), "type": "mrope"},
        "rope_theta": 1000000.0,
        "sliding_window": max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "video_token_id": ids[VIDEO_TOKEN],
        "vision_config": vision_config,
        "vision_end_token_id": ids[VISION_END_TOKEN],
        "vision_start_token_id": ids[VISION_START_TOKEN],
        "vision_token_id": ids[VISION_PAD_TOKEN],
        "vocab_size": vocab_size,
    }
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos})

    # Parameter shapes from transformers' own class, so they always match what its loader expects.
    hf_config = transformers.AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        meta_model = getattr(transformers, ARCHITECTURE)(hf_config)
    spec = sorted((_hub_name(name), tuple(t.shape)) for name, t in meta_model.state_dict().items())
    save_weights(out, spec, getattr(torch, dtype), seed, 0.1 * math.sqrt(256 / hidden_size))
    return out


def tiny_vlm_dir(**kwargs: Any) -> Path:
    """``build_tiny_vlm(**kwargs)`` once per process, under a temporary directory keyed by the arguments."""
    return built_once("tiny-vlm", build_tiny_vlm, kwargs)


def tiny_image(seed: int = 0, *, size: tuple[int, int] = (56, 56)) -> Image.Image:
    """A ``size`` (width, height) RGB image of seeded noise: different seeds give different image embeddings."""
    from PIL import Image

    width, height = size
    rnd = random.Random(seed)
    return Image.frombytes("RGB", (width, height), rnd.randbytes(width * height * 3))


def tiny_image_png(seed: int = 0, *, size: tuple[int, int] = (56, 56)) -> bytes:
    """``tiny_image`` as PNG bytes, the form engines take (raw, base64 or as a data URL)."""
    buf = io.BytesIO()
    tiny_image(seed, size=size).save(buf, format="PNG")
    return buf.getvalue()
