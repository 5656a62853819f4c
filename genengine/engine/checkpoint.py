"""The facts every backend reads from a Hugging Face model directory, once: its path, ``config.json``, the
language model's part of the config, the vocabulary size, the dtype the engine keeps (``torch_dtype`` as a torch
dtype), and the weight spec: of the checkpoint, or of a model already loaded (``module_weight_spec``).

The weight spec (HF name → shape, dtype, required) is what ``load_weights`` checks every tensor against
before an engine sees a byte: engines' own loaders silently skip names they do not know (LightRFT PR #55).
It comes from the safetensors headers (a few KB per file, no tensor is read); a directory with only a
``config.json`` (``load_format="dummy"``) falls back to the HF model built on the meta device.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from genengine.errors import CheckpointError, ConfigError
from genengine.weights import WeightInfo

if TYPE_CHECKING:
    import torch

__all__ = [
    "FLOAT_DTYPES",
    "MAX_HEADER_BYTES",
    "checkpoint_dtype",
    "checkpoint_files",
    "engine_dtype",
    "module_weight_spec",
    "read_model_config",
    "read_safetensors_header",
    "resolve_model_dir",
    "text_config",
    "tied_embeddings",
    "torch_dtype",
    "vocab_size",
    "weight_spec",
]

MAX_HEADER_BYTES = 100_000_000
"""The safetensors library's own cap on a header: a larger length means a corrupt or foreign file."""

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

# Buffers some checkpoints carry that engines recompute and skip on load: a trainer never needs to send them.
_RECOMPUTED = re.compile(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$")


# ---- the directory and its config ----------------------------------------------------------------------------
def _from_hf_cache(model_id: str) -> str | None:
    """The snapshot directory of a Hugging Face id already in the local cache (nothing is downloaded)."""
    if model_id.count("/") != 1 or model_id.startswith(("/", ".")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model_id, "config.json")
    except Exception:
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


def resolve_model_dir(model: Any, *, what: str = "model", error: type[Exception] = ConfigError) -> str:
    """The model's local directory (absolute); raises ``error`` unless it holds a ``config.json``.

    A Hugging Face id is accepted when the model is already in the local cache: colocated RL runs offline,
    so a typo fails here instead of in an engine process waiting on the network.
    """
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str) or not model:
        raise error(f"{what}={model!r} must be a non-empty path to a model directory")
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise error(f"{what}={model!r} has no config.json: it is not a Hugging Face model directory")
        return os.path.abspath(model)
    if os.path.exists(model):
        raise error(f"{what}={model!r} is a file; give the model's directory")
    cached = _from_hf_cache(model)
    if cached is not None:
        return cached
    raise error(
        f"{what}={model!r} does not exist: give a local model directory (with config.json) or the id of a "
        "model already in the Hugging Face cache (nothing is downloaded)"
    )


def read_model_config(model_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of a model directory, as a dict."""
    path = Path(model_dir) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config (VLM configs nest it under ``text_config``)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


def _get(config: Mapping[str, Any], key: str) -> Any:
    return config.get(key, text_config(config).get(key))


def vocab_size(config: Mapping[str, Any]) -> int | None:
    value = _get(config, "vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def tied_embeddings(config: Mapping[str, Any]) -> bool:
    """Whether the output head is the input embedding (``tie_word_embeddings``, the language model's first)."""
    value = text_config(config).get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return value is True


def checkpoint_dtype(config: Mapping[str, Any]) -> str | None:
    """The floating dtype the config says the checkpoint holds (``torch_dtype``, or ``dtype`` in newer
    transformers); None when it says none."""
    for key in ("torch_dtype", "dtype"):
        value = _get(config, key)
        if isinstance(value, str) and value.removeprefix("torch.") in FLOAT_DTYPES:
            return value.removeprefix("torch.")
    return None


def engine_dtype(dtype: str, config: Mapping[str, Any]) -> str:
    """The dtype the engine keeps floating weights in ("auto" follows the checkpoint's config, else bf16)."""
    if dtype != "auto":
        return dtype
    return checkpoint_dtype(config) or "bfloat16"


def torch_dtype(dtype: str, model_dir: str) -> torch.dtype:
    """``EngineConfig.dtype`` as a torch dtype; "auto" is what ``config.json`` names (float32 if nothing)."""
    import torch

    if dtype == "auto":
        dtype = checkpoint_dtype(read_model_config(model_dir)) or "float32"
    found: torch.dtype = getattr(torch, dtype)
    return found


# ---- the weights ------------------------------------------------------------------------------------------
def read_safetensors_header(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name → (shape, dtype) of one .safetensors file, from its JSON header only (8-byte length, then JSON)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than its 8-byte header length")
            (size,) = struct.unpack("<Q", raw)
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"header of {size} bytes (the safetensors cap is {MAX_HEADER_BYTES})")
            header = json.loads(fh.read(size))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            out: dict[str, tuple[tuple[int, ...], str]] = {}
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                st_dtype = str(meta.get("dtype", ""))
                out[name] = (tuple(int(d) for d in meta["shape"]), _ST_DTYPES.get(st_dtype, st_dtype.lower()))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, struct.error) as exc:
        raise CheckpointError(f"cannot read the safetensors header of {path}: {exc}") from None
    return out


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The directory's safetensors files: those its index names (each must exist), else every one present."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({root / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"cannot read {index}: {exc}") from None
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    return sorted(root.glob("*.safetensors"))


def _meta_entries(model_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names and shapes of the model class, built on the meta device (no memory, no weight file)."""
    import torch
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:
        raise CheckpointError(f"{model_dir} has no *.safetensors and transformers cannot read it: {exc}") from None
    errors = []
    for auto in ("AutoModelForCausalLM", "AutoModelForImageTextToText"):
        cls = getattr(transformers, auto, None)
        if cls is None:
            continue
        try:
            with torch.device("meta"):
                model = cls.from_config(config)
        except Exception as exc:
            errors.append(f"{auto}: {exc}")
            continue
        return {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in model.state_dict().items()}
    raise CheckpointError(
        f"{model_dir} has no *.safetensors and its config builds no known model class ({'; '.join(errors)}): "
        "cannot tell which weights load_weights should accept"
    )


def _head_name(embed: str) -> str:
    """The output head's name beside an embedding (``model.embed_tokens.weight`` → ``lm_head.weight``)."""
    suffix = "model.embed_tokens.weight"
    return embed[: -len(suffix)] + "lm_head.weight" if embed.endswith(suffix) else "lm_head.weight"


def weight_spec(model_dir: str | Path, config: Mapping[str, Any], dtype: str) -> dict[str, WeightInfo]:
    """Every HF weight name the engine takes, with the shape it expects, the dtype it keeps it in, and whether
    a full load must include it.

    Optional: buffers engines recompute (rotary tables), non-float tensors (quantisation metadata cannot
    come from a trainer) and a tied output head. A head the checkpoint lacks is accepted as an alias of the
    embedding: trainers' ``state_dict()`` carries it, and engines skip it.
    """
    root = Path(model_dir)
    files = checkpoint_files(root)
    entries: dict[str, tuple[tuple[int, ...], str]] = {}
    if files:
        for path in files:
            entries.update(read_safetensors_header(path))
    else:
        entries = _meta_entries(root)
    if not entries:
        raise CheckpointError(f"{root}: the checkpoint lists no weights")
    keep = engine_dtype(dtype, config)
    tied = tied_embeddings(config)
    spec: dict[str, WeightInfo] = {}
    for name, (shape, st_dtype) in entries.items():
        floating = st_dtype in FLOAT_DTYPES
        optional = not floating or bool(_RECOMPUTED.search(name)) or (tied and name.endswith("lm_head.weight"))
        spec[name] = WeightInfo(shape=shape, dtype=keep if floating else st_dtype, required=not optional)
    if not any(name.endswith("lm_head.weight") for name in spec):
        for name, info in list(spec.items()):
            if name.endswith("embed_tokens.weight"):
                spec.setdefault(_head_name(name), WeightInfo(shape=info.shape, dtype=info.dtype, required=False))
    return spec


def module_weight_spec(module: torch.nn.Module, *, buffers: bool = True) -> dict[str, WeightInfo]:
    """``_weight_spec`` of a loaded torch model: every HF name of its state dict (only its parameters without
    ``buffers``), with the shape and dtype it has now.

    A name that is a second alias of a parameter already listed (a tied ``lm_head.weight``) is optional, as
    in :func:`weight_spec`: trainers' ``state_dict()`` carries it, but need not send it.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    source = module.state_dict() if buffers else params
    seen: set[int] = set()
    spec: dict[str, WeightInfo] = {}
    for name, tensor in source.items():
        param = params.get(name)
        required = param is None or id(param) not in seen
        spec[name] = WeightInfo(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), required=required)
        if param is not None:
            seen.add(id(param))
    return spec
