"""Loaded by every Python process of a verl run that ``tests/gpu/test_verl_gpu.py`` starts (this folder first on
PYTHONPATH: the driver, Ray's workers and the engines' children inherit it). Two jobs, each by its variable:

``GENENGINE_HIDE_TRL=1`` hides TRL. verl 0.9.1's FSDP workers patch ``AutoModelForCausalLMWithValueHead``
whenever ``trl`` is importable (``verl/models/transformers/monkey_patch.py``); verl pins trl==0.27.0 for that (its
``fsdp`` extra) and TRL 1.16 no longer has the class, so with TRL 1.16 installed (the GPU kit carries it for the
TRL parts) the actor dies at init. A finder that refuses ``trl`` makes verl's own ``is_trl_available()`` say no,
as on a machine without TRL.

``GENENGINE_STACKS_DIR=DIR``: SIGUSR1 writes every thread's stack to ``DIR/stacks-PID.txt`` (faulthandler), so
that a run that never ends says where each of its processes was (the test signals them before it kills the run).
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any


class _NoTRL(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> Any:
        if name == "trl" or name.startswith("trl."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden for verl 0.9.1)", name=name)
        return None


if os.environ.get("GENENGINE_HIDE_TRL") == "1":
    sys.meta_path.insert(0, _NoTRL())

_stacks = os.environ.get("GENENGINE_STACKS_DIR")
if _stacks:
    try:
        import faulthandler
        import signal

        os.makedirs(_stacks, exist_ok=True)
        _sink = open(os.path.join(_stacks, f"stacks-{os.getpid()}.txt"), "a")  # noqa: SIM115 (the process's life)
        _sink.write(f"{os.getpid()} {' '.join(sys.argv)[:300]}\n")
        _sink.flush()
        faulthandler.register(signal.SIGUSR1, file=_sink, all_threads=True)
    except Exception:  # a diagnostic: never the reason a process fails to start
        pass
