"""``SGLangEngine``: SGLang (0.5.12 - 0.5.17) behind genengine's protocol (``genengine.protocol.GenerationEngine``).

One engine per tensor-parallel group: the group's first rank (its *leader*) owns an ``sglang.Engine`` spanning
the group's GPUs; every rank calls every method, the leader does the engine work, and its result (or error) is
broadcast over the group's gloo group, so all ranks return the same thing or raise the same error. Sleep levels
map onto SGLang's memory-saver tags ``weights``, ``kv_cache``, ``cuda_graph`` (docs/upstream.md); async requests
are served by the leader through SGLang's own calls (:mod:`genengine_sglang._async`, on the loop that
:mod:`genengine_sglang._loop` runs; docs/async.md). LightRFT's API is the subclass in
:mod:`genengine_sglang.lightrft`, which nothing here imports; this class is the protocol alone.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from genengine.backend import (
    TAG_KV_CACHE,
    TAG_WEIGHTS,
    AsyncEngineBase,
    EngineConfig,
    GenerationResult,
    LoadReport,
    Request,
)
from genengine.distributed import (
    EngineGroup,
    check_port_free,
    group_seed,
)
from genengine.engine.checkpoint import read_model_config, vocab_size, weight_spec
from genengine.engine.lifecycle import track_engine, untrack_engine
from genengine.errors import (
    CollectiveTimeoutError,
    EngineStateError,
    GenEngineError,
    InconsistentInputsError,
    InvalidArgumentError,
)
from genengine_sglang import _process, _weightsync
from genengine_sglang._group import collective_timeout, make_group, on_leader
from genengine_sglang._weightsync import LoadCall
from genengine_sglang.adapters import SGLangAdapters
from genengine_sglang.compat import request_prompt_ids, with_prompt_ids
from genengine_sglang.errors import SGLangEngineError
from genengine_sglang.mapping import build_entries, results_from_sglang
from genengine_sglang.settings import (
    DEFAULT_BUCKET_BYTES,
    WEIGHT_SYNC_MODES,
    SGLangSettings,
    resolve_settings,
    server_kwargs,
)

if TYPE_CHECKING:
    import torch

    from genengine.backend import AsyncRequest, LoadSession, WeightInfo
    from genengine.engine.lifecycle import ExitHandle
    from genengine_sglang._async import AsyncDriver
    from genengine_sglang._loop import LoopThread

__all__ = ["TAG_CUDA_GRAPH", "SGLangEngine"]

TAG_CUDA_GRAPH = "cuda_graph"
T = TypeVar("T")
_E = TypeVar("_E", bound="SGLangEngine")

_seed_warned = False


# ---- the engine --------------------------------------------------------------------------------------------
class SGLangEngine(SGLangAdapters, AsyncEngineBase):  # type: ignore[misc,override]  # adapters: per instance
    """The SGLang engine of one tensor-parallel group (see the module docstring)."""

    supported_tags: tuple[str, ...] = (TAG_WEIGHTS, TAG_KV_CACHE, TAG_CUDA_GRAPH)
    supports_images: ClassVar[bool] = True
    """Image prompts reach SGLang's multimodal processor on VLMs; text-only models reject them."""

    def __init__(
        self, settings: SGLangSettings, group: EngineGroup | None = None, *, require_distributed: bool = False
    ) -> None:
        """Start the engine of this rank's TP group; collective: every rank of the group calls it.

        ``group`` is this rank's TP group; None builds it from the trainer's ``torch.distributed`` world,
        which is optional at ``tp_size=1`` unless ``require_distributed`` (LightRFT's contract). Prefer
        ``genengine.create_engine(backend="sglang", ...)`` or :meth:`from_config`.
        """
        port_checked = False
        if group is None:
            group, port_checked = make_group(settings, require_distributed=require_distributed)
        super().__init__(sleep_enabled=settings.enable_sleep, bucket_bytes=settings.bucket_bytes)
        self._settings = settings
        self._group = group
        #: SGLang's ``random_seed`` and the source of the seeds of unseeded sampled requests in deterministic
        #: mode (mapping.sampling_to_sglang): a rerun of the same calls samples the same tokens.
        self.group_seed = group_seed(settings.seed, group.topology)
        self._seed_rng = random.Random(self.group_seed)
        self._engine: Any = None
        self._loop_thread: LoopThread | None = None
        self._driver: AsyncDriver | None = None
        self._cache_epoch = 0
        """Bumped when a weight load cannot flush SGLang's prefix cache (requests hold their KV in an in-place
        pause): requests from then on use a radix-cache namespace of their own (``_cache_key``)."""
        self._exit: ExitHandle | None = None
        self._processor: str | None = None
        self._sgl_released: set[str] = set()
        self._unsynced = False
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
        track_engine(self)

    @classmethod
    def from_config(cls: type[_E], config: EngineConfig) -> _E:
        """What ``genengine.create_engine(backend="sglang", ...)`` calls: settings resolved once, then started.

        Backend options (``attention_backend``, ``sampling_backend``, ``disable_radix_cache``, ``port``,
        ``weight_sync_mode``, ...; see ``genengine_sglang.settings``) come in ``config.options``, merged over
        ``$GENENGINE_SGLANG_OPTIONS``. With ``tp_size=1`` torch.distributed is optional.
        """
        return cls(resolve_settings(config))

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
        return on_leader(self._group, op, fn)

    def _start(self, port: int) -> None:
        kwargs = server_kwargs(self._settings, base_gpu_id=self._base_gpu_id, port=port, group_seed=self.group_seed)
        self._engine, self._exit = _process.launch(kwargs, enable_sleep=self._settings.enable_sleep)
        from genengine_sglang._logits import serialized_processor
        from genengine_sglang._loop import LoopThread

        # A delegated SGLang call gets the engine's own bound (the collective timeout), as every rank waits that long.
        self._loop_thread = LoopThread(self._engine.loop, call_timeout_s=collective_timeout(self._settings))
        self._processor = serialized_processor()

    def _device(self) -> torch.device | None:
        """This rank's GPU (where its tensors must be for CUDA IPC), or None without CUDA."""
        import torch

        if not torch.cuda.is_available():
            return None
        if self._gpu is None:
            self._gpu = torch.device("cuda", self._group.topology.gpu_id)
        return self._gpu

    def _sgl(self, fn: Callable[[], T], what: str = "an SGLang call") -> T:
        """Run a sync SGLang call (one that runs SGLang's event loop) with the loop to itself: in this thread,
        or, while async requests keep the loop running in ours (or this thread is inside a coroutine, where
        SGLang's loop cannot run), on that thread (``_loop.LoopThread``). ``what`` names it in errors."""
        driver = self._loop_thread
        return fn() if driver is None else driver.call(fn, what)

    def _cache_key(self) -> str | None:
        """The radix-cache namespace of new requests (``GenerateReqInput.extra_key``); None: SGLang's default."""
        return None if self._cache_epoch == 0 else f"genengine-weights-{self._cache_epoch}"

    def _check_sync_generate(self) -> None:
        if self._driver is not None:
            self._driver.check_not_paused_in_place("generate")

    def _check_request_kinds(self, requests: Sequence[Request]) -> None:
        if not self._multimodal and any(r.image is not None for r in requests):
            raise InvalidArgumentError(
                f"image_data given, but {self._settings.model_path} is not a vision-language model "
                "(its config.json has no vision_config)"
            )
        if self._settings.skip_tokenizer_init and any(r.image is not None for r in requests):
            raise InvalidArgumentError(
                "image prompts need the tokenizer: create the engine with skip_tokenizer_init=False"
            )

    # ---- EngineBase hooks ----------------------------------------------------------------------------------
    def _vocab_size(self) -> int | None:
        return self._vocab

    def _weight_spec(self) -> Mapping[str, WeightInfo]:
        return self._spec

    def _draw_seed(self) -> int:
        return self._seed_rng.getrandbits(61)

    def _generate(self, requests: list[Request]) -> list[GenerationResult]:
        self._check_request_kinds(requests)
        entries = build_entries(
            requests,
            deterministic=self._settings.deterministic,
            has_tokenizer=not self._settings.skip_tokenizer_init,
            draw_seed=self._draw_seed,
        )
        if not self._settings.deterministic and any(r.params.seed is not None for r in requests):
            _warn_seed()

        def run() -> list[GenerationResult]:
            from sglang.srt.managers.io_struct import GenerateReqInput

            self._check_sync_generate()
            by_index = {r.index: r for r in requests}
            kwargs: dict[str, Any] = {
                "sampling_params": [e.params for e in entries],
                "return_logprob": [e.logprobs for e in entries],
            }
            if requests[0].prompt is not None:
                kwargs["text"] = [by_index[e.request].prompt for e in entries]
            else:
                kwargs["input_ids"] = [list(by_index[e.request].prompt_token_ids or ()) for e in entries]
            if any(r.image is not None for r in requests):
                kwargs["image_data"] = [by_index[e.request].image for e in entries]
            if any(e.use_filter for e in entries):
                kwargs["custom_logit_processor"] = [self._processor if e.use_filter else None for e in entries]
            key, paths = self._cache_key(), Request.adapter_handles(requests, [e.request for e in entries])
            if key is not None:
                kwargs["extra_key"] = key
            if paths is not None:
                kwargs["lora_path"] = paths  # GenerateReqInput.lora_path: the adapter's SGLang name per entry
            tokenizer = getattr(self._engine.tokenizer_manager, "tokenizer", None)
            prompt_ids = request_prompt_ids(kwargs, tokenizer)  # SGLang's flag, or our tokenization (< 0.5.13)
            outputs = with_prompt_ids(self._call_sglang(GenerateReqInput(**kwargs)), prompt_ids)
            decode = None if tokenizer is None else lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
            return results_from_sglang(requests, entries, outputs, decode)

        return self._on_leader("generate", run)

    def _call_sglang(self, obj: Any) -> Any:
        """``sglang.Engine.generate``'s own path (tokenizer manager, in the engine's event loop) for a request
        it cannot build: per-request logprob flags and logit processors, and ``return_prompt_token_ids``."""
        engine = self._engine
        try:
            generator = engine.tokenizer_manager.generate_request(obj, None)
            return self._sgl(lambda: engine.loop.run_until_complete(generator.__anext__()), "SGLang's generate")
        except GenEngineError:
            raise
        except ValueError as exc:
            raise InvalidArgumentError(f"SGLang rejected the request: {exc}") from exc

    def _release(self, level: int) -> None:
        tags = [TAG_KV_CACHE, TAG_CUDA_GRAPH]
        if level == 2 or self._settings.weights_cpu_backup:
            tags.insert(0, TAG_WEIGHTS)

        def run() -> None:
            if self._driver is not None:
                self._driver.quiesce("sleep")  # SGLang's release_memory_occupation asserts it is idle
            self._sgl(lambda: self._engine.release_memory_occupation(tags=tags), "SGLang's release_memory_occupation")

        self._on_leader("sleep", run)
        self._sgl_released.update(tags)
        self._settle_memory()

    def _resume(self, tags: tuple[str, ...]) -> None:
        todo = [t for t in tags if t in self._sgl_released]
        if todo:
            self._on_leader(
                "wake",
                lambda: self._sgl(
                    lambda: self._engine.resume_memory_occupation(tags=todo), "SGLang's resume_memory_occupation"
                ),
            )
            self._sgl_released.difference_update(todo)

    def _call(self, session: LoadSession) -> LoadCall:
        """How ``session`` hands its tensors over: its own mode (``_load``'s), or the protocol's default."""
        mode = session.mode
        if isinstance(mode, LoadCall):
            return mode
        return LoadCall(self._settings.weight_sync_mode, None, True)

    @property
    def passes_tensors_on(self) -> bool:
        """A load session's tensors (the default ``weight_sync_mode``) go to SGLang's scheduler processes by CUDA
        IPC, where the handles and per-parameter modes pass on the very tensors written (the flattened mode
        packs them into a buffer of its own first): a ``cuda_ipc`` sender shares them twice for this."""
        return self._settings.weight_sync_mode in ("handles", "per_param")

    def _apply_weights(self, bucket: list[tuple[str, torch.Tensor]], session: LoadSession) -> None:
        import torch

        call = self._call(session)
        names = [name for name, _ in bucket]
        payload, keep = _weightsync.producer_payload(call.mode, bucket, self._device(), session.pass_on)
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
            self._sgl(
                lambda: _weightsync.apply_payloads(
                    self._engine, call.mode, payloads, synced=synced, load_format=call.load_format
                ),
                "SGLang's update_weights_from_tensor",
            )

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

    def _bucket_cost(self, tensor: torch.Tensor, session: LoadSession) -> int:
        """A handle to a dense tensor already on this rank's GPU is read in place by the scheduler: no copy,
        so all such tensors go in one SGLang call (a 7B load in one call took half the time of 15 on the
        H200). Anything copied first (a host tensor, a gathered DTensor, a view made contiguous, every
        tensor of the flattened mode) counts in full, so ``bucket_bytes`` still bounds the extra memory."""
        import torch

        mode = self._call(session).mode
        in_place = type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.is_contiguous()
        if mode == "handles" and in_place and tensor.device == self._device():
            return 0
        return super()._bucket_cost(tensor, session)

    def _finish_weights(self, session: LoadSession) -> None:
        flush = self._call(session).flush
        barrier = self._unsynced and self._settings.weight_sync_barrier == "loader"
        if flush or barrier:
            tp = self._group.topology.tp_size

            def run() -> None:
                do_flush = flush and not self._cannot_flush()
                if do_flush or barrier:
                    self._sgl(lambda: _weightsync.barrier(self._engine, tp, flush=do_flush), "the load_weights barrier")
                if do_flush:
                    self._cache_epoch = 0

            self._on_leader("load_weights barrier", run)
        self._unsynced = False

    def _cannot_flush(self) -> bool:
        """On the leader, before a cache flush: True when requests keep their KV in SGLang (an in-place
        pause), where a flush fails (and one inside a weight update kills the scheduler:
        ``flush_cache_after_weight_update`` asserts it): new requests get a fresh radix namespace instead, so none
        reuses a prefix computed with the old weights. Otherwise waits until SGLang has finished what was
        aborted, so that the flush finds it idle."""
        aio = self._driver
        if aio is None:
            return False
        if aio.keeps_kv():
            self._cache_epoch += 1
            return True
        aio.quiesce("the cache flush")
        return False

    def _flush_cache(self) -> None:
        def run() -> None:
            if self._cannot_flush():
                return
            ret = self._sgl(self._engine.flush_cache, "SGLang's flush_cache")
            if getattr(ret, "success", True) is False:
                raise SGLangEngineError(f"SGLang did not flush its cache (requests still running?): {ret}")
            self._cache_epoch = 0

        self._on_leader("flush_cache", run)

    def _shutdown(self) -> None:
        self._end_async()

        def stop() -> list[int]:
            pids: list[int] = []
            if self._engine is not None:
                pids = list(self._engine.get_all_child_pids())
                _process.stop_sglang(self._engine)
            if self._exit is not None:
                self._exit.cancel()
            return pids

        pids: list[int] = []
        try:
            if self._engine is not None or not self._group.is_leader:
                pids = self._on_leader("shutdown", stop)
        finally:
            self._engine = None
            self._drop_adapter_buffers()
            untrack_engine(self)
        _process.wait_processes_off_gpu(pids, self._group.topology.gpu_id, self._settings.release_timeout_s)
        self._settle_memory()

    def _settle_memory(self) -> None:
        _process.settle_memory(self._group.topology.gpu_id, self._settings.release_timeout_s)

    def _check_consistent(self, what: str, value: Callable[[], object]) -> None:
        """With ``check_inputs`` (the default) every rank's call is compared first (``EngineBase`` calls this at
        each generate and load), so a TP group never runs one rank's prompts for another."""
        if self._group.topology.tp_size > 1 and self._settings.check_inputs:
            self._group.check_consistent(value(), what=what)

    # ---- the protocol ----------------------------------------------------------------------------------------
    def wake(self, tags: str | Sequence[str] | None = None) -> None:
        """The protocol's wake; ``cuda_graph`` comes back with the first of ``weights``/``kv_cache``."""
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

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int | None = None,
        check_finite: bool = False,
        version: int | None = None,
    ) -> LoadReport:
        call = LoadCall(self._settings.weight_sync_mode, None, True)
        return self._load(named_tensors, bucket_bytes, call, check_finite=check_finite, version=version)

    def _load(
        self,
        named_tensors: Any,
        bucket_bytes: int | None,
        call: LoadCall,
        *,
        check_finite: bool = False,
        version: int | None = None,
    ) -> LoadReport:
        """``EngineBase.load_weights`` with ``call``'s way of handing tensors over (the session's ``mode``); its
        end (``_load_ended``) runs the loader barrier, so the trainer may change its tensors once this returns."""
        self._unsynced = False
        return self._load_weights(
            named_tensors, bucket_bytes=bucket_bytes, check_finite=check_finite, version=version, mode=call
        )

    def _load_ended(self, session: LoadSession, exc: BaseException | None) -> None:
        """Every load's end (``load_weights``' and a transport receiver's session) waits for the scheduler's last
        copies, so the trainer may change its tensors once it returns: also when the KV cache is asleep and no
        flush runs."""
        self._loader_barrier(exc)

    def _loader_barrier(self, exc: BaseException | None) -> None:
        """The barrier after tensors were handed over unsynced, unless the group is out of step after a
        collective timeout; its own error is raised only when the load (``exc`` None) succeeded."""
        if isinstance(exc, CollectiveTimeoutError):
            self._unsynced = False
        if self._unsynced and self._settings.weight_sync_barrier == "loader" and self._engine_up():
            self._unsynced = False
            tp = self._group.topology.tp_size
            try:
                self._on_leader(
                    "load_weights barrier",
                    lambda: self._sgl(
                        lambda: _weightsync.barrier(self._engine, tp, flush=False), "the load_weights barrier"
                    ),
                )
            except Exception:
                if exc is None:
                    raise

    def _engine_up(self) -> bool:
        return not self.closed and (self._engine is not None or not self._group.is_leader)

    # ---- async (genengine.engine.aio's hooks; genengine_sglang._async does the work) --------------------------
    def _check_async_available(self) -> None:
        """Async requests are served by the TP leader, where the engine is; the other ranks have none."""
        g = self._group
        if not g.is_leader:
            raise EngineStateError(
                f"the async calls run on the TP group's leader (rank {g.topology.leader_rank}) only: this is rank "
                f"{g.topology.rank} of a tp_size={g.topology.tp_size} group and holds no SGLang engine; call them "
                "on the leader (the synchronous calls stay collective)"
            )

    def _async_driver(self) -> AsyncDriver:
        if self._driver is None:
            from genengine_sglang._async import AsyncDriver

            assert self._loop_thread is not None and self._engine is not None  # on the leader, started
            self._driver = AsyncDriver(
                self._loop_thread,
                self._engine.tokenizer_manager,
                deterministic=self._settings.deterministic,
                processor=self._processor,
                extra_key=self._cache_key,
                timeout_s=collective_timeout(self._settings),
                dead=functools.partial(_process.dead_processes, self._engine),
            )
        return self._driver

    def _async_start(self, request: AsyncRequest) -> None:
        aio = self._async_driver()
        self._check_request_kinds([request.request])
        entries = build_entries(
            [request.request],
            deterministic=self._settings.deterministic,
            has_tokenizer=not self._settings.skip_tokenizer_init,
            draw_seed=self._draw_seed,
        )
        if not self._settings.deterministic and request.params.seed is not None:
            _warn_seed()
        aio.start(request, entries)

    def _async_abort(self, requests: list[AsyncRequest]) -> None:
        if self._driver is not None:
            self._driver.abort(requests)

    def _async_hold(self, clear_cache: bool) -> None:
        self._async_driver().hold(clear_cache)

    def _async_release_hold(self) -> None:
        self._async_driver().release()

    def _check_idle(self, what: str) -> None:
        if self._group.topology.tp_size == 1:
            return super()._check_idle(what)
        check = super()._check_idle  # the requests are the leader's: its answer is every rank's (or they desync)
        self._on_leader(f"{what} check", lambda: check(what))

    def _check_weights_may_change(self) -> None:
        if self._group.topology.tp_size == 1:
            return super()._check_weights_may_change()
        check = super()._check_weights_may_change
        self._on_leader("load_weights check", check)

    def _end_async(self) -> None:
        """Shutdown with requests in flight: each ends "abort" with the tokens it has, queued ones with none;
        then the loop's thread stops."""
        try:
            if self._driver is not None:
                self._driver.close()
            elif self._loop_thread is not None:
                self._loop_thread.close()
        except Exception as exc:  # SGLang's processes are stopped all the same
            warnings.warn(f"stopping the async requests failed: {exc!r}", RuntimeWarning, stacklevel=2)
        finally:
            self._abort_queued()


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
