"""The tiny Qwen2-VL builder: deterministic, consistent token ids, and an image prompt generates on CPU."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
from pathlib import Path
from typing import Any

import pytest

from genengine.errors import InvalidArgumentError
from genengine.models.tiny_vlm import (
    ARCHITECTURE,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    VISION_END_TOKEN,
    VISION_START_TOKEN,
    build_tiny_vlm,
    tiny_image,
    tiny_image_png,
    tiny_vlm_dir,
)

FILES = (
    "chat_template.json",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _processor(path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """AutoProcessor where torchvision is installed (the GPU machines); else the same processor from its parts.

    transformers 5 builds Qwen2-VL's video processor with torchvision, which this CPU venv lacks; images never
    touch it, so the processor's own image-token expansion still runs, with no video processor.
    """
    import transformers

    if HAS_TORCHVISION:
        return transformers.AutoProcessor.from_pretrained(path)
    check = transformers.ProcessorMixin.check_argument_for_proper_class
    monkeypatch.setattr(
        transformers.ProcessorMixin,
        "check_argument_for_proper_class",
        lambda self, name, arg: None if name == "video_processor" else check(self, name, arg),
    )
    return transformers.Qwen2VLProcessor(
        image_processor=transformers.AutoImageProcessor.from_pretrained(path),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        video_processor=None,
        chat_template=json.loads((path / "chat_template.json").read_text())["chat_template"],
    )


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    a = build_tiny_vlm(tmp_path / "a", seed=3)
    b = build_tiny_vlm(tmp_path / "b", seed=3)
    assert {p.name for p in a.iterdir()} == set(FILES)
    for name in FILES:
        assert _digest(a / name) == _digest(b / name), name
    c = build_tiny_vlm(tmp_path / "c", seed=4)
    assert _digest(a / "model.safetensors") != _digest(c / "model.safetensors")
    assert _digest(a / "tokenizer.json") == _digest(c / "tokenizer.json"), "the tokenizer must not depend on seed"


def test_config_matches_tokenizer_and_shapes() -> None:
    import transformers

    path = tiny_vlm_dir()
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == [ARCHITECTURE] and raw["model_type"] == "qwen2_vl"
    assert (raw["hidden_size"], raw["num_hidden_layers"], raw["vocab_size"]) == (256, 2, 512)
    assert (raw["num_attention_heads"], raw["num_key_value_heads"]) == (4, 2)
    head_dim = raw["hidden_size"] // raw["num_attention_heads"]
    assert raw["rope_scaling"]["type"] == "mrope" and sum(raw["rope_scaling"]["mrope_section"]) == head_dim // 2
    vision = raw["vision_config"]
    assert (vision["depth"], vision["embed_dim"], vision["num_heads"]) == (2, 128, 2)
    assert vision["hidden_size"] == raw["hidden_size"], "the merger feeds the language model"
    assert (vision["patch_size"], vision["spatial_merge_size"], vision["temporal_patch_size"]) == (14, 2, 2)
    assert vision["in_chans"] == vision["in_channels"] == 3
    pre = json.loads((path / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (14, 2, 2)

    tok = transformers.AutoTokenizer.from_pretrained(path)
    config = transformers.AutoConfig.from_pretrained(path)
    assert len(tok) == raw["vocab_size"]
    for field, token in (
        ("image_token_id", IMAGE_TOKEN),
        ("video_token_id", VIDEO_TOKEN),
        ("vision_start_token_id", VISION_START_TOKEN),
        ("vision_end_token_id", VISION_END_TOKEN),
    ):
        assert getattr(config, field) == raw[field] == tok.convert_tokens_to_ids(token), field
        assert tok.decode([raw[field]]) == token and len(tok.encode(token)) == 1, field
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert config.text_config.hidden_size == 256 and config.vision_config.embed_dim == 128

    msgs: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    chat = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"
    text_only = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text_only == "<|im_start|>user\nhi<|im_end|>\n"


def test_image_prompt_generates(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import transformers

    path = tiny_vlm_dir()
    processor = _processor(path, monkeypatch)
    loaded: Any = transformers.AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    model, info = loaded
    assert type(model).__name__ == ARCHITECTURE and model.dtype == torch.bfloat16
    assert not info["missing_keys"] and not info["unexpected_keys"], info

    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    merge = processor.image_processor.merge_size
    outputs = []
    for image, grid in ((tiny_image(0), [1, 4, 4]), (tiny_image(1), [1, 4, 4]), (tiny_image(0, size=(200, 120)), None)):
        inputs = processor(text=[text], images=[image], return_tensors="pt")
        thw = inputs["image_grid_thw"][0].tolist()
        if grid is not None:
            assert thw == grid, "56x56 is 4x4 patches of 14"
        else:  # 200x120 is over max_pixels: resized to 140x84, 10x6 patches
            assert thw == [1, 6, 10]
        ids = inputs["input_ids"][0]
        assert int((ids == processor.image_token_id).sum()) == thw[0] * thw[1] * thw[2] // merge**2
        assert inputs["pixel_values"].shape[0] == thw[0] * thw[1] * thw[2]
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        new = out[0, ids.shape[0] :].tolist()
        assert len(new) > 0
        outputs.append(new)
    assert outputs[0] != outputs[1], "different images give different greedy outputs"


def test_auto_processor() -> None:
    import transformers

    path = tiny_vlm_dir()
    if not HAS_TORCHVISION:
        # Image processor and tokenizer load; only the video processor needs torchvision (see _processor).
        with pytest.raises(ImportError, match="VideoProcessor requires the Torchvision"):
            transformers.AutoProcessor.from_pretrained(path)
        return
    processor = transformers.AutoProcessor.from_pretrained(path)
    assert type(processor).__name__ == "Qwen2VLProcessor"
    assert processor.image_processor.merge_size == 2 and processor.image_processor.patch_size == 14
    assert processor.image_token == IMAGE_TOKEN


def test_tiny_vlm_dir_is_cached_and_images_are_seeded() -> None:
    from PIL import Image

    assert tiny_vlm_dir() == tiny_vlm_dir()
    image = tiny_image(5)
    assert image.mode == "RGB" and image.size == (56, 56)
    assert image.tobytes() == tiny_image(5).tobytes() != tiny_image(6).tobytes()
    png = tiny_image_png(5, size=(28, 42))
    assert png.startswith(b"\x89PNG") and png == tiny_image_png(5, size=(28, 42))
    with Image.open(io.BytesIO(png)) as decoded:
        assert decoded.size == (28, 42) and decoded.convert("RGB").tobytes() == tiny_image(5, size=(28, 42)).tobytes()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "int8"}, "dtype"),
        ({"hidden_size": 100}, "hidden_size"),
        ({"num_heads": 3}, "hidden_size"),
        ({"vision_embed_dim": 100}, "vision_embed_dim"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"seed": 1.5}, "seed"),
        ({"vision_depth": 0}, "vision_depth"),
    ],
)
def test_rejects_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        build_tiny_vlm(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()
