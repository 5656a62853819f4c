"""What one process can hold only once, because vLLM keeps it process-global, and the process state an engine
borrows: the sleep allocator, the default process group, the RNGs, the environment and allocator settings."""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from genengine.engine.environ import ALLOC_CONF, scoped_environ, strip_expandable_segments
from genengine.errors import BackendImportError, DistributedSetupError, EngineStateError

if TYPE_CHECKING:
    from genengine.distributed import Topology

__all__ = [
    "PROCESS_STATE",
    "check_sleep_slot",
    "claim_sleep_slot",
    "drop_cuda_graphs",
    "fresh_graph_pool",
    "import_vllm",
    "keep_default_group",
    "preserve_rng_states",
    "release_sleep_slot",
    "start_environ",
    "trainer_world",
    "without_expandable_segments",
]


class _ProcessState:
    """What one process may hold at once: vLLM's allocator, parallel state and default group are global."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sleep_owner: weakref.ref[Any] | None = None
        self.vllm_world: Any = None  # the default group vLLM created itself (no trainer world)


PROCESS_STATE = _ProcessState()
"""This process's one vLLM sleep allocator owner and the default group vLLM made itself (take its ``lock``)."""


def _sleep_owner() -> Any:
    owner = PROCESS_STATE.sleep_owner() if PROCESS_STATE.sleep_owner is not None else None
    if owner is not None and getattr(owner, "closed", False):
        return None
    return owner


def _foreign_cumem_bytes() -> int:
    """Bytes vLLM's sleep allocator holds for an engine genengine did not make (a raw ``vllm.LLM``)."""
    module = sys.modules.get("vllm.device_allocator.cumem")  # only if vLLM's allocator was ever loaded
    instance = getattr(getattr(module, "CuMemAllocator", None), "instance", None)
    if instance is None:
        return 0
    try:
        return int(instance.get_current_usage())
    except Exception:
        return 0


def check_sleep_slot(owner: object | None, what: str) -> None:
    """Raise unless vLLM's one-per-process sleep allocator is free (or already ``owner``'s)."""
    holder = _sleep_owner()
    if holder is not None and holder is not owner:
        raise EngineStateError(
            f"{what}: a vLLM engine with sleep enabled already lives in this process ({holder!r}); vLLM's "
            "sleep allocator serves one engine per process. Shut it down first, or create this one with "
            "enable_sleep=False (get_vllm_engine: enable_engine_sleep=False)"
        )
    if holder is None and (held := _foreign_cumem_bytes()) > 0:
        raise EngineStateError(
            f"{what}: vLLM's sleep allocator already holds {held} bytes for an engine created outside "
            "genengine in this process; it serves one engine per process"
        )


def claim_sleep_slot(owner: object, what: str) -> None:
    """Reserve vLLM's one-per-process sleep allocator for ``owner``; raise if another engine holds it."""
    with PROCESS_STATE.lock:
        check_sleep_slot(owner, what)
        PROCESS_STATE.sleep_owner = weakref.ref(owner)


def release_sleep_slot(owner: object) -> None:
    with PROCESS_STATE.lock:
        if PROCESS_STATE.sleep_owner is not None and PROCESS_STATE.sleep_owner() in (owner, None):
            PROCESS_STATE.sleep_owner = None


@contextlib.contextmanager
def keep_default_group(active: bool = True) -> Iterator[None]:
    """Make ``torch.distributed.destroy_process_group()`` of the default group a no-op inside the block.

    vLLM's teardown (``cleanup_dist_env_and_memory`` → ``destroy_distributed_environment``) destroys the
    default group, which under external_launcher is the trainer's; its own subgroups are destroyed
    normally.
    """
    if not active:
        yield
        return
    import torch.distributed as dist

    original = dist.destroy_process_group
    default = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    def guarded(group: Any = None) -> None:
        if default is not None and (group is None or group is default):
            return
        original(group)

    dist.destroy_process_group = guarded  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.destroy_process_group = original  # type: ignore[assignment]


@contextlib.contextmanager
def preserve_rng_states() -> Iterator[None]:
    """Restore python's, numpy's and torch's (CPU and CUDA) RNG states after the block.

    vLLM reseeds all of them while it starts (``set_random_seed``): a colocated trainer's dropout and data
    order must not change because an engine was created.
    """
    import torch

    py_state = random.getstate()
    np_module = sys.modules.get("numpy")
    np_state = np_module.random.get_state() if np_module is not None else None
    cpu_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py_state)
        if np_state is not None and np_module is not None:
            np_module.random.set_state(np_state)
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def _set_expandable_segments(enabled: bool) -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{enabled}")


_GRAPH_WRAPPERS = (
    ("vllm.compilation.cuda_graph", "CUDAGraphWrapper"),
    ("vllm.compilation.breakable_cudagraph", "BreakableCUDAGraphWrapper"),
)


def drop_cuda_graphs() -> None:
    """Before the process's last engine's teardown: destroy every CUDA graph vLLM's wrappers captured.

    On CUDA vLLM leaves them to be collected whenever their wrappers die (its model runner drops them at shutdown
    only on ROCm), and the wrappers outlive the engine (compiled code keeps them), so without this the graphs' pool
    stays in use after shutdown and the next engine's start drops it in the middle of its own capture."""
    for module, name in _GRAPH_WRAPPERS:
        wrapper = getattr(sys.modules.get(module), name, None)
        if wrapper is not None:
            wrapper.clear_all_graphs()


def fresh_graph_pool() -> None:
    """After the process's last engine is gone: make the next engine capture into a new graph pool, as in a new
    process.

    vLLM shares one pool id per process (``Platform.get_global_graph_pool``). When the old pool's graphs are gone but
    a block of it is still held, torch keeps the id registered with no user, and a capture into that id fails
    torch's ``use_count > 0`` assert: the GPU suite hit it on vLLM 0.24.0, in the first graph engine after another
    one shut down. A new id costs nothing; the old pool is freed with its last block."""
    platform = getattr(sys.modules.get("vllm.platforms"), "_current_platform", None)  # set once vLLM resolved it
    cls: Any = type(platform)
    if platform is not None and getattr(cls, "_global_graph_pool", None) is not None:
        cls._global_graph_pool = None


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        from genengine_vllm.compat import VERIFIED

        raise BackendImportError(
            f"the vllm backend needs {VERIFIED.requirement} (pip install 'genengine[vllm]'): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return vllm


def trainer_world(tp_size: int, *, require: bool = False) -> Topology | None:
    """This rank's place in the trainer's world, or None when there is none (tp_size 1 only, unless ``require``)."""
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if initialised and PROCESS_STATE.vllm_world is not None and dist.group.WORLD is PROCESS_STATE.vllm_world:
        initialised = False  # the one-rank group an earlier engine of this process made: not a trainer's
    if not initialised:
        if require:
            raise DistributedSetupError(
                "torch.distributed is not initialised: the trainer owns the process group and must call "
                "torch.distributed.init_process_group() before get_vllm_engine (as the reference requires; "
                "genengine.create_engine(backend='vllm', tp_size=1) runs without it)"
            )
        if tp_size > 1:
            raise DistributedSetupError(
                f"tp_size={tp_size} needs torch.distributed initialised by the trainer (launch one process per "
                "GPU, e.g. with torchrun, and call torch.distributed.init_process_group() before creating the "
                "engine); tp_size=1 also runs without it"
            )
        return None
    from genengine.distributed import topology_from_env

    return topology_from_env(tp_size)


def start_environ(topology: Topology | None) -> dict[str, str | None]:
    """The variables ``vllm.LLM(...)`` reads while it starts, for ``scoped_environ`` around that call only.

    Read in vLLM 0.26.0 during the start and never after (the source lines: docs/upstream.md):

    * ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core in this process, so ``apply_model`` reaches
      the model without IPC (``LLMEngine.from_engine_args`` picks the in-process client). vLLM sets it
      itself under external_launcher; the scope takes that back too.
    * ``RANK``/``LOCAL_RANK``, under the trainer's world (``ExecutorWithExternalLauncher._distributed_args``).

    ``EngineCore.__init__`` ends the start by caching every ``vllm.envs`` value until teardown's
    ``cleanup_dist_env_and_memory``; ``generate``, ``sleep``, ``wake_up``, ``collective_rpc`` and shutdown
    read none of these. The one later reader is vLLM's logger choosing which rank prints "once per node"
    lines (``envs.LOCAL_RANK``), and only once vLLM's world group is gone, when the trainer's own value is
    the one to use.
    """
    changes: dict[str, str | None] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if topology is not None:
        changes["RANK"] = str(topology.rank)
        changes["LOCAL_RANK"] = str(topology.local_rank)
    return changes


@contextlib.contextmanager
def without_expandable_segments() -> Iterator[None]:
    """``expandable_segments:True`` out of the CUDA allocator settings for the block: a sleep-mode engine's life.

    With it PyTorch bypasses vLLM's sleep pool and sleep frees nothing. The environment variable is read
    when PyTorch initialises CUDA (possibly while vLLM starts) and by vLLM's ``CuMemAllocator`` as it maps
    its pools; the process's setting applies to every allocation after. Both
    hold until the engine shuts down, then the trainer's come back.
    """
    conf = os.environ.get(ALLOC_CONF)
    stripped = strip_expandable_segments(conf)
    if stripped == conf:
        yield
        return
    with scoped_environ({ALLOC_CONF: stripped}):
        _set_expandable_segments(False)
        try:
            yield
        finally:
            _set_expandable_segments(True)
