"""The ``sglang.Engine`` as processes of the trainer's: how they start, what they change here, how they stop.

Kept apart from the engine class because every piece works around SGLang being written as a server that owns
its process: it sets environment variables and the multiprocessing start method in *this* process, binds
SIGTERM to an event loop that runs only inside engine calls, and its shutdown kills every child of this
process. Nothing here imports torch or SGLang at module level.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from genengine.engine.environ import scoped_environ, strip_expandable_segments
from genengine.errors import BackendImportError, ConfigError, closest
from genengine.plugins.versions import installed_version
from genengine_sglang.compat import VERIFIED, graphs_off, lora_tensors_per_rank
from genengine_sglang.errors import SGLangEngineError
from genengine_sglang.settings import check_graph_memory_saver

if TYPE_CHECKING:
    from genengine.engine.lifecycle import ExitHandle

__all__ = [
    "current_gpu",
    "engine_environment",
    "launch",
    "return_sigterm",
    "settle_memory",
    "stop_sglang",
    "wait_processes_off_gpu",
]

# Environment variables SGLang's start-up sets in *this* process (engine.py _set_envs_and_config) or that
# must differ for its processes: restored afterwards so the trainer's later NCCL groups and CUDA settings
# are its own.
_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
_SCOPED_ENV = (
    _ALLOC_CONF,
    "TORCHELASTIC_USE_AGENT_STORE",
    "NCCL_CUMEM_ENABLE",
    "NCCL_NVLS_ENABLE",
    "NCCL_GRAPH_MIXING_SUPPORT",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "CUDA_MODULE_LOADING",
)
_MIB = 1 << 20


# ---- start -----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def engine_environment(enable_sleep: bool) -> Iterator[None]:
    """The environment the engine processes are spawned with; this process's is restored afterwards, and
    so is its multiprocessing start method (SGLang forces ``spawn``)."""
    changes: dict[str, str | None] = {key: os.environ.get(key) for key in _SCOPED_ENV}  # as they are: restored
    if enable_sleep:
        changes[_ALLOC_CONF] = strip_expandable_segments(os.environ.get(_ALLOC_CONF))
    # torchrun's agent store is the trainer's rendezvous, not the scheduler processes' (as the reference).
    changes["TORCHELASTIC_USE_AGENT_STORE"] = None
    method = multiprocessing.get_start_method(allow_none=True)
    try:
        with scoped_environ(changes):
            yield
    finally:
        if multiprocessing.get_start_method(allow_none=True) != method:
            multiprocessing.set_start_method(method, force=True)


def launch(kwargs: Mapping[str, Any], *, enable_sleep: bool) -> tuple[Any, ExitHandle]:
    """A started ``sglang.Engine(**kwargs)``, and the exit hook that stops its processes (and only those).

    Every key is checked against ``ServerArgs`` first, so a typo is a ``ConfigError`` naming the closest
    argument rather than SGLang's ``TypeError`` after the import.
    """
    from genengine.engine.lifecycle import at_exit

    try:
        from sglang.srt.entrypoints.engine import Engine
        from sglang.srt.server_args import ServerArgs
    except ImportError as exc:
        raise BackendImportError(
            f"the sglang backend needs {VERIFIED.requirement} (pip install 'genengine[sglang]'): {exc}"
        ) from exc
    known = {f.name for f in dataclasses.fields(ServerArgs)}
    for key in kwargs:
        if key not in known:
            hint = closest(key, known)
            raise ConfigError(f"SGLang has no server argument {key!r}" + (f" (did you mean {hint!r}?)" if hint else ""))
    if kwargs.get("enable_lora") and not lora_tensors_per_rank():  # compat.BRANCHES: before 0.5.17
        # load_adapter sends the trainer's tensors one payload per TP rank: refused here, not at the first
        # load_adapter after the engine took its memory.
        found = installed_version("sglang") or "(version unknown)"
        raise ConfigError(
            f"enable_lora=True: genengine loads adapters from the trainer's tensors, which SGLang takes as it sends "
            f"them from 0.5.17 on, and sglang {found} is installed; install sglang 0.5.17 for "
            "adapters, or leave enable_lora off"
        )
    kwargs = {**kwargs, **graphs_off(kwargs, known)}  # disable_cuda_graph: all graphs, on every release
    check_graph_memory_saver(kwargs, os.environ, known)
    trainer_sigterm = signal.getsignal(signal.SIGTERM)
    with engine_environment(enable_sleep):
        try:
            engine = Engine(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"SGLang rejected the engine settings: {exc}") from exc
    # SGLang's own exit hook kills every child of this process (a trainer's data-loader workers too);
    # ours stops this engine's processes only, if the trainer exits without shutdown() (its scheduler
    # processes are not daemons: multiprocessing would wait on them forever).
    atexit.unregister(engine.shutdown)
    # Bounded well inside the 10 s a user's script may take to exit after its last line: what is still there
    # after it is SIGKILLed (a normal stop takes about 2 s on an H200).
    exit_handle = at_exit(
        lambda: stop_sglang(engine, close_sockets=False),
        name="sglang engine",
        pids=list(engine.get_all_child_pids()),
        timeout_s=5.0,
    )
    if threading.current_thread() is threading.main_thread():
        # SGLang's tokenizer manager puts SIGTERM on its asyncio loop (to drain an HTTP server's requests)
        # when it first runs; in an Engine that loop runs only inside engine calls, so a trainer that is
        # training, or idle, would never act on SIGTERM (preemption by Slurm or Kubernetes: the job hangs
        # until SIGKILL). Let SGLang install it now, then give SIGTERM back to the trainer. It must happen
        # inside the Engine's own loop: outside a running loop SGLang would start its receive task on a
        # new loop that never runs, and every generate would wait forever (seen on the H200).
        async def start_handle_loop() -> None:
            engine.tokenizer_manager.auto_create_handle_loop()

        engine.loop.run_until_complete(start_handle_loop())
        if engine.tokenizer_manager.event_loop is not engine.loop:
            raise SGLangEngineError("SGLang's tokenizer manager runs on another event loop than its Engine")
        return_sigterm(engine.loop, trainer_sigterm)
    return engine, exit_handle


def return_sigterm(loop: Any, handler: Any) -> None:
    """Take SIGTERM off ``loop`` (an asyncio loop's handler runs only while the loop runs) and reinstall
    ``handler``, the process's disposition from before (``signal.getsignal``; None means the default)."""
    loop.remove_signal_handler(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL if handler is None else handler)


def dead_processes(engine: Any) -> str | None:
    """Which of ``engine``'s processes (those SGLang's own watchdog watches) died, or None while all live.

    The same test as SGLang's ``SubprocessWatchdog._check_processes`` (utils/watchdog.py): not alive and a
    non-zero exit code."""
    watchdog = getattr(getattr(engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
    procs = getattr(watchdog, "_processes", None) or ()
    names = getattr(watchdog, "_names", None) or [f"process {i}" for i in range(len(procs))]
    dead = [
        f"{name} (pid {proc.pid}, exit code {proc.exitcode})"
        for proc, name in zip(procs, names, strict=False)
        if not proc.is_alive() and proc.exitcode != 0
    ]
    return f"SGLang's {', '.join(dead)} died" if dead else None


# ---- stop ------------------------------------------------------------------------------------------------------
def stop_sglang(engine: Any, *, close_sockets: bool = True) -> None:
    """Stop one ``sglang.Engine`` and wait until its processes are gone; then close its ZMQ sockets
    (:func:`close_zmq`) unless ``close_sockets`` is False (at exit, where SGLang's loop may still run on
    them in another thread, and pyzmq no longer terminates contexts).

    ``sglang.Engine.shutdown`` kills *every* child of this process (``kill_process_tree(os.getpid())``):
    a trainer's data-loader workers and any other engine with it. This stops only the engine's own.
    """
    from sglang.srt.utils import kill_process_tree

    manager = getattr(engine, "tokenizer_manager", None)
    watchdog = getattr(manager, "_subprocess_watchdog", None)
    if watchdog is not None:
        watchdog.stop()  # else it sees its children die and SIGQUITs this process
    sockets = zmq_sockets(engine)
    rpc = getattr(engine, "send_to_rpc", None)
    if rpc is not None:
        rpc.close(linger=0)
        engine.send_to_rpc = None
    daemons = getattr(engine, "_weight_cache_daemon_procs", None)
    if daemons:
        engine._terminate_weight_cache_daemons(daemons)
        engine._weight_cache_daemon_procs = []
    for pid in list(engine.get_all_child_pids()):
        kill_process_tree(pid, include_parent=True, wait_timeout=60)
    atexit.unregister(engine.shutdown)
    if close_sockets:
        close_zmq(sockets)


def zmq_sockets(engine: Any) -> list[Any]:
    """The ZMQ sockets the ``sglang.Engine`` and its tokenizer manager hold (``send_to_rpc``, the tokenizer
    manager's ``recv_from_detokenizer`` and ``send_to_scheduler``, ...)."""
    try:
        import zmq
    except ImportError:
        return []
    owners = [engine, getattr(engine, "tokenizer_manager", None)]
    return [v for o in owners if o is not None for v in list(vars(o).values()) if isinstance(v, zmq.Socket)]


def close_zmq(sockets: list[Any]) -> None:
    """Close ``sockets`` without lingering and end their contexts (with any other socket made from them).

    SGLang leaves them open at shutdown. Once the engine object is collected, pyzmq's ``Context.__del__``
    terminates each context, and termination waits for every message still queued to a process that is
    gone: forever. A trainer's later garbage collection (or pytest's, after its summary) then hung in
    ``zmq.Context.term`` (seen on the H200). Called once SGLang's loop no longer runs on them."""
    contexts = {id(sock.context): sock.context for sock in sockets}
    for sock in sockets:
        if not sock.closed:
            sock.close(linger=0)
    for context in contexts.values():
        if not context.closed:
            context.destroy(linger=0)


def wait_processes_off_gpu(pids: list[int], gpu_id: int, timeout_s: float) -> None:
    """Return once none of ``pids`` holds memory on GPU ``gpu_id`` (bounded by ``timeout_s``).

    A killed process's GPU memory comes back some time after it exits; the free-memory reading is stable
    meanwhile, so only the driver's list of processes on the device tells when shutdown is really done.
    """
    if not pids:
        return
    try:
        import pynvml  # nvidia-ml-py
        import torch

        pynvml.nvmlInit()
        uuid = torch.cuda.get_device_properties(gpu_id).uuid
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
    except Exception:
        return
    deadline = time.monotonic() + timeout_s
    wanted = set(pids)
    while time.monotonic() < deadline:
        running = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        if not running & wanted:
            return
        time.sleep(0.01)


# ---- this process's GPU ----------------------------------------------------------------------------------------
def current_gpu() -> int | None:
    """The GPU this process already uses, if CUDA is initialised here (a lone engine goes there too)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    return None


def settle_memory(gpu_id: int, timeout_s: float) -> None:
    """Return once GPU ``gpu_id`` shows no more memory coming free (bounded by ``timeout_s``).

    SGLang answers after unmapping; reading the device's free memory until it stops changing makes sure
    the trainer's next allocation sees it, instead of racing it (the OOM users hit).
    """
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    deadline = time.monotonic() + timeout_s
    torch.cuda.synchronize(gpu_id)
    previous = torch.cuda.mem_get_info(gpu_id)[0]
    while time.monotonic() < deadline:
        time.sleep(0.005)
        free = torch.cuda.mem_get_info(gpu_id)[0]
        if abs(free - previous) < 2 * _MIB:
            return
        previous = free
