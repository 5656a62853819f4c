"""The engine's weights by HF name, shape and dtype, read without loading a single tensor.

``load_weights`` checks every name and shape against this list before a byte is written (silent name
mismatches degrade training: LightRFT PR #55). It comes from the checkpoint's safetensors headers (what
vLLM itself loads at start-up); a directory without weights (``load_format="dummy"``) falls back to the
HF model built on the meta device from ``config.json``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from genengine.errors import ConfigError
from genengine.weights import WeightInfo

__all__ = ["read_safetensors_header", "text_config", "vocab_size", "weight_spec"]

_MAX_HEADER = 256 << 20
_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
# Buffers some checkpoints carry that vLLM recomputes and skips on load: a trainer never needs to send them.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config (VLM configs nest it under ``text_config``)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


def vocab_size(config: Mapping[str, Any]) -> int | None:
    value = config.get("vocab_size", text_config(config).get("vocab_size"))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def read_safetensors_header(path: str | Path) -> dict[str, dict[str, Any]]:
    """The tensor table of one safetensors file: 8-byte length, then JSON; tensors are not read."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ConfigError(f"{path} is not a safetensors file (shorter than its header length)")
        (size,) = struct.unpack("<Q", raw)
        if size > _MAX_HEADER:
            raise ConfigError(f"{path}: safetensors header of {size} bytes is implausible")
        try:
            header = json.loads(fh.read(size))
        except ValueError as exc:
            raise ConfigError(f"{path}: unreadable safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{index}: unreadable safetensors index: {exc}") from exc
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    return sorted(model_dir.glob("*.safetensors"))


def _from_headers(files: list[Path], dtype: str) -> dict[str, WeightInfo]:
    spec: dict[str, WeightInfo] = {}
    for f in files:
        for name, entry in read_safetensors_header(f).items():
            floating = entry.get("dtype") in _ST_DTYPES
            spec[name] = WeightInfo(
                shape=tuple(int(d) for d in entry.get("shape", ())),
                dtype=dtype if floating else str(entry.get("dtype")),
                required=floating,  # integer buffers (e.g. quantisation metadata) cannot come from a trainer
            )
    return spec


def _from_meta_model(model_dir: Path, dtype: str) -> dict[str, WeightInfo]:
    import torch
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ConfigError(f"{model_dir} has no *.safetensors and transformers cannot read its config: {exc}") from exc
    errors = []
    for auto in ("AutoModelForCausalLM", "AutoModelForImageTextToText"):
        try:
            with torch.device("meta"):
                model = getattr(transformers, auto).from_config(config)
        except Exception as exc:
            errors.append(f"{auto}: {exc}")
            continue
        return {name: WeightInfo(tuple(t.shape), dtype) for name, t in model.state_dict().items()}
    raise ConfigError(f"{model_dir} has no *.safetensors and no HF model class fits its config: {'; '.join(errors)}")


def weight_spec(model_dir: str | Path, config: Mapping[str, Any], dtype: str) -> dict[str, WeightInfo]:
    """Every HF weight name the engine takes, with shape, and whether a full load must include it.

    A tied ``lm_head.weight`` is accepted but optional: trainers' ``state_dict()`` contains it and vLLM
    skips it (the embedding is the head).
    """
    root = Path(model_dir)
    files = _checkpoint_files(root)
    spec = _from_headers(files, dtype) if files else _from_meta_model(root, dtype)
    if not spec:
        raise ConfigError(f"{root}: the checkpoint lists no tensors")
    for name, info in list(spec.items()):
        if name.endswith(_SKIPPED_SUFFIXES):
            spec[name] = WeightInfo(info.shape, info.dtype, required=False)
    tied = text_config(config).get("tie_word_embeddings", config.get("tie_word_embeddings"))
    head = "lm_head.weight"
    embed = next((n for n in sorted(spec) if n.endswith("embed_tokens.weight")), None)
    if head not in spec and embed is not None:
        spec[head] = WeightInfo(spec[embed].shape, dtype, required=False)
    elif head in spec and tied is True:
        spec[head] = WeightInfo(spec[head].shape, spec[head].dtype, required=False)
    return spec
