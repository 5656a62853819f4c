"""``VLLMEngine``: vLLM (0.24.0 - 0.26.0) colocated in the trainer's own processes, behind genengine's protocol.

The engine core runs in this process, so ``load_weights`` writes the trainer's tensors straight into the model
(``LLM.apply_model``): no IPC, no second copy. Under the trainer's ``torch.distributed`` world every rank holds
one engine rank (``external_launcher``), deterministic only with identical inputs, so each call's inputs and
engine state are compared across the TP group first and every request carries an explicit seed. Sleep is vLLM's
sleep mode; shutdown leaves the trainer's default process group alive. Async (``tp_size=1``): a driver thread
steps vLLM's ``LLMEngine`` (:mod:`genengine_vllm._async`). How each choice maps onto vLLM: docs/upstream.md.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import random
from collections.abc import Callable, ItemsView, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from genengine.backend import (
    TAG_KV_CACHE,
    TAG_WEIGHTS,
    AsyncEngineBase,
    DriverLock,
    EngineConfig,
    GenerationResult,
    LoadReport,
    Request,
)
from genengine.distributed import group_seed
from genengine.engine.checkpoint import vocab_size, weight_spec
from genengine.engine.environ import scoped_environ
from genengine.engine.lifecycle import track_engine, untrack_engine
from genengine.errors import EngineStateError, InvalidArgumentError
from genengine_vllm import compat
from genengine_vllm._async import AsyncDriver, engine_stream
from genengine_vllm._process import (
    PROCESS_STATE,
    check_sleep_slot,
    claim_sleep_slot,
    drop_cuda_graphs,
    fresh_graph_pool,
    import_vllm,
    keep_default_group,
    preserve_rng_states,
    release_sleep_slot,
    start_environ,
    trainer_world,
    without_expandable_segments,
)
from genengine_vllm.adapters import VLLMAdapters, lora_base_names
from genengine_vllm.mapping import convert_request_output, load_image, split_greedy_n, vllm_sampling_kwargs
from genengine_vllm.settings import WEIGHT_SYNC_MODES, VLLMSettings, build_llm_kwargs, resolve_settings

if TYPE_CHECKING:
    import torch

    from genengine.backend import AsyncRequest, LoadSession, WeightInfo
    from genengine.distributed import EngineGroup, Topology

__all__ = ["VLLMEngine"]

_SEED_SPACE = 1 << 62  # vLLM treats seed -1 as "none" and adds the sample index to a seed: stay well inside int64


IN_PLACE = "in_place"
"""The load mode (``LoadSession.mode``) of a ``load_weights`` whose source holds its tensors (see ``_bucket_cost``)."""


# ---- worker-side helpers (run by collective_rpc on this process's worker) ----------------------------------
# collective_rpc calls them with vLLM's WorkerWrapperBase; its ``worker`` is the GPU worker.
def _stash_saved_buffers(wrapper: Any) -> None:
    worker = getattr(wrapper, "worker", wrapper)
    worker._genengine_stash = worker._sleep_saved_buffers
    worker._sleep_saved_buffers = {}


def _unstash_saved_buffers(wrapper: Any) -> None:
    worker = getattr(wrapper, "worker", wrapper)
    worker._sleep_saved_buffers = getattr(worker, "_genengine_stash", {})
    worker._genengine_stash = {}


# ---- the engine --------------------------------------------------------------------------------------------
class VLLMEngine(VLLMAdapters, AsyncEngineBase):  # type: ignore[misc,override]  # adapters: per instance
    """vLLM in the trainer's process: generate, sleep (levels 1 and 2), staged wake, in-place weight loads.

    Create it with :meth:`from_config` (what ``genengine.create_engine(backend="vllm", ...)`` calls) or
    :func:`genengine_vllm.lightrft.get_vllm_engine` (the reference's arguments). Backend options:
    ``skip_tokenizer_init``, ``disable_cuda_graph``, ``weight_sync_mode`` (``"bucketed"``: one in-place load
    per bucket; ``"per_param"``: one per tensor, the baseline), ``bucket_bytes``, and any ``vllm.LLM``
    argument that genengine does not set itself (``max_model_len``, ``enable_prefix_caching``,
    ``max_num_seqs``, ...).
    """

    supported_tags = (TAG_WEIGHTS, TAG_KV_CACHE)
    supports_images: ClassVar[bool] = True
    wake_before_shutdown: ClassVar[bool] = True  # vLLM's allocator cannot free memory it unmapped for sleep
    _prefix_caching = True  # vLLM's enable_prefix_caching, read once it has started
    _caches_clean = False
    """vLLM's prefix, multimodal and encoder caches are empty: its sleep (level >= 1) reset them
    (``EngineCore.sleep`` → ``pause_scheduler(clear_cache=True)`` → ``_reset_caches``, v1/engine/core.py) and
    nothing has been scheduled since, so a flush now would drop nothing (it is the one ``wake(["kv_cache"])``
    owes after a load while the KV cache slept: a loop over every KV block, ~76k at 7B)."""
    _load_device: Any = None  # this rank's GPU (a torch.device), where vLLM's parameters are

    def __init__(self, settings: VLLMSettings, topology: Topology | None) -> None:
        super().__init__(sleep_enabled=settings.enable_sleep, bucket_bytes=settings.bucket_bytes)
        self.settings = settings
        self.topology = topology
        self._llm: Any = None
        self._group: EngineGroup | None = None
        self._spec: dict[str, WeightInfo] | None = None
        # Process settings held for the engine's life (the allocator's), undone at shutdown or a failed start.
        self._life = contextlib.ExitStack()
        self._max_model_len = 0
        self._multimodal = False
        self._lock = DriverLock()  # every call into vLLM: the async driver steps it from its own thread
        self._driver: AsyncDriver | None = None
        self._cuda: tuple[int, Any] | None = None
        self.group_seed = group_seed(settings.seed, topology)
        self._seed_rng = random.Random(self.group_seed)
        if settings.enable_sleep:
            claim_sleep_slot(self, f"VLLMEngine({settings.model!r})")
        try:
            self._start(topology)
        except BaseException:
            self._life.close()
            release_sleep_slot(self)
            raise
        track_engine(self)

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: EngineConfig) -> VLLMEngine:
        """Validate everything, then start vLLM; bad input fails before vLLM starts or memory is taken.

        ``tp_size=1`` runs without ``torch.distributed`` too (vLLM then makes a private one-rank group).
        """
        return cls._create(EngineConfig.from_any(config), require_distributed=False)

    @classmethod
    def _create(cls, config: EngineConfig, *, require_distributed: bool) -> VLLMEngine:
        """Both entry points' path (``get_vllm_engine`` requires the trainer's world): checks, then ``cls(...)``."""
        settings = resolve_settings(config)
        topology = trainer_world(settings.tp_size, require=require_distributed)
        if settings.enable_sleep:
            with PROCESS_STATE.lock:
                check_sleep_slot(None, f"VLLMEngine({settings.model!r})")
        import_vllm()
        return cls(settings, topology)

    def _start(self, topology: Topology | None) -> None:
        import torch.distributed as dist

        vllm = import_vllm()
        if topology is not None:
            from genengine.distributed import engine_group

            self._group = engine_group(self.settings.tp_size, check_port=False)
        if self.settings.enable_sleep:
            self._life.enter_context(without_expandable_segments())
        had_world = dist.is_available() and dist.is_initialized()
        kwargs = build_llm_kwargs(self.settings, external_launcher=topology is not None, group_seed=self.group_seed)
        try:
            # In-process engine core (apply_model reaches the model without IPC) and, under external_launcher,
            # torchrun's rank variables: read only while vLLM starts (see start_environ).
            with scoped_environ(start_environ(topology)), preserve_rng_states():
                llm = vllm.LLM(**kwargs)
            if self.settings.enable_sleep:
                compat.release_cumem_pools_at_exit()
        except BaseException:
            # A failed start (e.g. out of memory) leaves vLLM's process-global groups behind; clear them so a
            # later engine can start, and keep the trainer's default group.
            with contextlib.suppress(Exception), keep_default_group(topology is not None):
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
            raise
        if not had_world and dist.is_available() and dist.is_initialized():
            PROCESS_STATE.vllm_world = dist.group.WORLD
        self._llm = llm
        from vllm.v1.engine.core_client import InprocClient

        if not isinstance(llm.llm_engine.engine_core, InprocClient):
            self._teardown(llm, last=True)
            raise EngineStateError(
                "vLLM started its engine core in another process; genengine needs it in-process "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=0) to load weights without copies"
            )
        self._max_model_len = int(llm.model_config.max_model_len)
        self._multimodal = bool(getattr(llm.model_config, "is_multimodal_model", False))
        cache_config = getattr(getattr(llm.llm_engine, "vllm_config", None), "cache_config", None)
        self._prefix_caching = bool(getattr(cache_config, "enable_prefix_caching", True))
        import torch

        if torch.cuda.is_available():
            # vLLM made this thread's current stream its own while it started (it keeps one per thread):
            # the async driver thread steps on the same device and stream.
            self._cuda = (torch.cuda.current_device(), torch.cuda.current_stream())
            self._load_device = torch.device("cuda", self._cuda[0])

    @property
    def weight_sync_mode(self) -> str:
        """``"bucketed"`` (one in-place load per bucket) or ``"per_param"`` (one per tensor, the baseline)."""
        return self.settings.weight_sync_mode

    @weight_sync_mode.setter
    def weight_sync_mode(self, mode: str) -> None:
        if mode not in WEIGHT_SYNC_MODES:
            raise InvalidArgumentError(f"weight_sync_mode={mode!r}: allowed are {', '.join(WEIGHT_SYNC_MODES)}")
        self.settings = dataclasses.replace(self.settings, weight_sync_mode=mode)

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("asleep" if self.released_tags else "awake")
        return f"VLLMEngine(model={self.settings.model!r}, tp_size={self.settings.tp_size}, {state})"

    # -- the protocol, with the TP-group checks vLLM's external_launcher needs --------------------------------
    @property
    def _tp_checked(self) -> bool:
        return self._group is not None and self.settings.tp_size > 1

    def _check_consistent(self, what: str, value: Callable[[], object]) -> None:
        """Every rank of a TP group makes the same call (generate, load) in the same state, or each rank says
        which differs: vLLM's external_launcher would otherwise wait in a collective the others never join."""
        if self._tp_checked:
            assert self._group is not None
            self._group.check_consistent(value(), what=what)

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int | None = None,
        check_finite: bool = False,
        version: int | None = None,
    ) -> LoadReport:
        """The protocol's load; a source that holds its tensors anyway loads in the ``IN_PLACE`` mode."""
        held = isinstance(named_tensors, (list, tuple, Mapping, ItemsView))
        return self._load_weights(
            named_tensors,
            bucket_bytes=bucket_bytes,
            check_finite=check_finite,
            version=version,
            mode=IN_PLACE if held else None,
        )

    def _bucket_cost(self, tensor: torch.Tensor, session: LoadSession) -> int:
        """vLLM's loader copies each tensor straight into its parameter (``param.data.copy_``): nothing is
        staged. A dense tensor on this rank's GPU from a source that holds its tensors anyway (a list, tuple or
        dict: no reference is kept that the caller does not keep; the session's mode is ``IN_PLACE``) costs no
        memory, so all such tensors go in one ``apply_model`` call (the per-call loader setup was ~80 us x 30
        buckets at 7B). A generator's tensors may be fresh copies, and gathered DTensors and views made
        contiguous are copies: those count in full, so ``bucket_bytes`` still bounds what a load holds. Every
        TP rank counts alike (its own GPU)."""
        import torch

        if (
            session.mode == IN_PLACE
            and type(tensor) in (torch.Tensor, torch.nn.Parameter)
            and tensor.device == self._load_device
            and tensor.is_contiguous()
        ):
            return 0
        return super()._bucket_cost(tensor, session)

    def _drop_orphans(self) -> None:
        """Before ``LLM.generate``, with no request of ours in vLLM: forget requests its output processor still
        tracks (an interrupted generate, or a request its engine core refused after ``LLMEngine.add_request``
        gave it to the output processor). ``LLM.generate`` steps while any is tracked, and would step forever."""
        engine = self._llm.llm_engine
        if engine.has_unfinished_requests():
            engine.abort_request(list(engine.output_processor.request_states), internal=True)

    def _check_weights_may_change(self) -> None:
        super()._check_weights_may_change()
        driver = self._driver
        if driver is not None and driver.sync:
            raise EngineStateError("load_weights while a synchronous generate() is running on this engine")

    # -- EngineBase hooks -----------------------------------------------------------------------------------
    def _vocab_size(self) -> int | None:
        return vocab_size(self.settings.model_config)

    def _weight_spec(self) -> Mapping[str, WeightInfo]:
        if self._spec is None:
            self._spec = weight_spec(self.settings.model, self.settings.model_config, self.settings.dtype)
        return self._spec

    def _check_requests(self, requests: list[Request]) -> None:
        """Everything that can be refused, before a seed is drawn or a request is queued."""
        detokenize = not self.settings.skip_tokenizer_init
        for r in requests:
            if r.prompt is not None and not detokenize:
                raise InvalidArgumentError(
                    "text prompts need the tokenizer, but the engine was created with skip_tokenizer_init=True: "
                    "pass prompt_token_ids"
                )
            if r.image is not None and not self._multimodal:
                raise InvalidArgumentError(f"image_data[{r.index}] given, but {self.settings.model} takes no images")
            if r.prompt_token_ids is not None and len(r.prompt_token_ids) >= self._max_model_len:
                raise InvalidArgumentError(
                    f"prompt_token_ids[{r.index}] has {len(r.prompt_token_ids)} tokens; the engine's "
                    f"max_model_len is {self._max_model_len} (prompt and completion together)"
                )
            vllm_sampling_kwargs(r.params, seed=0, detokenize=detokenize)  # validates

    def _vllm_requests(
        self, r: Request, *, one_per_sample: bool, templates: dict[tuple[int, bool], Any] | None = None
    ) -> list[tuple[dict[str, Any], Any]]:
        """``(prompt, vllm.SamplingParams)`` of each vLLM request standing for ``r``, with explicit seeds.

        Sample ``k`` of a split request gets ``seed + k``, the seed vLLM gives child ``k`` of an ``n > 1``
        request (``v1/engine/parallel_sampling.py``, ``_get_child_sampling_params``), so the split async
        requests sample what one synchronous request does. ``templates`` (one ``generate`` call's, keyed by
        the ``SamplingParams`` object the requests share) lets each request's vLLM params be a copy of one built
        params with its own seed: building one took 3.5 us against 0.3 us, 64 x per P1 call (issue 41). vLLM
        clones each request's params before it changes any (``InputProcessor.process_inputs``), so the copies'
        shared lists are never written.
        """
        from vllm import SamplingParams as VllmSamplingParams

        detokenize = not self.settings.skip_tokenizer_init
        prompt: dict[str, Any] = (
            {"prompt": r.prompt} if r.prompt is not None else {"prompt_token_ids": list(r.prompt_token_ids or ())}
        )
        if r.image is not None:
            prompt["multi_modal_data"] = {"image": load_image(r.image, r.index)}
        seed = r.params.seed % _SEED_SPACE if r.params.seed is not None else self._seed_rng.getrandbits(61)
        copies = r.params.n if one_per_sample else split_greedy_n(r.params)
        if templates is None:
            templates = {}
        key = (id(r.params), copies > 1)
        template = templates.get(key)
        if template is None:
            n = 1 if copies > 1 else None
            template = templates[key] = VllmSamplingParams(
                **vllm_sampling_kwargs(r.params, seed=0, detokenize=detokenize, n=n)
            )
        out = []
        for k in range(copies):
            sampling = copy.copy(template)
            sampling.seed = seed + k
            out.append((prompt, sampling))
        return out

    def _generate(self, requests: list[Request]) -> list[GenerationResult]:
        self._check_not_held()
        self._check_requests(requests)
        self._caches_clean = False  # from here vLLM may cache blocks computed with the weights in force
        prompts: list[dict[str, Any]] = []
        params: list[Any] = []
        owners: list[int] = []
        templates: dict[tuple[int, bool], Any] = {}  # the requests' params objects stay alive: ids are stable
        for r in requests:
            for prompt, sampling in self._vllm_requests(r, one_per_sample=False, templates=templates):
                prompts.append(prompt)
                params.append(sampling)
                owners.append(r.index)
        with self._lock():
            self._check_not_held()
            driver = self._driver
            if driver is not None:
                driver.check_usable()
            loras = Request.adapter_handles(requests, owners)  # the adapter of each prompt (LoRARequest), or None
            batch = driver.submit_sync(prompts, params, loras) if driver is not None and driver.busy else None
            if batch is None:
                # No request of the driver in vLLM: LLM.generate as always (it steps until every request vLLM
                # knows is done, so it cannot run beside streamed ones).
                self._drop_orphans()
                try:
                    with engine_stream(self._cuda):
                        outputs = self._llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
                except ValueError as exc:  # vLLM's VLLMValidationError: e.g. a text prompt longer than max_model_len
                    raise InvalidArgumentError(f"vLLM refused the request: {exc}") from exc
        if batch is not None:
            assert driver is not None
            driver.wake()
            outputs = batch.wait(driver.alive)
        detokenize = not self.settings.skip_tokenizer_init
        grouped: dict[int, list[Any]] = {}
        for owner, out in zip(owners, outputs, strict=True):
            grouped.setdefault(owner, []).append(out)
        return [convert_request_output(grouped[r.index], r.params, detokenize=detokenize) for r in requests]

    def _check_not_held(self) -> None:
        driver = self._driver
        if driver is not None and driver.held:
            raise EngineStateError(
                "generate() while generation is paused with mode 'keep': vLLM schedules nothing while it holds "
                "the paused requests; call resume_generation() first"
            )

    # -- async (genengine.engine.aio's hooks; genengine_vllm._async drives vLLM) --------------------------------
    def _check_async_available(self) -> None:
        """Async requests need one engine core that admits, aborts and pauses them: ``tp_size=1`` only."""
        if self.settings.tp_size > 1:
            raise EngineStateError(
                f"the async calls are not available with tp_size={self.settings.tp_size}: every rank of the TP "
                "group steps its own vLLM engine core and the ranks would admit, abort and pause requests at "
                "different steps (see docs/async.md, vLLM); use tp_size=1 engines or the synchronous generate()"
            )

    def _async_driver(self) -> AsyncDriver:
        if self._driver is None:
            self._driver = AsyncDriver(
                self._llm, self._lock, detokenize=not self.settings.skip_tokenizer_init, cuda=self._cuda
            )
        return self._driver

    def _async_start(self, request: AsyncRequest) -> None:
        self._check_requests([request.request])
        inputs = self._vllm_requests(request.request, one_per_sample=True)
        self._caches_clean = False
        with self._lock():
            driver = self._async_driver()
            driver.start(request, inputs)
        driver.wake()

    def _async_abort(self, requests: list[AsyncRequest]) -> None:
        with self._lock():
            driver = self._driver
            if driver is None:  # never started (or shut down): nothing is in vLLM
                for request in requests:
                    for index in request.unfinished():
                        request.finish(index, "abort")
                return
            driver.abort(requests)
        driver.wake()  # it steps the batch in flight back

    def _async_hold(self, clear_cache: bool) -> None:
        with self._lock():
            self._async_driver().hold(clear_cache)

    def _async_release_hold(self) -> None:
        with self._lock():
            driver = self._async_driver()
            driver.release()
        driver.wake()

    def _release(self, level: int) -> None:
        import torch

        with self._lock():
            if self._driver is not None:
                if self._driver.sync:
                    raise EngineStateError("cannot sleep while a synchronous generate() is running on this engine")
                self._driver.settle()
            torch.cuda.synchronize()
            # vLLM's allocator unmaps synchronously, then runs gc.collect() and empty_cache() itself: the memory
            # is back when this returns (one more full gc here would only cost time in every RL step).
            self._llm.sleep(level=level)
            torch.cuda.synchronize()
            self._caches_clean = True  # the sleep reset vLLM's caches (see _caches_clean)

    def _resume(self, tags: tuple[str, ...]) -> None:
        with self._lock():
            self._resume_locked(tags)

    def _resume_locked(self, tags: tuple[str, ...]) -> None:
        import torch

        torch.cuda.empty_cache()  # hand the trainer's cached blocks back so that vLLM can map them
        if self.sleep_level == 2 and TAG_WEIGHTS in self.released_tags and TAG_WEIGHTS not in tags:
            # After a level-2 sleep vLLM's worker restores the model's buffers (rotary tables) on the first
            # wake_up, whatever its tags: with the weights still unmapped that write would fault. Keep them
            # for the wake that maps the weights.
            self._llm.collective_rpc(_stash_saved_buffers)
            try:
                self._llm.wake_up(tags=list(tags))
            finally:
                self._llm.collective_rpc(_unstash_saved_buffers)
        else:
            self._llm.wake_up(tags=list(tags))
        torch.cuda.synchronize()

    def _apply_weights(self, bucket: list[tuple[str, torch.Tensor]], session: LoadSession) -> None:
        self._check_consistent(
            "weight names and shapes", lambda: [(n, tuple(t.shape), str(t.dtype)) for n, t in bucket]
        )
        with self._lock(), engine_stream(self._cuda):  # the driver never steps while the weights change
            if self._driver is not None:
                self._driver.settle()
            if self.settings.weight_sync_mode == "per_param":
                for item in bucket:
                    self._load_into_model([item])
            else:
                self._load_into_model(bucket)

    def _load_into_model(self, items: list[tuple[str, torch.Tensor]]) -> None:
        # vLLM's own loader for the architecture: maps HF names (q/k/v → qkv_proj, ...) and shards for TP.
        if self.supports_adapters:  # LoRA-wrapped layers keep their weights under base_layer
            self._llm.apply_model(lambda model: model.load_weights(iter(lora_base_names(model, items))))
        else:
            self._llm.apply_model(lambda model: model.load_weights(iter(items)))

    def _flush_cache(self) -> None:
        with self._lock():
            if self._caches_clean:
                return  # nothing was cached since vLLM's sleep emptied the caches
            driver = self._driver
            if driver is not None and driver.held and not driver.kept_kv:
                # pause(keep, clear_cache=True): vLLM's own reset at the hold (EngineCore._reset_caches: prefix,
                # multimodal and encoder caches) left them empty, and nothing has been scheduled since. A second
                # reset would walk every KV block again (~78k at 7B, 2.7 M for a tiny model: ~60 ms).
                return
            if not self._prefix_caching:
                pass  # no block is ever cached (vLLM's reset would walk every block to clear hashes none has)
            elif driver is not None and driver.held and driver.kept_kv:
                # pause(keep, clear_cache=False): the held requests keep their KV blocks, which vLLM's reset
                # refuses (BlockPool.reset_prefix_cache); the driver takes every block out of the prefix cache instead.
                driver.evict_prefix_cache()
            elif not self._llm.reset_prefix_cache():
                raise EngineStateError("vLLM could not reset its prefix cache (requests still running)")
            if self._multimodal:
                self._llm.llm_engine.reset_encoder_cache()  # vision embeddings computed with the old weights

    def _shutdown(self) -> None:
        driver, self._driver = self._driver, None
        if driver is not None:
            driver.close()  # streams in flight end with "abort", keeping their tokens
        llm, self._llm = self._llm, None
        self._remove_adapter_dirs()
        last = False
        try:
            # EngineBase woke every released tag first (wake_before_shutdown); when that wake failed, memory is
            # still unmapped and freeing it would poison the process's allocator: leave it to process exit.
            if llm is not None and not self.released_tags:
                last = not untrack_engine(self, VLLMEngine)
                self._teardown(llm, last=last)
                if self.settings.enable_sleep:
                    compat.release_cumem_pools()  # one sleep engine per process: its pools are this engine's
        finally:
            untrack_engine(self)
            self._life.close()
            release_sleep_slot(self)
        # Only now is the last reference to vLLM's objects gone (this frame's ``llm`` kept the model and the
        # KV cache alive through ``_teardown``'s own cleanup): collect their cycles and hand the blocks back,
        # so the memory is free when shutdown returns, while the caller still holds the engine.
        del llm
        _free_gpu_memory()
        if last:
            fresh_graph_pool()

    def _teardown(self, llm: Any, *, last: bool) -> None:
        client = llm.llm_engine.engine_core
        if last:
            # EngineCore.shutdown → cleanup_dist_env_and_memory destroys vLLM's groups and the default group:
            # keep the default group when it is the trainer's.
            in_trainer_world = self.topology is not None
            drop_cuda_graphs()  # no engine of this process replays them again
            with keep_default_group(in_trainer_world):
                client.shutdown()
            if not in_trainer_world:
                PROCESS_STATE.vllm_world = None
        else:
            # Another engine of this process still uses vLLM's process-global parallel state: free only ours.
            core = client.engine_core
            core.structured_output_manager.clear_backend()
            core.model_executor.shutdown()
            core.scheduler.shutdown()
            gc.unfreeze()
        del client, llm


def _free_gpu_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
