"""A fault switch inside Ray workers, installed by ``ray.init(runtime_env={"worker_process_setup_hook": ...})``.

Write a tensor's name to ``$GENENGINE_TEST_FAULTS_DIR/fail-weight`` and the first replica to write a bucket
holding that tensor fails there, after its earlier buckets were written: a load that fails mid-write, as a
GPU engine's does when it runs out of memory. The embedded engine checks a whole stream before writing,
so no bad input can do that on the CPU. One process claims the switch (by renaming it), so one replica
of a pool fails and the others load.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ENV = "GENENGINE_TEST_FAULTS_DIR"


def install() -> None:
    from genengine.backends.transformers import TransformersEngine

    original = TransformersEngine._apply_weights

    def _apply_weights(self: Any, bucket: list[tuple[str, Any]]) -> None:
        directory = os.environ.get(ENV)
        if directory:
            switch = Path(directory) / "fail-weight"
            try:
                name = switch.read_text()
                if name in {n for n, _ in bucket}:
                    switch.rename(Path(directory) / f"claimed-by-{os.getpid()}")  # one process wins
                    raise RuntimeError(f"injected fault while writing the bucket holding {name!r}")
            except FileNotFoundError:
                pass  # no switch, or another replica claimed it
        original(self, bucket)

    TransformersEngine._apply_weights = _apply_weights  # type: ignore[method-assign]
