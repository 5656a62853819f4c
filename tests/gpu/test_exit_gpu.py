"""GPU: a user's script that builds a real SGLang or vLLM engine exits within 10 s of its last line.

Each case runs this file as a script (a ``__main__`` guard, the engine's defaults plus the machine's settings
from ``$GENENGINE_SGLANG_OPTIONS``), as a user would: build the engine, generate, optionally stream through the
async layer, optionally call ``shutdown()`` (keeping the reference), print ``LAST_LINE`` and end. The test
times the gap between that line and the process's exit. A script that has not exited 10 s after its last
line dumps every thread's stack (``faulthandler``) and its live children into its output, so a failure says
what held it (a non-daemon thread, an atexit join, a child holding a pipe).

    bash tools/gpu/run_tests.sh sglang tests/gpu/test_exit_gpu.py
    bash tools/gpu/run_tests.sh vllm tests/gpu/test_exit_gpu.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve()
EXIT_BOUND_S = 10.0
"""From the script's last line to its exit (the issue's bound)."""
SCRIPT_TIMEOUT_S = 240.0
"""The whole script: engine start (JIT compiles on a cold machine), a few generates, the exit."""
CASES = [(use_async, shutdown) for use_async in (False, True) for shutdown in (True, False)]


# ---- the user's script ------------------------------------------------------------------------------------------
def _script(backend: str, model: str, use_async: bool, shutdown: bool) -> None:
    import asyncio
    import faulthandler

    import genengine

    engine = genengine.create_engine(backend=backend, model=model)
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
@pytest.fixture(scope="module")
def setup() -> dict[str, Any]:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from support.gpu_checks import installed_engine

    backend = installed_engine("GENENGINE_EXIT_BACKEND")
    if backend is None:
        pytest.skip("needs sglang or vllm")
    from genengine.testing.tiny_model import tiny_model_dir

    return {"backend": backend, "model": str(tiny_model_dir())}


@pytest.mark.gpu
@pytest.mark.parametrize(("use_async", "shutdown"), CASES, ids=lambda v: str(v))
def test_a_script_exits_within_10_s_of_its_last_line(setup: dict[str, Any], use_async: bool, shutdown: bool) -> None:
    cmd = [sys.executable, str(HERE), "--backend", setup["backend"], "--model", setup["model"]]
    cmd += ["--async"] * use_async + ["--shutdown"] * shutdown
    # Output to files, not pipes: a leftover grandchild holding a pipe would make the test wait on it.
    log = (
        Path(os.environ.get("OUT", "/tmp"))
        / f"exit_{setup['backend']}_async{int(use_async)}_shutdown{int(shutdown)}.log"
    )
    start = time.monotonic()
    with open(log, "w+") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            proc.wait(timeout=SCRIPT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        ended = time.time()
        fh.seek(0)
        text = fh.read()
    last = [line for line in text.splitlines() if line.startswith("LAST_LINE ")]
    tail = text[-6000:]
    took = time.monotonic() - start
    assert last, f"the script never reached its last line in {took:.0f} s (rc {proc.returncode}):\n{tail}"
    gap = ended - float(last[-1].split()[1])
    case = f"backend={setup['backend']} async={use_async} shutdown={shutdown}"
    print(f"EXIT_GAP {case}: {gap:.2f} s after the last line, {took:.0f} s in all (rc {proc.returncode})")
    assert gap <= EXIT_BOUND_S and "EXIT_HELD" not in text, f"exited {gap:.1f} s after its last line:\n{tail}"
    assert proc.returncode == 0, f"rc {proc.returncode}:\n{tail}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--async", dest="use_async", action="store_true")
    parser.add_argument("--shutdown", action="store_true")
    args = parser.parse_args()
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(key, value)
    _script(args.backend, args.model, args.use_async, args.shutdown)
