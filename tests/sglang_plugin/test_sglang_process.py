"""The sglang plugin's processes on the CPU (no SGLang needed): the engine processes' environment, SIGTERM
reaching the trainer, errors reaching every rank of real gloo groups (two processes), and SGLang's sockets
closed at shutdown.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest
from support.ports import free_port
from support.start import worker_context

from genengine_sglang._process import engine_environment

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
needs_no_sglang = pytest.mark.skipif(HAS_SGLANG, reason="checks what happens when SGLang is missing")


# ---- the engine processes' environment --------------------------------------------------------------------------
def test_engine_environment_is_scoped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    method = mp.get_start_method(allow_none=True)
    with engine_environment(enable_sleep=True):
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
        assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
        os.environ["NCCL_CUMEM_ENABLE"] = "0"  # what SGLang's start-up does to this process
        mp.set_start_method("spawn", force=True)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:64"
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert "NCCL_CUMEM_ENABLE" not in os.environ
    assert mp.get_start_method(allow_none=True) == method
    with engine_environment(enable_sleep=False):
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:64"


_SIGTERM_TRAINER = """
import asyncio, signal, sys, time
from genengine_sglang._process import return_sigterm
mode = sys.argv[1]
if mode == "own-handler":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))  # the trainer's own checkpoint-and-exit handler
before = signal.getsignal(signal.SIGTERM)
loop = asyncio.new_event_loop()
loop.add_signal_handler(signal.SIGTERM, lambda: None)  # what SGLang's tokenizer manager does on first use
if mode != "sglang-as-is":
    return_sigterm(loop, before)
print("READY", flush=True)
time.sleep(60)  # training: the engine's loop does not run
"""


@pytest.mark.parametrize(("mode", "want"), [("default", -signal.SIGTERM), ("own-handler", 3), ("sglang-as-is", None)])
def test_sigterm_reaches_a_trainer_between_engine_calls(mode: str, want: int | None) -> None:
    """SGLang's loop-bound SIGTERM handler would swallow SIGTERM while the trainer trains (the control shows
    it: the process is still alive); after return_sigterm the trainer's own disposition acts at once."""
    proc = subprocess.Popen([sys.executable, "-c", _SIGTERM_TRAINER, mode], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = proc.wait(timeout=3 if want is None else 20)
        except subprocess.TimeoutExpired:
            code = None
        assert code == want
    finally:
        proc.kill()
        proc.wait()


# ---- real process groups ------------------------------------------------------------------------------------------
def _scenario(rank: int, world: int, port: int, model: str, out: Any) -> None:
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}
    )
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GENENGINE_COLLECTIVE_TIMEOUT_S": "60"})
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    results: dict[str, Any] = {}
    try:
        import torch.distributed as dist

        from genengine_sglang import get_sglang_engine
        from genengine_sglang.lightrft import RLGenerationEngine

        dist.init_process_group("gloo", rank=rank, world_size=world)
        base = 30000 + (port % 5000) * 2  # the engine port check must find these free

        def attempt(name: str, fn: Any) -> None:
            try:
                fn()
                results[name] = ("ok", "", [])
            except BaseException as exc:
                results[name] = (type(exc).__name__, str(exc), [c.__name__ for c in type(exc).__mro__])

        os.environ["GENENGINE_SGLANG_OPTIONS"] = json.dumps({"base_port": base})
        attempt("tp3", lambda: get_sglang_engine(model, 0.5, tp_size=3))
        attempt("tp2", lambda: get_sglang_engine(model, 0.5, tp_size=2))
        attempt("tp1", lambda: get_sglang_engine(model, 0.5, tp_size=1))
        attempt("bad_mem", lambda: get_sglang_engine(model, 2.0, tp_size=2))
        group = dist.new_group([0, 1], backend="gloo")
        attempt("reference_ctor", lambda: RLGenerationEngine(group, model_path=model, base_port=base))
        attempt("after", lambda: dist.barrier())  # the trainer's group still works after all of it
        results["children"] = len(mp.active_children())
        dist.destroy_process_group()
    except BaseException:
        results["crash"] = traceback.format_exc()
    out.put((rank, results))


@needs_no_sglang
def test_distributed_errors_reach_every_rank(model_dir: Path) -> None:
    """Two real ranks over gloo: the reference's AssertionErrors, and the leader's failure on both ranks."""
    ctx = worker_context()  # forked from a server that imported torch and transformers once (support/start.py)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_scenario, args=(r, 2, port, str(model_dir), queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank in (0, 1):
        res = got[rank]
        assert "crash" not in res, res.get("crash")
        kind, message, mro = res["tp3"]
        assert kind == "DistributedSetupError" and "AssertionError" in mro and "tp_size 3" in message
        kind, message, _ = res["tp2"]
        assert kind == "BackendImportError", res["tp2"]  # the leader's import error, broadcast to rank 1
        if rank == 1:
            assert "TP leader (rank 0)" in message or "genengine[sglang]" in message
        assert res["tp1"][0] == "BackendImportError"  # each rank is its own leader
        assert res["bad_mem"][0] == "InvalidArgumentError"
        assert res["reference_ctor"][0] == "BackendImportError"
        assert res["after"][0] == "ok" and res["children"] == 0


def test_shutdown_closes_sglangs_sockets_so_no_later_collection_hangs(tmp_path: Path) -> None:
    """SGLang leaves its ZMQ sockets open; collecting them later terminates their context, which waits
    forever for a message queued to a process that is gone (the GPU suite's pytest hung so after its
    summary). The plugin's stop closes them without lingering and ends their contexts."""
    from types import SimpleNamespace

    zmq = pytest.importorskip("zmq")
    from genengine_sglang._process import close_zmq, zmq_sockets

    context = zmq.Context(2)
    push = context.socket(zmq.PUSH)
    push.connect(f"ipc://{tmp_path}/scheduler-gone")
    push.send(b"queued for a scheduler that was killed")
    pull = context.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp_path}/detokenizer")
    rpc_context = zmq.Context(1)
    rpc = rpc_context.socket(zmq.DEALER)
    rpc.connect(f"ipc://{tmp_path}/rpc-gone")
    rpc.send(b"queued too")
    engine = SimpleNamespace(
        send_to_rpc=rpc, tokenizer_manager=SimpleNamespace(send_to_scheduler=push, recv_from_detokenizer=pull, x=1)
    )
    sockets = zmq_sockets(engine)
    assert {id(s) for s in sockets} == {id(push), id(pull), id(rpc)}
    done = threading.Event()
    threading.Thread(target=lambda: (close_zmq(sockets), done.set()), daemon=True).start()
    assert done.wait(10.0), "closing SGLang's sockets hung (a context waited for its queued messages)"
    assert push.closed and pull.closed and rpc.closed and context.closed and rpc_context.closed
