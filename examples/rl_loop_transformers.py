"""The worked RL loop on the embedded backend, on the CPU: ``python examples/rl_loop_transformers.py``.

Runs anywhere in a few seconds (it builds a tiny random model unless given ``--model PATH``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rl_loop import main

CONFIG = Path(__file__).resolve().parent / "configs" / "transformers.yaml"

if __name__ == "__main__":
    main(config_file=str(CONFIG), device="cpu")
