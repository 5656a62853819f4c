"""Hides TRL from the processes of a verl 0.9.1 run (put this folder first on PYTHONPATH).

verl 0.9.1's FSDP workers patch ``AutoModelForCausalLMWithValueHead`` whenever ``trl`` is importable
(``verl/models/transformers/monkey_patch.py``); verl pins trl==0.27.0 for that (its ``fsdp`` extra) and TRL 1.16
no longer has the class, so with TRL 1.16 installed (the GPU kit carries it for the TRL parts) the actor dies at
init. A finder that refuses ``trl`` makes verl's own ``is_trl_available()`` say no, as on a machine without TRL.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any


class _NoTRL(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> Any:
        if name == "trl" or name.startswith("trl."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden for verl 0.9.1)", name=name)
        return None


sys.meta_path.insert(0, _NoTRL())
