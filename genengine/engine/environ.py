"""Process facts every backend needs: the CUDA allocator setting sleep cannot live with, environment changes
that end when the engine's start-up does, and handing freed heap back to the OS."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator, Mapping

__all__ = ["ALLOC_CONF", "malloc_trim", "scoped_environ", "strip_expandable_segments"]

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
"""The environment variable of the CUDA allocator's settings (see :func:`strip_expandable_segments`)."""


def strip_expandable_segments(conf: str | None) -> str | None:
    """``PYTORCH_CUDA_ALLOC_CONF`` without ``expandable_segments:True``; None when nothing is left.

    Memory allocated with expandable segments cannot be released by the engines' sleep allocators (vLLM's
    pluggable allocator is bypassed; torch_memory_saver disables itself when the string is present): sleep
    would free nothing. Every other setting, ``expandable_segments:False`` included, is kept.
    """
    if conf is None:
        return None
    kept = []
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments" and value.strip().lower() in ("true", "1"):
            continue
        if item.strip():
            kept.append(item.strip())
    return ",".join(kept) or None


@contextlib.contextmanager
def scoped_environ(changes: Mapping[str, str | None]) -> Iterator[None]:
    """Set (a str) or remove (None) environment variables for the ``with`` block; restore them after, even
    on error, so an engine's start-up leaves the trainer's environment as it found it."""
    saved = {key: os.environ.get(key) for key in changes}
    try:
        for key, value in changes.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def malloc_trim() -> None:
    """Return freed heap to the OS (glibc keeps it otherwise), so a host-memory reading shows what was freed."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
