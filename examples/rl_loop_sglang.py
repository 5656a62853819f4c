"""The worked RL loop on SGLang, on GPUs (pip install 'genengine[sglang]').

    python examples/rl_loop_sglang.py [--model PATH]
    torchrun --nproc-per-node 2 examples/rl_loop_sglang.py --config my_tp2.yaml   # tp_size: 2 in the YAML

The trainer (the policy) and the engine share each GPU: the engine holds ``mem_util`` of it and sleeps
while the trainer steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rl_loop import main

CONFIG = Path(__file__).resolve().parent / "configs" / "sglang.yaml"

if __name__ == "__main__":
    main(config_file=str(CONFIG), device="cuda")
