"""The engine's list of weights (HF name → shape, dtype), read from the checkpoint without loading it.

``load_weights`` checks every name and shape against this list before SGLang sees a byte: SGLang's own
``load_weights`` silently ignores names it does not know (the LightRFT PR #55 bug). The list comes from the
safetensors headers (a few KB per file); a directory with only a config.json (``load_format="dummy"``)
falls back to the model class built on the meta device, which allocates nothing.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from typing import Any

from genengine.errors import InvalidArgumentError
from genengine.weights import WeightInfo

__all__ = ["FLOAT_DTYPES", "checkpoint_weight_spec", "engine_dtype", "read_safetensors_header", "vocab_size"]

_ST_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I8": "int8",
    "U8": "uint8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "BOOL": "bool",
}
FLOAT_DTYPES = frozenset({"bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"})

# Entries a trainer's named_parameters() does not carry, which the engine can do without.
_OPTIONAL = re.compile(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$")


def read_safetensors_header(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name → (shape, dtype) of one .safetensors file, from its JSON header only."""
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > 100 << 20:
                raise ValueError(f"header of {length} bytes")
            header = json.loads(fh.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise InvalidArgumentError(f"cannot read the safetensors header of {path}: {exc}") from None
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(meta.get("dtype", ""), str(meta.get("dtype", "")).lower())
        out[name] = (tuple(int(d) for d in meta["shape"]), dtype)
    return out


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    sub = config.get("text_config")
    return sub if isinstance(sub, Mapping) else config


def vocab_size(config: Mapping[str, Any]) -> int | None:
    value = config.get("vocab_size", _text_config(config).get("vocab_size"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def engine_dtype(dtype: str, config: Mapping[str, Any]) -> str:
    """The dtype the engine keeps floating weights in ("auto" follows the checkpoint's config)."""
    if dtype != "auto":
        return dtype
    for key in ("torch_dtype", "dtype"):
        value = config.get(key, _text_config(config).get(key))
        if isinstance(value, str) and value in FLOAT_DTYPES:
            return value
    return "bfloat16"


def _tied(config: Mapping[str, Any]) -> bool:
    value = config.get("tie_word_embeddings", _text_config(config).get("tie_word_embeddings", False))
    return bool(value)


def _checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh)["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise InvalidArgumentError(f"cannot read {index}: {exc}") from None
        return sorted({os.path.join(model_dir, f) for f in weight_map.values()})
    return sorted(os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors"))


def _meta_entries(model_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names and shapes of the model class, built on the meta device (no memory, no weight file)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    errors = []
    for auto in ("AutoModelForCausalLM", "AutoModelForImageTextToText"):
        cls = getattr(transformers, auto, None)
        if cls is None:
            continue
        try:
            with torch.device("meta"):
                model = cls.from_config(config)
        except (ValueError, KeyError, TypeError) as exc:
            errors.append(f"{auto}: {exc}")
            continue
        return {
            name: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for name, t in model.state_dict().items()
            if t.is_floating_point()
        }
    raise InvalidArgumentError(
        f"{model_dir} has no .safetensors files and its config builds no known model class ({'; '.join(errors)}): "
        "cannot tell which weights load_weights should accept"
    )


def checkpoint_weight_spec(model_dir: str, dtype: str, config: Mapping[str, Any]) -> dict[str, WeightInfo]:
    """Every weight name the engine accepts, with the shape it expects and the dtype it keeps it in."""
    files = _checkpoint_files(model_dir)
    entries: dict[str, tuple[tuple[int, ...], str]] = {}
    if files:
        for path in files:
            entries.update(read_safetensors_header(path))
    else:
        entries = _meta_entries(model_dir)
    keep_dtype = engine_dtype(dtype, config)
    tied = _tied(config)
    spec: dict[str, WeightInfo] = {}
    for name, (shape, st_dtype) in entries.items():
        optional = bool(_OPTIONAL.search(name)) or (tied and name.endswith("lm_head.weight"))
        spec[name] = WeightInfo(
            shape=shape, dtype=keep_dtype if st_dtype in FLOAT_DTYPES else st_dtype, required=not optional
        )
    if tied:
        # Trainers' state_dict() carries the tied head too; accept it without requiring it.
        for name, info in list(spec.items()):
            if name.endswith("embed_tokens.weight"):
                head = name[: -len("model.embed_tokens.weight")] + "lm_head.weight"
                if name.endswith("model.embed_tokens.weight") and head not in spec:
                    spec[head] = WeightInfo(shape=info.shape, dtype=info.dtype, required=False)
    if not spec:
        raise InvalidArgumentError(f"{model_dir}: the checkpoint lists no weights")
    return spec
