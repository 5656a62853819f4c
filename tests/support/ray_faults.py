"""Fault switches inside Ray workers, installed by ``ray.init(runtime_env={"worker_process_setup_hook": ...})``.

Write a tensor's name to ``$GENENGINE_TEST_FAULTS_DIR/fail-weight`` and the first replica to write a bucket
holding that tensor fails there, after its earlier buckets were written: a load that fails mid-write, as a
GPU engine's does when it runs out of memory. The embedded engine checks a whole stream before writing,
so no bad input can do that on the CPU.

Write a tensor's name to ``$GENENGINE_TEST_FAULTS_DIR/die-weight`` and the first replica to write a bucket holding
that tensor kills its own process there: a replica lost in the middle of a weight sync.

Create ``$GENENGINE_TEST_FAULTS_DIR/die-in-generate`` and the first replica to enter ``generate`` kills its
own process there: a replica that dies during a call, by construction (no race with the call's end).

One process claims a switch (by renaming it), so one replica of a pool fails and the others go on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ENV = "GENENGINE_TEST_FAULTS_DIR"


def _claim(switch: Path) -> bool:
    """Whether this process took ``switch`` (renamed it); False when there is none or another took it."""
    try:
        switch.rename(switch.with_name(f"claimed-{switch.name}-by-{os.getpid()}"))
    except FileNotFoundError:
        return False
    return True


def install() -> None:
    from genengine.backends.transformers.engine import TransformersEngine

    original = TransformersEngine._apply_weights
    original_generate = TransformersEngine.generate

    def _apply_weights(self: Any, bucket: list[tuple[str, Any]], session: Any) -> None:
        directory = os.environ.get(ENV)
        if directory:
            switch = Path(directory) / "fail-weight"
            try:
                name = switch.read_text()
            except FileNotFoundError:
                name = None  # no switch, or another replica claimed it
            if name is not None and name in {n for n, _ in bucket} and _claim(switch):
                raise RuntimeError(f"injected fault while writing the bucket holding {name!r}")
            doomed = Path(directory) / "die-weight"
            try:
                name = doomed.read_text()
            except FileNotFoundError:
                name = None
            if name is not None and name in {n for n, _ in bucket} and _claim(doomed):
                os._exit(20)  # the replica's process dies writing this bucket of a sync
        original(self, bucket, session)

    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        directory = os.environ.get(ENV)
        if directory and _claim(Path(directory) / "die-in-generate"):
            os._exit(19)  # the replica's process dies inside the call
        return original_generate(self, *args, **kwargs)

    TransformersEngine._apply_weights = _apply_weights  # type: ignore[method-assign]
    TransformersEngine.generate = generate  # type: ignore[method-assign]
