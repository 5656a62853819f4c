"""Input digests: what ``EngineGroup.check_consistent`` compares across the ranks of a TP group.

A digest hashes a value by content (dicts in any order, tensors by bytes), so equal inputs give equal
digests on every rank and one 32-byte message stands for a whole batch of prompts and parameters.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import pickle
import struct
from collections.abc import Mapping
from typing import Any

__all__ = ["input_digest"]


# --- input digests ---------------------------------------------------------------------------------------
def _feed(h: Any, value: object) -> None:
    """Hash ``value`` by content, not by identity or insertion order, so equal inputs match on every rank."""
    if value is None:
        h.update(b"N")
    elif isinstance(value, bool):
        h.update(b"B1" if value else b"B0")
    elif isinstance(value, enum.Enum):
        h.update(b"E" + type(value).__qualname__.encode() + b"." + value.name.encode())
    elif isinstance(value, int):
        h.update(b"I" + str(value).encode() + b";")
    elif isinstance(value, float):
        h.update(b"F" + value.hex().encode() + b";")
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        h.update(b"S" + struct.pack("<Q", len(data)) + data)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        h.update(b"Y" + struct.pack("<Q", len(data)) + data)
    elif isinstance(value, (list, tuple)):
        h.update((b"L" if isinstance(value, list) else b"T") + struct.pack("<Q", len(value)))
        for item in value:
            _feed(h, item)
    elif isinstance(value, Mapping):
        items = sorted((input_digest(k), v) for k, v in value.items())
        h.update(b"D" + struct.pack("<Q", len(items)))
        for key_digest, item in items:
            h.update(key_digest)
            _feed(h, item)
    elif isinstance(value, (set, frozenset)):
        digests = sorted(input_digest(v) for v in value)
        h.update(b"Z" + struct.pack("<Q", len(digests)) + b"".join(digests))
    elif type(value).__module__.startswith("torch") and hasattr(value, "untyped_storage"):
        t: Any = value
        t = t.detach().to("cpu").contiguous()
        h.update(b"X" + str(t.dtype).encode() + repr(tuple(t.shape)).encode())
        if t.numel():
            h.update(t.reshape(-1).view(_torch_uint8()).numpy().tobytes())
    elif type(value).__module__ == "numpy" and hasattr(value, "tobytes"):
        arr: Any = value
        h.update(b"A" + str(arr.dtype).encode() + repr(arr.shape).encode() + arr.tobytes())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        h.update(b"C" + type(value).__qualname__.encode())
        for f in dataclasses.fields(value):
            h.update(f.name.encode() + b"=")
            _feed(h, getattr(value, f.name))
    else:
        h.update(b"P" + pickle.dumps(value, protocol=4))


def _torch_uint8() -> Any:
    import torch

    return torch.uint8


def input_digest(value: object) -> bytes:
    """SHA-256 of ``value`` by content: dicts in any order, tensors by dtype, shape and bytes."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.digest()
