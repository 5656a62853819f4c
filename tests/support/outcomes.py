"""What a worker process of the multi-process tests reports: its value, or its exception's type, message and
base classes (the exception itself may not pickle), so a test can assert what each rank saw."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Result"]


@dataclass
class Result:
    rank: int
    status: str  # "ok", "err" or "died"
    value: Any = None
    error_type: str = ""
    message: str = ""
    mro: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    in_setup: bool = False  # it failed setting its process group up, before the scenario ran

    def raised(self, name: str) -> bool:
        return self.status == "err" and name in self.mro
