"""GPU: a user's script that builds a real SGLang or vLLM engine exits within 10 s of its last line.

Each case runs this file as a script (a ``__main__`` guard, the engine's defaults plus the machine's settings
from ``$GENENGINE_SGLANG_OPTIONS``), as a user would: build the engine, generate, optionally stream through the
async layer, optionally call ``shutdown()`` (keeping the reference), print ``LAST_LINE`` and end. The test
times the gap between that line and the process's exit. A script that has not exited 10 s after its last
line dumps every thread's stack (``faulthandler``) and its live children into its output, so a failure says
what held it (a non-daemon thread, an atexit join, a child holding a pipe).

The four cases run side by side on the one GPU (``GENENGINE_EXIT_PARALLEL=0``: one after the other, at the
engine's memory defaults): each engine is told it shares the GPU (a small KV cache: SGLang's
``max_total_tokens``, vLLM's ``mem_util`` and ``kv_cache_memory_bytes``; its own ports; for vLLM its own
copy of the model folder, so that no two compile into one cache entry). Memory sizing is not what is tested
here, and one case at a time took four engine starts end to end (~170 s of a verify call).

    bash tools/gpu/run_tests.sh sglang tests/gpu/test_exit_gpu.py
    bash tools/gpu/run_tests.sh vllm tests/gpu/test_exit_gpu.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve()
EXIT_BOUND_S = 10.0
"""From the script's last line to its exit (the issue's bound)."""
SCRIPT_TIMEOUT_S = 240.0
"""The whole script: engine start (JIT compiles on a cold machine), a few generates, the exit."""
CASES = [(use_async, shutdown) for use_async in (False, True) for shutdown in (True, False)]
PARALLEL = os.environ.get("GENENGINE_EXIT_PARALLEL", "1") != "0"
"""The cases side by side on the GPU (the default), or one after the other at the engine's memory defaults."""


# ---- the user's script ------------------------------------------------------------------------------------------
def _script(backend: str, model: str, use_async: bool, shutdown: bool, options: dict[str, Any]) -> None:
    import asyncio
    import faulthandler

    import genengine

    engine = genengine.create_engine(backend=backend, model=model, **options)
    params = genengine.SamplingParams(temperature=0.0, max_new_tokens=8)
    out = engine.generate(["The quick brown fox"], params)
    assert out[0].outputs[0].token_ids, out
    if use_async:

        async def main() -> None:
            stream = engine.stream("Once upon a time", params)
            async for _ in stream:
                pass
            assert stream.result().outputs[0].token_ids
            await engine.generate_async("Hello", params)

        asyncio.run(main())
    if shutdown:
        engine.shutdown()  # the name stays bound, as in a trainer's ``with`` block or attribute
    # A hang after the last line prints every thread's stack and the children still there, then ends the process.
    faulthandler.dump_traceback_later(EXIT_BOUND_S + 2.0, exit=True)
    _report_children_after(EXIT_BOUND_S + 1.0)
    print(f"LAST_LINE {time.time():.3f}", flush=True)


def _report_children_after(delay_s: float) -> None:
    import threading

    def report() -> None:
        time.sleep(delay_s)
        me = os.getpid()
        kids = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    stat = fh.read()
                if int(stat[stat.rfind(")") + 2 :].split()[1]) == me:
                    with open(f"/proc/{pid}/cmdline", "rb") as fh:
                        cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
                    kids.append(f"{pid}: {cmdline[:200]}")
            except (OSError, ValueError):
                continue
        names = [f"{t.name} (daemon={t.daemon})" for t in threading.enumerate()]
        print(f"EXIT_HELD threads={names} children={kids}", file=sys.stderr, flush=True)

    threading.Thread(target=report, daemon=True, name="exit-report").start()


# ---- the test -------------------------------------------------------------------------------------------------------
def _sharing(backend: str, index: int) -> tuple[dict[str, Any], dict[str, str]]:
    """Engine options and environment for case ``index`` of several on one GPU: a small KV cache, own ports."""
    if backend == "sglang":  # KV pool capped (SGLang sizes it from the free memory otherwise); ports apart
        return {"max_total_tokens": 65536, "base_port": 41000 + 500 * index}, {}
    # vLLM: each asks for 15 % of the device at start (it checks that much is free) and a fixed 256 MiB KV
    # cache, which skips its profiling (it would count the other cases' allocations as its own).
    return {"mem_util": 0.15, "kv_cache_memory_bytes": 256 << 20}, {"VLLM_PORT": str(52000 + 100 * index)}


@dataclass
class _Run:
    """One case's script: started by the module fixture, its exit timed by a thread of its own."""

    case: tuple[bool, bool]
    log: Path
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    waiter: threading.Thread | None = None

    def watch(self) -> None:
        def wait() -> None:
            try:
                self.proc.wait(timeout=SCRIPT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.ended = time.time()  # when it exited, whatever the test is doing meanwhile

        self.waiter = threading.Thread(target=wait, daemon=True, name=f"exit-wait-{self.case}")
        self.waiter.start()


def _start(backend: str, model: str, use_async: bool, shutdown: bool, index: int | None) -> _Run:
    options, env = _sharing(backend, index) if index is not None else ({}, {})
    if index is not None and backend == "vllm":  # vLLM's compile cache is keyed by the model's path
        copy = Path(model).parent / f"exit-case-{index}"
        if not copy.exists():
            shutil.copytree(model, copy)
        model = str(copy)
    cmd = [sys.executable, str(HERE), "--backend", backend, "--model", model, "--options", json.dumps(options)]
    cmd += ["--async"] * use_async + ["--shutdown"] * shutdown
    # Output to files, not pipes: a leftover grandchild holding a pipe would make the test wait on it.
    log = Path(os.environ.get("OUT", "/tmp")) / f"exit_{backend}_async{int(use_async)}_shutdown{int(shutdown)}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **env}
        )
    run = _Run((use_async, shutdown), log, proc)
    run.watch()
    return run


@pytest.fixture(scope="module")
def setup() -> dict[str, Any]:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from support.gpu_checks import installed_engine

    backend = installed_engine("GENENGINE_EXIT_BACKEND")
    if backend is None:
        pytest.skip("needs sglang or vllm")
    from genengine.models.tiny_model import tiny_model_dir

    return {"backend": backend, "model": str(tiny_model_dir())}


@pytest.fixture(scope="module")
def runs(setup: dict[str, Any]) -> Any:
    """With ``PARALLEL``, every case's script started at once; otherwise none (each test starts its own)."""
    started: dict[tuple[bool, bool], _Run] = {}
    if PARALLEL:
        for index, (use_async, shutdown) in enumerate(CASES):
            started[(use_async, shutdown)] = _start(setup["backend"], setup["model"], use_async, shutdown, index)
    yield started
    for run in started.values():  # a test that failed early leaves no script behind
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()


@pytest.mark.gpu
@pytest.mark.parametrize(("use_async", "shutdown"), CASES, ids=lambda v: str(v))
def test_a_script_exits_within_10_s_of_its_last_line(
    setup: dict[str, Any], runs: dict[tuple[bool, bool], _Run], use_async: bool, shutdown: bool
) -> None:
    run = runs.get((use_async, shutdown)) or _start(setup["backend"], setup["model"], use_async, shutdown, None)
    assert run.waiter is not None
    run.waiter.join()
    assert run.ended is not None
    text = run.log.read_text(errors="replace")
    last = [line for line in text.splitlines() if line.startswith("LAST_LINE ")]
    tail = text[-6000:]
    took = time.monotonic() - run.started
    rc = run.proc.returncode
    assert last, f"the script never reached its last line in {took:.0f} s (rc {rc}):\n{tail}"
    gap = run.ended - float(last[-1].split()[1])
    case = f"backend={setup['backend']} async={use_async} shutdown={shutdown} parallel={PARALLEL}"
    print(f"EXIT_GAP {case}: {gap:.2f} s after the last line, {took:.0f} s in all (rc {rc})")
    assert gap <= EXIT_BOUND_S and "EXIT_HELD" not in text, f"exited {gap:.1f} s after its last line:\n{tail}"
    assert rc == 0, f"rc {rc}:\n{tail}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--async", dest="use_async", action="store_true")
    parser.add_argument("--shutdown", action="store_true")
    parser.add_argument("--options", default="{}", help="engine options (JSON), for a GPU shared with other cases")
    args = parser.parse_args()
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(key, value)
    _script(args.backend, args.model, args.use_async, args.shutdown, json.loads(args.options))
