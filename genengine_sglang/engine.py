"""``RLGenerationEngine`` and ``get_sglang_engine``: SGLang 0.5.17 behind genengine's protocol and LightRFT's API.

One engine per tensor-parallel group: the group's first rank (its *leader*) owns an ``sglang.Engine``
spanning the group's GPUs (SGLang spawns one scheduler process per GPU); every rank of the group calls
every method, the leader does the engine work, and results (or the leader's error) are broadcast over the
group's gloo group, so all ranks return the same thing or raise the same error.

Two faces, one implementation:

* the protocol (``genengine.protocol.GenerationEngine``): ``generate(prompts, sampling_params, *,
  prompt_token_ids, image_data) -> list[GenerationResult]``, ``sleep(level)``, ``wake(tags)``,
  ``load_weights(named_tensors)``, ``flush_cache()``, ``shutdown()``;
* the reference (``lightrft.strategy.sglang_utils``): ``generate(prompt=..., input_ids=..., ...)`` returning
  SGLang's output dicts, ``update_weights_from_tensor(name, tensor, flush_cache, load_format)``,
  ``sleep(release_weights=...)``, ``wake_up(release_weights=...)``.

``generate`` takes the reference's path when any reference-only keyword is passed (``prompt``,
``input_ids``, ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``, ``lora_path``,
``custom_logit_processor``, ``gather_inputs``), and the protocol's otherwise (positional calls included);
``sleep`` takes the reference's meaning when ``release_weights`` is passed. Both go through the same state
machine: generating while asleep, or after a level-2 sleep before the weights came back, raises on either
face; weights are checked by name and shape on either face.

Sleep levels on SGLang's memory saver (tags ``weights``, ``kv_cache``, ``cuda_graph``): level 1 releases
the KV cache and the CUDA-graph memory and keeps the weights: on the GPU by default (fast; LightRFT's
``sleep()``), or released to host memory with option ``enable_weights_cpu_backup`` (frees everything, but
the copy to host takes seconds at 7B). Level 2 releases everything and keeps nothing (no copy: the trainer
sends the weights again, which is the fast RL cycle). ``cuda_graph`` comes back with the first of
``weights``/``kv_cache`` to wake (its memory is small and generation needs it), or alone when asked.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from genengine.base import EngineBase
from genengine.checkpoint import read_model_config, vocab_size, weight_spec
from genengine.config import EngineConfig
from genengine.distributed import (
    EngineGroup,
    check_port_free,
    compute_topology,
    default_collective_timeout_s,
    engine_group,
    parse_cuda_visible_devices,
    topology_from_env,
)
from genengine.engine_args import check_reference_args
from genengine.environ import strip_expandable_segments
from genengine.errors import (
    BackendImportError,
    CollectiveTimeoutError,
    ConfigError,
    DistributedSetupError,
    GenEngineError,
    InconsistentInputsError,
    InvalidArgumentError,
    closest,
)
from genengine.protocol import TAG_KV_CACHE, TAG_WEIGHTS, GenerationResult, LoadReport
from genengine.requests import Request
from genengine_sglang import _weightsync
from genengine_sglang.errors import SGLangEngineError
from genengine_sglang.mapping import build_entries, results_from_sglang
from genengine_sglang.settings import (
    DEFAULT_BUCKET_BYTES,
    OUR_OPTIONS,
    SGLANG_OPTIONS,
    WEIGHT_SYNC_MODES,
    SGLangSettings,
    check_graph_memory_saver,
    check_model_dir,
    options_from_env,
    resolve_settings,
    server_kwargs,
)

if TYPE_CHECKING:
    import torch

    from genengine.lifecycle import ExitHandle
    from genengine.weights import WeightInfo

__all__ = ["TAG_CUDA_GRAPH", "RLGenerationEngine", "get_sglang_engine", "get_sglang_engine_for_rollout", "live_engines"]

TAG_CUDA_GRAPH = "cuda_graph"
T = TypeVar("T")


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()
_REFERENCE_GENERATE_KEYWORDS = (
    "prompt",
    "input_ids",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "lora_path",
    "custom_logit_processor",
    "gather_inputs",
)
# Per-prompt arguments of the reference's generate that gather_inputs concatenates across ranks when lists.
_PER_PROMPT = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "lora_path")
# Environment variables SGLang's start-up sets in *this* process (engine.py _set_envs_and_config) or that
# must differ for its processes: restored afterwards so the trainer's later NCCL groups and CUDA settings
# are its own.
_SCOPED_ENV = (
    "PYTORCH_CUDA_ALLOC_CONF",
    "TORCHELASTIC_USE_AGENT_STORE",
    "NCCL_CUMEM_ENABLE",
    "NCCL_NVLS_ENABLE",
    "NCCL_GRAPH_MIXING_SUPPORT",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "CUDA_MODULE_LOADING",
)
_MIB = 1 << 20

_live: weakref.WeakSet[RLGenerationEngine] = weakref.WeakSet()
_seed_warned = False


def live_engines() -> list[RLGenerationEngine]:
    """The engines of this process that are not shut down (what ``sgl_model_saver`` acts on)."""
    return [e for e in list(_live) if not e.state.closed]


# ---- the reference's entry point ---------------------------------------------------------------------------
def get_sglang_engine(
    model_name_or_path: str,
    engine_mem_util: float,
    enable_engine_sleep: bool = True,
    tp_size: int = 1,
    skip_tokenizer_init: bool = False,
    dtype: str = "bfloat16",
    disable_cuda_graph: bool = False,
) -> RLGenerationEngine:
    """Initialize and configure a SGLang generation engine with distributed processing support.

    The world of the initialised ``torch.distributed`` default group is split into tensor-parallel groups
    of ``tp_size`` contiguous ranks; the first rank of each group starts an engine on the group's GPUs
    (``base_gpu_id`` = its local rank, port ``40000 + local_rank``), the others hold none and receive its
    outputs. Collective: every rank must call it.

    Args:
        model_name_or_path: Path to the model (a directory with ``config.json``), or the id of a Hugging Face
            model already in the local cache.
        engine_mem_util: Memory utilization fraction for the engine, in (0, 1] (SGLang's
            ``mem_fraction_static``).
        enable_engine_sleep: Whether to enable memory saver mode, so that ``sleep`` releases GPU memory
            (also drops ``expandable_segments`` from the engine processes' ``PYTORCH_CUDA_ALLOC_CONF``).
        tp_size: Tensor parallelism size for distributed inference.
        skip_tokenizer_init: Whether to skip tokenizer initialization; text and image prompts need the
            tokenizer (required for VLM use cases).
        dtype: Data type for model weights and computations ("bfloat16" or "float16").
        disable_cuda_graph: Whether to disable CUDA graph optimization.

    Engine options that this fixed signature cannot carry (e.g. ``attention_backend`` on machines without
    FlashAttention 3) come from ``$GENENGINE_SGLANG_OPTIONS``, a JSON object.

    Returns:
        The ``RLGenerationEngine`` of this rank's tensor-parallel group.

    Raises:
        AssertionError: If PyTorch distributed is not initialized (``DistributedSetupError``).
        AssertionError: If world size is not evenly divisible by tensor parallelism size.
        ValueError: For any other bad argument (``InvalidArgumentError``/``ConfigError``), before any
            process or GPU memory is taken.
    """
    check_reference_args(
        engine_mem_util=engine_mem_util,
        enable_engine_sleep=enable_engine_sleep,
        tp_size=tp_size,
        skip_tokenizer_init=skip_tokenizer_init,
        dtype=dtype,
        disable_cuda_graph=disable_cuda_graph,
    )
    model_dir = check_model_dir(model_name_or_path, what="model_name_or_path")
    options = {
        **options_from_env(),
        "skip_tokenizer_init": skip_tokenizer_init,
        "disable_cuda_graph": disable_cuda_graph,
    }
    config = EngineConfig(
        backend="sglang",
        model=model_dir,
        tp_size=tp_size,
        mem_util=float(engine_mem_util),
        dtype=dtype,
        enable_sleep=enable_engine_sleep,
        options=options,
    )
    settings = resolve_settings(config, environ={})
    return RLGenerationEngine._create(settings, require_distributed=True)


def get_sglang_engine_for_rollout(args: Any) -> RLGenerationEngine:
    """The reference's wrapper: ``get_sglang_engine`` from a trainer's argument namespace (``pretrain``,
    ``engine_mem_util``, ``enable_engine_sleep``, ``engine_tp_size``, ``bf16``)."""
    missing = [
        k
        for k in ("pretrain", "engine_mem_util", "enable_engine_sleep", "engine_tp_size", "bf16")
        if not hasattr(args, k)
    ]
    if missing:
        raise InvalidArgumentError(f"args lacks {', '.join(missing)} (the reference's rollout arguments)")
    return get_sglang_engine(
        args.pretrain,
        args.engine_mem_util,
        enable_engine_sleep=args.enable_engine_sleep,
        tp_size=args.engine_tp_size,
        dtype="bfloat16" if args.bf16 else "float16",
    )


# ---- groups ------------------------------------------------------------------------------------------------
def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _timeout(settings: SGLangSettings) -> float:
    return settings.collective_timeout_s or default_collective_timeout_s()


def _make_group(settings: SGLangSettings, *, require_distributed: bool) -> tuple[EngineGroup, bool]:
    """This rank's group, and whether its engine port was already checked."""
    dist = _dist()
    if dist.is_available() and dist.is_initialized():
        group = engine_group(
            settings.tp_size, base_port=settings.base_port, check_port=True, timeout_s=_timeout(settings)
        )
        return group, True
    if require_distributed or settings.tp_size > 1:
        raise DistributedSetupError(
            "torch.distributed is not initialised: the trainer owns the process group and must call "
            "torch.distributed.init_process_group() before an engine is created"
            + (f" (tp_size={settings.tp_size} needs a group of that many ranks)" if settings.tp_size > 1 else "")
        )
    topo = compute_topology(
        0, 1, 0, 1, 1, parse_cuda_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES")), settings.base_port
    )
    gpu = _current_gpu()
    if gpu is not None and gpu != topo.gpu_id:  # a lone engine serves the GPU this process already uses
        topo = dataclasses.replace(topo, gpu_id=gpu, base_gpu_id=gpu, gpu_ids=(gpu,))
    return EngineGroup(topo, None, None, "gloo", _timeout(settings)), False  # type: ignore[arg-type]


def _current_gpu() -> int | None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    return None


def _group_from_process_group(pg: Any, settings: SGLangSettings, num_gpu_per_node: int) -> EngineGroup:
    """An ``EngineGroup`` over the reference's ``tp_group_cpu`` (a gloo group of contiguous ranks)."""
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedSetupError("tp_group_cpu was given but torch.distributed is not initialised")
    ranks = tuple(dist.get_process_group_ranks(pg))
    if len(ranks) > num_gpu_per_node:
        raise DistributedSetupError(
            f"a TP group of {len(ranks)} ranks spans more than num_gpu_per_node={num_gpu_per_node} GPUs: "
            "engines spanning nodes are not supported"
        )
    backend = str(dist.get_backend(pg))
    if backend != "gloo":
        raise DistributedSetupError(f"tp_group_cpu must be a gloo group (it carries pickled objects), got {backend!r}")
    topo = topology_from_env(len(ranks), base_port=settings.base_port)
    if ranks != topo.tp_group_ranks:
        raise DistributedSetupError(
            f"tp_group_cpu holds ranks {list(ranks)}, but rank {topo.rank}'s TP group of contiguous ranks is "
            f"{list(topo.tp_group_ranks)}"
        )
    return EngineGroup(topo, pg, pg, "gloo", _timeout(settings))


def _settings_from_engine_kwargs(kwargs: dict[str, Any], tp_size: int | None) -> SGLangSettings:
    """The reference constructor's ``sglang.Engine`` keyword arguments as settings."""
    kw = dict(kwargs)
    if "model_path" not in kw:
        raise InvalidArgumentError("RLGenerationEngine needs model_path=... (the sglang.Engine argument)")
    given_tp = kw.pop("tp_size", None)
    if tp_size is not None and given_tp is not None and given_tp != tp_size:
        raise DistributedSetupError(f"tp_size={given_tp} disagrees with the size {tp_size} of tp_group_cpu")
    step = kw.pop("gpu_id_step", 1)
    if step != 1:
        raise ConfigError(f"gpu_id_step={step!r}: only 1 is supported (a TP group uses contiguous GPUs)")
    dtype = kw.pop("dtype", "auto")
    dtype = {"half": "float16", "float": "float32"}.get(dtype, dtype)
    options: dict[str, Any] = {}
    server_args: dict[str, Any] = {}
    for key in list(kw):
        if key in ("model_path", "mem_fraction_static", "enable_memory_saver", "random_seed"):
            continue
        value = kw.pop(key)
        if key in OUR_OPTIONS or key in SGLANG_OPTIONS:
            options[key] = value
        else:
            server_args[key] = value
    if server_args:
        options["server_args"] = {**server_args, **options.get("server_args", {})}
    mem: Any = kw.get("mem_fraction_static")
    seed: Any = kw.get("random_seed")
    config = EngineConfig(
        backend="sglang",
        model=kw["model_path"],
        tp_size=tp_size or given_tp or 1,
        mem_util=0.8 if mem is None else mem,
        dtype=dtype,
        enable_sleep=bool(kw.get("enable_memory_saver", False)),
        seed=0 if seed is None else seed,
        options=options,
    )
    return resolve_settings(config)


# ---- engine process plumbing --------------------------------------------------------------------------------
@contextlib.contextmanager
def _engine_environment(enable_sleep: bool) -> Iterator[None]:
    """The environment the engine processes are spawned with; this process's is restored afterwards."""
    saved = {k: os.environ.get(k) for k in _SCOPED_ENV}
    method = multiprocessing.get_start_method(allow_none=True)
    if enable_sleep:
        conf = strip_expandable_segments(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        if conf is None:
            os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        else:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    # torchrun's agent store is the trainer's rendezvous, not the scheduler processes' (as the reference).
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if multiprocessing.get_start_method(allow_none=True) != method:
            multiprocessing.set_start_method(method, force=True)


def _stop_sglang(engine: Any) -> None:
    """Stop one ``sglang.Engine`` and wait until its processes are gone.

    ``sglang.Engine.shutdown`` kills *every* child of this process (``kill_process_tree(os.getpid())``):
    a trainer's data-loader workers and any other engine with it. This stops only the engine's own.
    """
    from sglang.srt.utils import kill_process_tree

    manager = getattr(engine, "tokenizer_manager", None)
    watchdog = getattr(manager, "_subprocess_watchdog", None)
    if watchdog is not None:
        watchdog.stop()  # else it sees its children die and SIGQUITs this process
    sock = getattr(engine, "send_to_rpc", None)
    if sock is not None:
        sock.close(linger=0)
        engine.send_to_rpc = None
    daemons = getattr(engine, "_weight_cache_daemon_procs", None)
    if daemons:
        engine._terminate_weight_cache_daemons(daemons)
        engine._weight_cache_daemon_procs = []
    for pid in list(engine.get_all_child_pids()):
        kill_process_tree(pid, include_parent=True, wait_timeout=60)
    atexit.unregister(engine.shutdown)


def _portable(exc: BaseException, rank: int) -> BaseException:
    """The leader's error as it will be raised on the other ranks."""
    if isinstance(exc, GenEngineError):
        try:
            pickle.loads(pickle.dumps(exc))
            return exc
        except Exception:
            pass
        base: type[GenEngineError] = type(exc) if isinstance(exc, SGLangEngineError) else SGLangEngineError
        return base(f"on the TP leader (rank {rank}): {exc}")
    return SGLangEngineError(f"{type(exc).__name__} on the TP leader (rank {rank}): {exc}")


@dataclasses.dataclass(frozen=True)
class _LoadCall:
    mode: str
    load_format: str | None
    flush: bool


# ---- the engine --------------------------------------------------------------------------------------------
class RLGenerationEngine(EngineBase):
    """The SGLang engine of one tensor-parallel group (see the module docstring for both of its faces)."""

    supported_tags: tuple[str, ...] = (TAG_WEIGHTS, TAG_KV_CACHE, TAG_CUDA_GRAPH)
    supports_images: ClassVar[bool] = True
    """Image prompts reach SGLang's multimodal processor on VLMs; text-only models reject them."""

    _settings: SGLangSettings
    _group: EngineGroup

    def __init__(self, tp_group_cpu: Any = None, num_gpu_per_node: int = 8, **kwargs: Any) -> None:
        """The reference's constructor: the TP group's gloo group and ``sglang.Engine`` keyword arguments.

        ``kwargs`` are ``sglang.Engine``'s (``model_path``, ``mem_fraction_static``, ``enable_memory_saver``,
        ``base_gpu_id``, ``port``, ...) plus genengine's options (``weight_sync_mode``, ...). Without
        ``tp_group_cpu`` the engine serves this rank alone. Prefer ``get_sglang_engine`` or
        ``genengine.create_engine(backend="sglang", ...)``.
        """
        if tp_group_cpu is None:
            settings = _settings_from_engine_kwargs(kwargs, None)
            group, checked = _make_group(settings, require_distributed=False)
        else:
            dist = _dist()
            if not (dist.is_available() and dist.is_initialized()):
                raise DistributedSetupError("tp_group_cpu was given but torch.distributed is not initialised")
            settings = _settings_from_engine_kwargs(kwargs, dist.get_world_size(tp_group_cpu))
            group, checked = _group_from_process_group(tp_group_cpu, settings, num_gpu_per_node), False
        self._setup(settings, group, port_checked=checked)

    @classmethod
    def from_config(cls, config: EngineConfig) -> RLGenerationEngine:
        """What ``genengine.create_engine(backend="sglang", ...)`` calls.

        Backend options (``attention_backend``, ``sampling_backend``, ``disable_radix_cache``, ``port``,
        ``weight_sync_mode``, ...; see ``genengine_sglang.settings``) come in ``config.options``, merged over
        ``$GENENGINE_SGLANG_OPTIONS``. With ``tp_size=1`` torch.distributed is optional.
        """
        return cls._create(resolve_settings(config), require_distributed=False)

    @classmethod
    def _create(cls, settings: SGLangSettings, *, require_distributed: bool) -> RLGenerationEngine:
        group, checked = _make_group(settings, require_distributed=require_distributed)
        engine = cls.__new__(cls)
        engine._setup(settings, group, port_checked=checked)
        return engine

    def _setup(self, settings: SGLangSettings, group: EngineGroup, *, port_checked: bool) -> None:
        EngineBase.__init__(self, sleep_enabled=settings.enable_sleep, bucket_bytes=settings.bucket_bytes)
        self._settings = settings
        self._group = group
        self._engine: Any = None
        self._exit: ExitHandle | None = None
        self._processor: str | None = None
        self._sgl_released: set[str] = set()
        self._unsynced = False
        self._load_call: _LoadCall | None = None
        self._gpu: torch.device | None = None
        config = read_model_config(settings.model_path)
        self._vocab = vocab_size(config)
        self._multimodal = any(k in config for k in ("vision_config", "visual", "vision_tower"))
        self._spec = weight_spec(settings.model_path, config, settings.dtype)
        t = group.topology
        self._base_gpu_id = settings.base_gpu_id if settings.base_gpu_id is not None else t.base_gpu_id
        port = int(settings.server_overrides.get("port", t.port))

        def start() -> None:
            if not port_checked or "port" in settings.server_overrides:
                check_port_free(port)
            self._start(port)

        self._on_leader("start the engine", start)
        _live.add(self)

    # ---- plumbing ------------------------------------------------------------------------------------------
    @property
    def group(self) -> EngineGroup:
        """This rank's TP group (topology, leader, collectives)."""
        return self._group

    @property
    def settings(self) -> SGLangSettings:
        return self._settings

    @property
    def weight_sync_mode(self) -> str:
        """How ``load_weights`` hands tensors over (``handles``, ``flattened``, ``per_param``); settable, so a
        benchmark can compare modes on one engine."""
        return self._settings.weight_sync_mode

    @weight_sync_mode.setter
    def weight_sync_mode(self, mode: str) -> None:
        if mode not in WEIGHT_SYNC_MODES:
            raise InvalidArgumentError(f"weight_sync_mode={mode!r}: allowed are {', '.join(WEIGHT_SYNC_MODES)}")
        bucket = self._settings.bucket_bytes
        if bucket == DEFAULT_BUCKET_BYTES[self._settings.weight_sync_mode]:
            bucket = DEFAULT_BUCKET_BYTES[mode]  # a default bucket follows the mode (flattened ones are copies)
        self._settings = dataclasses.replace(self._settings, weight_sync_mode=mode, bucket_bytes=bucket)
        self.default_bucket_bytes = bucket

    @property
    def sglang_engine(self) -> Any:
        """The ``sglang.Engine`` (on the group leader; None on the other ranks)."""
        return self._engine

    def _on_leader(self, op: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the leader; its result, or its error, reaches every rank of the group."""
        g = self._group
        if g.topology.tp_size == 1:
            return fn()
        payload: tuple[str, Any] | None = None
        error: BaseException | None = None
        if g.is_leader:
            try:
                payload = ("ok", fn())
            except Exception as exc:
                error = exc
                payload = ("err", _portable(exc, g.topology.rank))
        kind, value = g.broadcast_object(payload, op=op)
        if kind == "err":
            if error is not None:
                raise error
            raise value
        return value  # type: ignore[no-any-return]

    def _start(self, port: int) -> None:
        from genengine.lifecycle import at_exit

        try:
            from sglang.srt.entrypoints.engine import Engine
            from sglang.srt.server_args import ServerArgs
        except ImportError as exc:
            raise BackendImportError(
                f"the sglang backend needs SGLang 0.5.17 (pip install 'genengine[sglang]'): {exc}"
            ) from exc
        kwargs = server_kwargs(self._settings, base_gpu_id=self._base_gpu_id, port=port)
        known = {f.name for f in dataclasses.fields(ServerArgs)}
        for key in kwargs:
            if key not in known:
                hint = closest(key, known)
                raise ConfigError(
                    f"SGLang has no server argument {key!r}" + (f" (did you mean {hint!r}?)" if hint else "")
                )
        check_graph_memory_saver(kwargs, os.environ)
        trainer_sigterm = signal.getsignal(signal.SIGTERM)
        with _engine_environment(self._settings.enable_sleep):
            try:
                engine = Engine(**kwargs)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"SGLang rejected the engine settings: {exc}") from exc
        # SGLang's own exit hook kills every child of this process (a trainer's data-loader workers too);
        # ours stops this engine's processes only, if the trainer exits without shutdown() (its scheduler
        # processes are not daemons: multiprocessing would wait on them forever).
        atexit.unregister(engine.shutdown)
        self._exit = at_exit(lambda: _stop_sglang(engine), name="sglang engine", pids=list(engine.get_all_child_pids()))
        self._engine = engine
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
        from genengine_sglang._logits import serialized_processor

        self._processor = serialized_processor()

    def _device(self) -> torch.device | None:
        """This rank's GPU (where its tensors must be for CUDA IPC), or None without CUDA."""
        import torch

        if not torch.cuda.is_available():
            return None
        if self._gpu is None:
            self._gpu = torch.device("cuda", self._group.topology.gpu_id)
        return self._gpu

    def _settle_memory(self) -> None:
        """Return once this rank's GPU shows no more memory coming free (bounded by ``release_timeout_s``).

        SGLang answers after unmapping; reading the device's free memory until it stops changing makes sure
        the trainer's next allocation sees it, instead of racing it (the OOM users hit).
        """
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        device = self._group.topology.gpu_id
        deadline = time.monotonic() + self._settings.release_timeout_s
        torch.cuda.synchronize(device)
        previous = torch.cuda.mem_get_info(device)[0]
        while time.monotonic() < deadline:
            time.sleep(0.005)
            free = torch.cuda.mem_get_info(device)[0]
            if abs(free - previous) < 2 * _MIB:
                return
            previous = free

    # ---- EngineBase hooks ----------------------------------------------------------------------------------
    def _vocab_size(self) -> int | None:
        return self._vocab

    def _weight_spec(self) -> Mapping[str, WeightInfo]:
        return self._spec

    def _generate(self, requests: list[Request]) -> list[GenerationResult]:
        if not self._multimodal and any(r.image is not None for r in requests):
            raise InvalidArgumentError(
                f"image_data given, but {self._settings.model_path} is not a vision-language model "
                "(its config.json has no vision_config)"
            )
        if self._settings.skip_tokenizer_init and any(r.image is not None for r in requests):
            raise InvalidArgumentError(
                "image prompts need the tokenizer: create the engine with skip_tokenizer_init=False"
            )
        entries = build_entries(
            requests, deterministic=self._settings.deterministic, has_tokenizer=not self._settings.skip_tokenizer_init
        )
        if not self._settings.deterministic and any(r.params.seed is not None for r in requests):
            _warn_seed()

        def run() -> list[GenerationResult]:
            from sglang.srt.managers.io_struct import GenerateReqInput

            by_index = {r.index: r for r in requests}
            kwargs: dict[str, Any] = {
                "sampling_params": [e.params for e in entries],
                "return_logprob": [e.logprobs for e in entries],
                "return_prompt_token_ids": True,
            }
            if requests[0].prompt is not None:
                kwargs["text"] = [by_index[e.request].prompt for e in entries]
            else:
                kwargs["input_ids"] = [list(by_index[e.request].prompt_token_ids or ()) for e in entries]
            if any(r.image is not None for r in requests):
                kwargs["image_data"] = [by_index[e.request].image for e in entries]
            if any(e.use_filter for e in entries):
                kwargs["custom_logit_processor"] = [self._processor if e.use_filter else None for e in entries]
            outputs = self._call_sglang(GenerateReqInput(**kwargs))
            tokenizer = getattr(self._engine.tokenizer_manager, "tokenizer", None)
            decode = None if tokenizer is None else lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
            return results_from_sglang(requests, entries, outputs, decode)

        return self._on_leader("generate", run)

    def _call_sglang(self, obj: Any) -> Any:
        """``sglang.Engine.generate``'s own path (tokenizer manager, in the engine's event loop) for a request
        it cannot build: per-request logprob flags and logit processors, and ``return_prompt_token_ids``."""
        engine = self._engine
        try:
            generator = engine.tokenizer_manager.generate_request(obj, None)
            return engine.loop.run_until_complete(generator.__anext__())
        except GenEngineError:
            raise
        except ValueError as exc:
            raise InvalidArgumentError(f"SGLang rejected the request: {exc}") from exc

    def _release(self, level: int) -> None:
        tags = [TAG_KV_CACHE, TAG_CUDA_GRAPH]
        if level == 2 or self._settings.weights_cpu_backup:
            tags.insert(0, TAG_WEIGHTS)
        self._on_leader("sleep", lambda: self._engine.release_memory_occupation(tags=tags))
        self._sgl_released.update(tags)
        self._settle_memory()

    def _resume(self, tags: tuple[str, ...]) -> None:
        todo = [t for t in tags if t in self._sgl_released]
        if todo:
            self._on_leader("wake", lambda: self._engine.resume_memory_occupation(tags=todo))
            self._sgl_released.difference_update(todo)

    def _apply_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        import torch

        call = self._load_call or _LoadCall(self._settings.weight_sync_mode, None, True)
        names = [name for name, _ in bucket]
        payload, keep = _weightsync.producer_payload(call.mode, bucket, self._device())
        gathered = self._group.gather_object((names, payload))
        synced = self._settings.weight_sync_barrier == "loader"
        ranks = self._group.topology.tp_group_ranks

        def run() -> None:
            assert gathered is not None  # the leader always gets the list
            for rank, (rank_names, _) in zip(ranks, gathered, strict=True):
                if rank_names != names:
                    raise InconsistentInputsError(
                        f"rank {rank} passed weights {rank_names[:3]}... where the leader passed {names[:3]}...: "
                        "every rank of a TP group must pass the same names in the same order"
                    )
            payloads = [p for _, p in gathered]
            _weightsync.apply_payloads(self._engine, call.mode, payloads, synced=synced, load_format=call.load_format)

        try:
            self._on_leader("load_weights", run)
        finally:
            # Our temporaries (flattened buffers, device copies) go back to the allocator once SGLang has
            # dropped its references (it has: it answered); ipc_collect reclaims them now, bounding memory.
            keep.clear()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.ipc_collect()
        if call.mode != "handles" or not synced:
            self._unsynced = True

    def _bucket_cost(self, tensor: torch.Tensor) -> int:
        """A handle to a dense tensor already on this rank's GPU is read in place by the scheduler: no copy,
        so all such tensors go in one SGLang call (a 7B load in one call took half the time of 15 on the
        H200). Anything copied first (a host tensor, a gathered DTensor, a view made contiguous, every
        tensor of the flattened mode) counts in full, so ``bucket_bytes`` still bounds the extra memory."""
        import torch

        mode = (self._load_call or _LoadCall(self._settings.weight_sync_mode, None, True)).mode
        in_place = type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.is_contiguous()
        if mode == "handles" and in_place and tensor.device == self._device():
            return 0
        return super()._bucket_cost(tensor)

    def _finish_weights(self) -> None:
        call = self._load_call
        flush = True if call is None else call.flush
        barrier = self._unsynced and self._settings.weight_sync_barrier == "loader"
        if flush or barrier:
            tp = self._group.topology.tp_size
            self._on_leader("load_weights barrier", lambda: _weightsync.barrier(self._engine, tp, flush=flush))
        self._unsynced = False

    def _flush_cache(self) -> None:
        def run() -> None:
            ret = self._engine.flush_cache()
            if getattr(ret, "success", True) is False:
                raise SGLangEngineError(f"SGLang did not flush its cache (requests still running?): {ret}")

        self._on_leader("flush_cache", run)

    def _shutdown(self) -> None:
        def stop() -> list[int]:
            pids: list[int] = []
            if self._engine is not None:
                pids = list(self._engine.get_all_child_pids())
                _stop_sglang(self._engine)
            if self._exit is not None:
                self._exit.cancel()
            return pids

        pids: list[int] = []
        try:
            if self._engine is not None or not self._group.is_leader:
                pids = self._on_leader("shutdown", stop)
        finally:
            self._engine = None
            _live.discard(self)
        self._wait_processes_off_gpu(pids)
        self._settle_memory()

    def _wait_processes_off_gpu(self, pids: list[int]) -> None:
        """Return once none of the engine's processes holds memory on this rank's GPU (bounded).

        A killed process's GPU memory comes back some time after it exits; the free-memory reading is stable
        meanwhile, so only the driver's list of processes on the device tells when shutdown is really done.
        """
        if not pids:
            return
        try:
            import pynvml  # nvidia-ml-py
            import torch

            pynvml.nvmlInit()
            uuid = torch.cuda.get_device_properties(self._group.topology.gpu_id).uuid
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except Exception:
            return
        deadline = time.monotonic() + self._settings.release_timeout_s
        wanted = set(pids)
        while time.monotonic() < deadline:
            running = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            if not running & wanted:
                return
            time.sleep(0.01)

    # ---- the protocol, with the reference's face on the same methods ---------------------------------------
    def generate(  # type: ignore[override]
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: Any = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        image_data: Any = None,
        prompt: Any = _UNSET,
        input_ids: Any = _UNSET,
        return_logprob: Any = _UNSET,
        logprob_start_len: Any = _UNSET,
        top_logprobs_num: Any = _UNSET,
        lora_path: Any = _UNSET,
        custom_logit_processor: Any = _UNSET,
        gather_inputs: Any = _UNSET,
    ) -> Any:
        """Protocol: ``generate(prompts, sampling_params, *, prompt_token_ids, image_data) -> list[GenerationResult]``.

        Reference (when any of ``prompt``, ``input_ids``, ``return_logprob``, ``logprob_start_len``,
        ``top_logprobs_num``, ``lora_path``, ``custom_logit_processor``, ``gather_inputs`` is passed):
        SGLang's arguments, SGLang's output dicts (a dict for a single prompt, a list otherwise). With
        ``gather_inputs=True`` every rank's prompts are generated together and each rank gets its own back.
        """
        given = {
            "prompt": prompt,
            "input_ids": input_ids,
            "return_logprob": return_logprob,
            "logprob_start_len": logprob_start_len,
            "top_logprobs_num": top_logprobs_num,
            "lora_path": lora_path,
            "custom_logit_processor": custom_logit_processor,
            "gather_inputs": gather_inputs,
        }
        reference = {k: v for k, v in given.items() if v is not _UNSET}
        if reference:
            if prompts is not None or prompt_token_ids is not None:
                raise InvalidArgumentError(
                    "mixed call: prompts/prompt_token_ids are the protocol's arguments, "
                    f"{', '.join(reference)} the reference's; use prompt=/input_ids= with the latter"
                )
            return self._generate_reference(sampling_params, image_data, **reference)
        self._check_open()
        if self._group.topology.tp_size > 1 and self._settings.check_inputs:
            self._group.check_consistent(
                (prompts, sampling_params, prompt_token_ids, image_data), what="generate inputs"
            )
        return super().generate(prompts, sampling_params, prompt_token_ids=prompt_token_ids, image_data=image_data)

    def sleep(self, level: int = 1, *, release_weights: Any = _UNSET) -> None:
        """Protocol: ``sleep(level)``. Reference: ``sleep(release_weights=False)`` is level 1 (KV cache and CUDA
        graphs released, weights kept), ``sleep(release_weights=True)`` level 2 (weights released too; send
        them again after ``wake_up``)."""
        if release_weights is not _UNSET:
            if not isinstance(release_weights, bool):
                raise InvalidArgumentError(f"release_weights={release_weights!r} must be True or False")
            level = 2 if release_weights else 1
        super().sleep(level)

    def wake(self, tags: str | Sequence[str] | None = None) -> None:
        if tags is not None:
            wanted = [tags] if isinstance(tags, str) else list(tags) if isinstance(tags, Iterable) else None
            if (
                wanted
                and all(t in self.supported_tags for t in wanted)
                and (TAG_WEIGHTS in wanted or TAG_KV_CACHE in wanted)
                and TAG_CUDA_GRAPH not in wanted
            ):
                tags = [*wanted, TAG_CUDA_GRAPH]
        super().wake(tags)

    def wake_up(self, release_weights: bool = False) -> None:
        """Reference: take every released memory back (``release_weights`` is accepted for compatibility:
        whatever ``sleep`` released comes back)."""
        if not isinstance(release_weights, bool):
            raise InvalidArgumentError(f"release_weights={release_weights!r} must be True or False")
        self.wake()

    def _generate_reference(self, sampling_params: Any, image_data: Any, **kwargs: Any) -> Any:
        """The reference's generate: SGLang's arguments in, SGLang's output dicts out, every rank the same."""
        self._check_open()
        self._check_can_generate()
        gather = kwargs.pop("gather_inputs", False)
        if not isinstance(gather, bool):
            raise InvalidArgumentError(f"gather_inputs={gather!r} must be True or False")
        prompt, input_ids = kwargs.get("prompt"), kwargs.get("input_ids")
        if (prompt is None) == (input_ids is None):
            raise InvalidArgumentError("give prompt (text) or input_ids (token ids), exactly one of them")
        if prompt is not None and self._settings.skip_tokenizer_init:
            raise InvalidArgumentError(
                "prompt (text) needs the tokenizer, but the engine was created with skip_tokenizer_init=True"
            )
        args = {k: v for k, v in {"sampling_params": sampling_params, "image_data": image_data, **kwargs}.items()}
        args = {k: v for k, v in args.items() if v is not None}
        if not gather or self._group.topology.tp_size == 1:
            return self._on_leader("generate", lambda: self._engine.generate(**args))

        key = "prompt" if prompt is not None else "input_ids"
        single = isinstance(prompt, str) or (input_ids is not None and _flat_ids(input_ids))
        local: dict[str, list[Any]] = {key: [args[key]] if single else list(args[key])}
        for name in ("image_data", "custom_logit_processor", *_PER_PROMPT):
            value = args.get(name)
            if name == "image_data" and value is not None:
                local[name] = [value] if single else list(value)
            elif isinstance(value, list) and name != "image_data":
                local[name] = value
        shared = {k: v for k, v in args.items() if k not in local}
        gathered = self._group.gather_object(local)
        ranks = self._group.topology.tp_group_ranks

        def run() -> tuple[Any, list[int]]:
            assert gathered is not None
            for rank, part in zip(ranks, gathered, strict=True):
                if sorted(part) != sorted(local):
                    raise InconsistentInputsError(
                        f"with gather_inputs, every rank must pass the same kinds of arguments: rank {rank} passed "
                        f"{sorted(part)}, the leader {sorted(local)}"
                    )
            merged = {k: [x for part in gathered for x in part[k]] for k in local}
            return self._engine.generate(**merged, **shared), [len(part[key]) for part in gathered]

        out, counts = self._on_leader("generate", run)
        params = sampling_params[0] if isinstance(sampling_params, list) and sampling_params else sampling_params
        n = int(params.get("n", 1)) if isinstance(params, Mapping) else 1
        index = self._group.topology.tp_rank
        start = sum(counts[:index]) * n
        mine = out[start : start + counts[index] * n]
        return mine[0] if single and n == 1 else mine

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int | None = None,
        check_finite: bool = False,
    ) -> LoadReport:
        call = _LoadCall(self._settings.weight_sync_mode, None, True)
        return self._load(named_tensors, bucket_bytes, call, check_finite=check_finite)

    def update_weights_from_tensor(
        self, name: str, tensor: torch.Tensor, flush_cache: bool = False, load_format: str | None = None
    ) -> None:
        """Reference: one weight, checked by name and shape like ``load_weights``, in one SGLang call (as
        LightRFT sends them); the prefix cache is flushed only with ``flush_cache=True``."""
        if not isinstance(flush_cache, bool):
            raise InvalidArgumentError(f"flush_cache={flush_cache!r} must be True or False")
        if load_format is not None and not isinstance(load_format, str):
            raise InvalidArgumentError(f"load_format={load_format!r} must be None or a string")
        self._load([(name, tensor)], None, _LoadCall("per_param", load_format, flush_cache))

    def _load(
        self, named_tensors: Any, bucket_bytes: int | None, call: _LoadCall, *, check_finite: bool = False
    ) -> LoadReport:
        self._load_call = call
        self._unsynced = False
        failed = True
        try:
            report = super().load_weights(named_tensors, bucket_bytes=bucket_bytes, check_finite=check_finite)
            failed = False
            return report
        except CollectiveTimeoutError:
            self._unsynced = False  # the group is out of step: no further collective
            raise
        finally:
            self._load_call = None
            if self._unsynced and self._settings.weight_sync_barrier == "loader" and self._engine_up():
                # The trainer may change its tensors once we return: wait for the scheduler's last copies.
                self._unsynced = False
                tp = self._group.topology.tp_size
                try:
                    self._on_leader("load_weights barrier", lambda: _weightsync.barrier(self._engine, tp, flush=False))
                except Exception:
                    if not failed:
                        raise

    def _engine_up(self) -> bool:
        return not self.closed and (self._engine is not None or not self._group.is_leader)


def return_sigterm(loop: Any, handler: Any) -> None:
    """Take SIGTERM off ``loop`` (an asyncio loop's handler runs only while the loop runs) and reinstall
    ``handler``, the process's disposition from before (``signal.getsignal``; None means the default)."""
    loop.remove_signal_handler(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL if handler is None else handler)


def _warn_seed() -> None:
    global _seed_warned
    if not _seed_warned:
        _seed_warned = True
        warnings.warn(
            "SGLang ignores per-request seeds unless the engine runs with option "
            "enable_deterministic_inference=True; seeded requests are not reproducible",
            RuntimeWarning,
            stacklevel=4,
        )


def _flat_ids(value: Any) -> bool:
    """A single prompt's token ids (``[1, 2, 3]``) rather than a batch (``[[1, 2], [3]]``)."""
    return isinstance(value, Sequence) and bool(value) and all(isinstance(t, int) for t in value)
