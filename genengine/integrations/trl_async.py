"""TRL's async trainers (``trl.experimental.async_grpo.AsyncGRPOTrainer``, ``AsyncDistillationTrainer``) on any
genengine engine or ``EnginePool``, through the two objects those trainers take for other backends.

TRL 1.16's default rollout worker talks HTTP to a ``vllm serve`` process on other GPUs. Its trainers also accept
a ``rollout_worker`` (``RolloutWorkerProtocol``) and a ``weight_transfer`` (``WeightTransferProtocol``); this
module gives both over genengine's async protocol (docs/async.md):

- :class:`GenEngineRolloutWorker` streams each prompt's ``num_generations`` completions from the engine on an
  event loop of its own (a thread of the training process), scores them with the reward functions, and puts
  TRL ``RolloutSample`` s on ``rollout_buffer``. Each sample's ``model_version`` is the oldest weight version
  genengine reports for its tokens (``GenerationOutput.weight_versions``); samples staler than TRL's
  ``max_staleness`` are dropped before they are queued, and at most ``max_inflight_tasks`` completions are in
  flight, as TRL's worker. ``check_health`` raises if the loop failed (a crashed or closed engine) or if
  requests are in flight and no token came for ``heartbeat_stale_after_s`` (a stuck engine).
- :class:`GenEngineWeightTransfer` (:mod:`~genengine.integrations.trl_async_transfer`) pauses the engine with
  ``keep`` (in-flight samples wait, then go on with the new weights, their KV recomputed), writes the trainer's
  ``(name, tensor)`` stream in one bucketed ``load_weights`` labelled with the trainer's next ``model_version``,
  and resumes. Passed as a trainer callback too, it syncs a PEFT policy adapter-only where the engine serves
  adapters: the base once, then one ``load_adapter`` per sync; the worker's requests name the adapter, and one in
  flight across a sync finishes under the adapter it started with.

TRL's trainers take ``model`` as a path and the two objects as arguments (no ``genengine=``), so the user
builds them with :func:`make_async_backend` and passes them; docs/trl.md has the recipe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from genengine.config import EngineConfig
from genengine.errors import ConfigError, EngineStateError, InvalidArgumentError
from genengine.integrations.trl import check_trl_version
from genengine.integrations.trl_async_patches import (
    allow_cpu_training,
    tree_attention_needs_torch,
    use_torch_tree_attention,
)
from genengine.integrations.trl_async_transfer import PAUSE_MODES, GenEngineWeightTransfer, LoopThread
from genengine.integrations.trl_config import (
    check_engine_config,
    check_trl_settings,
    engine_config_source,
    resolve_engine_config,
)
from genengine.integrations.trl_lora import LoraSync, check_lora_sync
from genengine.plugins.registry import create_engine
from genengine.protocol import SamplingParams, is_async_engine

check_trl_version()

from trl.experimental.async_grpo import AsyncGRPOConfig  # noqa: E402
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample  # noqa: E402

__all__ = ["PAUSE_MODES", "GenEngineRolloutWorker", "GenEngineWeightTransfer", "make_async_backend"]

_log = logging.getLogger(__name__)

TREE_ATTENTION = ("auto", "torch", "fa3")


class GenEngineRolloutWorker:
    """TRL's ``RolloutWorkerProtocol`` over a genengine engine or ``EnginePool`` (build it with
    :func:`make_async_backend`). Runs in the training process: ``rollout_buffer`` is a ``queue.Queue``."""

    def __init__(
        self,
        engine: Any,
        *,
        dataset: Sequence[dict[str, Any]],
        reward_funcs: Sequence[Callable[..., Any]],
        tokenizer: Any,
        sampling: SamplingParams,
        max_inflight: int,
        max_staleness: int,
        queue_maxsize: int = 0,
        chat_template_kwargs: dict[str, Any] | None = None,
        seed: int = 0,
        owns_engine: bool = False,
    ) -> None:
        if not is_async_engine(engine):
            raise ConfigError(f"{type(engine).__name__} does not serve the async calls (supports_async is not True)")
        self.engine = engine
        self.rollout_buffer: queue.Queue[RolloutSample] = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=4096)
        self.stop_timeout_s = 15.0
        """How long ``stop()`` waits for the loop to abort its requests and end (a stuck engine may never let it)."""
        self.model_version = 0
        """The trainer's policy version (``update_model_version``): what staleness is measured against."""
        self._dataset = dataset
        self._reward_funcs = list(reward_funcs)
        self._reward_names = [getattr(f, "__name__", type(f).__name__) for f in self._reward_funcs]
        self._tokenizer = tokenizer
        self._sampling = sampling
        self._group = sampling.n
        self._max_inflight = max_inflight
        self._max_staleness = max_staleness
        self._template_kwargs = dict(chat_template_kwargs or {})
        self._seed = seed
        self._owns_engine = owns_engine
        self._runner = LoopThread("genengine-trl-rollouts")
        self._future: concurrent.futures.Future[Any] | None = None
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self._progress_at = time.time()
        self._requests = 0
        self._live_ids: set[str] = set()
        self._next_group = 0

    # ---- TRL's protocol ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Begin rollouts (TRL calls it once the first weight sync is in the engine)."""
        if self._future is not None and not self._future.done():
            _log.warning("GenEngineRolloutWorker.start(): already running; ignored")
            return
        self._stopping.clear()
        self._error = None
        self._progress_at = time.time()
        self._future = self._runner.submit(self._run())

    def stop(self) -> None:
        """Stop rollouts: requests in flight are aborted, the loop thread ends. The engine stays up (``shutdown``
        frees it); samples already queued stay in ``rollout_buffer``."""
        self._stopping.set()
        future, self._future = self._future, None
        if future is not None:
            try:
                future.result(timeout=self.stop_timeout_s)
            except concurrent.futures.TimeoutError:
                _log.warning(
                    "the rollout loop did not end within %gs (a stuck engine?): left behind", self.stop_timeout_s
                )
            except BaseException as exc:  # already recorded for check_health
                _log.debug("rollout loop ended with %r", exc)
        self._runner.stop(timeout_s=min(5.0, self.stop_timeout_s))

    def update_model_version(self, model_version: int) -> None:
        """The trainer's policy version is now ``model_version``: older rollouts count as stale against it."""
        self.model_version = int(model_version)

    def use_adapter(self, name: str | None) -> None:
        """Requests from now on are generated with the adapter ``name`` (None: the base weights): the transfer
        sets it for adapter-only sync."""
        self._sampling = replace(self._sampling, adapter=name)

    def check_health(self, stale_after_s: float) -> None:
        """Raise if the rollout loop failed (a crashed or closed engine), stopped, or if requests are in flight
        and the engine produced no token for ``stale_after_s`` seconds (a stuck engine)."""
        if self._error is not None:
            raise RuntimeError(f"genengine rollout worker failed: {self._error!r}") from self._error
        future = self._future
        if future is None:
            raise RuntimeError("genengine rollout worker is not running (start() not called, or stopped)")
        if future.done():
            raise RuntimeError("genengine rollout worker's loop ended without an error; nothing produces rollouts")
        age = time.time() - self._progress_at
        if age > stale_after_s:
            raise RuntimeError(
                f"genengine rollout worker: no token from the engine for {age:.0f}s > stale_after_s="
                f"{stale_after_s:g}s with {self._requests} request(s) in flight: the engine is stuck"
            )

    # ---- lifetime ----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """``stop()``, then free the engine if :func:`make_async_backend` built it. Idempotent."""
        self.stop()
        if self._owns_engine:
            self._owns_engine = False
            self.engine.shutdown()

    # ---- the loop --------------------------------------------------------------------------------------------
    def _idle_by_design(self) -> bool:
        """No token is expected: nothing in flight, or a weight sync holds the engine (a full queue is marked
        where the worker waits on it)."""
        return self._requests == 0 or self.engine.paused is not None

    async def _run(self) -> None:
        try:
            await self._loop()
        except BaseException as exc:
            if not self._stopping.is_set():
                self._error = exc
                _log.error("genengine rollout worker failed: %r", exc)
            raise

    async def _loop(self) -> None:
        tasks: set[asyncio.Task[None]] = set()
        score_lock = asyncio.Lock()
        try:
            while not self._stopping.is_set():
                if self._idle_by_design():
                    self._progress_at = time.time()
                while (len(tasks) + 1) * self._group <= self._max_inflight and not self._stopping.is_set():
                    group_id, row = self._next_row()
                    tasks.add(asyncio.create_task(self._rollout(group_id, row, score_lock)))
                done, _ = await asyncio.wait(tasks, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    tasks.discard(task)
                    task.result()  # a failed rollout fails the loop: check_health reports it
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._live_ids:  # a cancelled reader does not always end its request at once: end them here
                with contextlib.suppress(Exception):  # a closed engine has none left
                    await self.engine.abort(sorted(self._live_ids))
                self._live_ids.clear()

    def _next_row(self) -> tuple[int, dict[str, Any]]:
        group_id = self._next_group
        self._next_group += 1
        return group_id, self._dataset[group_id % len(self._dataset)]

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(self._tokenizer(prompt)["input_ids"])
        ids = self._tokenizer.apply_chat_template(
            prompt, tokenize=True, add_generation_prompt=True, return_dict=False, **self._template_kwargs
        )
        return list(ids)

    async def _rollout(self, group_id: int, row: dict[str, Any], score_lock: asyncio.Lock) -> None:
        prompt = row["prompt"]
        prompt_ids = self._prompt_ids(prompt)
        params = replace(self._sampling, seed=self._seed * 1_000_003 + group_id * self._group)
        stream = self.engine.stream(
            prompt_token_ids=prompt_ids, sampling_params=params, request_id=f"trl-async-{group_id}"
        )
        self._requests += 1
        self._live_ids.add(stream.request_id)
        try:
            async for _chunk in stream:
                self._progress_at = time.time()
            result = stream.result()
            self._live_ids.discard(stream.request_id)  # ended (a cancelled one is aborted by the loop)
        finally:
            self._requests -= 1
            if not self._stopping.is_set():
                self._progress_at = time.time()
        if self._stopping.is_set():
            return
        aborted = [o for o in result.outputs if o.finish_reason == "abort"]
        if aborted:
            raise EngineStateError(
                f"request trl-async-{group_id} was aborted by the engine (shut down, or aborted by another caller)"
            )
        async with score_lock:
            samples = await self._score(group_id, prompt, row, prompt_ids, result)
        await self._put(samples)

    async def _score(
        self, group_id: int, prompt: Any, row: dict[str, Any], prompt_ids: list[int], result: Any
    ) -> list[Any]:
        import numpy as np

        outputs = result.outputs
        completion_ids = [list(o.token_ids) for o in outputs]
        texts = [self._tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
        conversational = not isinstance(prompt, str)
        completions: list[Any] = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        skip = ("prompt", "completion", "completion_ids")  # as TRL's worker: the other columns go to the rewards
        kwargs = {key: [value] * len(outputs) for key, value in row.items() if key not in skip}
        kwargs.update(prompts=[prompt] * len(outputs), completions=completions, completion_ids=completion_ids)
        columns = []
        for func in self._reward_funcs:
            if inspect.iscoroutinefunction(func):
                column = await func(**kwargs)
            else:
                column = await asyncio.to_thread(func, **kwargs)
            columns.append([float("nan") if r is None else float(r) for r in column])
        per_func = np.array(columns, dtype=float).reshape(len(columns), len(outputs))
        all_nan = np.all(np.isnan(per_func), axis=0)
        rewards = np.nansum(per_func, axis=0)
        rewards[all_nan] = np.nan  # as TRL: a completion no function could score gets no advantage
        advantages = np.zeros_like(rewards)
        scored = ~np.isnan(rewards)
        mean = std = float("nan")
        if scored.any():
            mean, std = float(rewards[scored].mean()), float(rewards[scored].std())
            advantages[scored] = (rewards[scored] - mean) / (std + 1e-8)
        # The oldest weights that sampled any token of the group: its staleness is that of its stalest token.
        versions = [v for o in outputs for _, v in (o.weight_versions or ())]
        version = min(versions) if versions else int(self.engine.weight_version)
        mixed = sum(1 for o in outputs if len(o.weight_versions or ()) > 1)
        # TRL's samples carry messages (its trace logger reads them as such), whatever the dataset's prompts are.
        messages = prompt if conversational else [{"role": "user", "content": prompt}]
        samples = []
        for i, output in enumerate(outputs):
            n_prompt, n_completion = len(prompt_ids), len(output.token_ids)
            logprobs = list(output.logprobs or [0.0] * n_completion)
            metrics = {"reward": float(rewards[i]), "reward_std": std}
            metrics.update({f"rewards/{n}": float(per_func[j, i]) for j, n in enumerate(self._reward_names)})
            samples.append(
                RolloutSample(
                    prompt=messages,
                    completion=[{"role": "assistant", "content": texts[i]}],
                    input_ids=np.asarray(prompt_ids + completion_ids[i], dtype=np.int64),
                    completion_mask=np.asarray([0] * n_prompt + [1] * n_completion, dtype=np.int64),
                    old_log_probs=np.asarray([0.0] * n_prompt + logprobs, dtype=np.float32),
                    advantage=float(advantages[i]),
                    model_version=version,
                    group_id=group_id,
                    metrics=metrics,
                )
            )
        self._push_metrics(
            {
                "rollout/groups_total": 1.0,
                "rollout/completion_tokens_total": float(sum(len(c) for c in completion_ids)),
                "rollout/mixed_version_samples_total": float(mixed),
                "rollout/reward_mean": mean,
            }
        )
        return samples

    async def _put(self, samples: list[Any]) -> None:
        if not samples:
            return
        staleness = self.model_version - samples[0].model_version
        if staleness > self._max_staleness:
            _log.info("dropping a stale group (staleness=%d, max_staleness=%d)", staleness, self._max_staleness)
            self._push_metrics({"rollout/dropped_stale_total": float(len(samples))})
            return
        for sample in samples:
            while True:
                if self._stopping.is_set():
                    return
                sample.enqueued_at = time.time()
                try:
                    self.rollout_buffer.put_nowait(sample)
                    break
                except queue.Full:
                    self._progress_at = time.time()  # backpressure: the trainer is behind, not the engine
                    await asyncio.sleep(0.05)

    def _push_metrics(self, values: dict[str, Any]) -> None:
        with contextlib.suppress(queue.Full):  # never block rollouts on a trainer that stopped reading
            self.metrics_queue.put_nowait(values)


def _world_size() -> int:
    return max(1, int(os.environ.get("WORLD_SIZE", "1")))


def _model_positions(model: str) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.max_position_embeddings)


def _check_rewards(reward_funcs: Any) -> list[Callable[..., Any]]:
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    bad = [f for f in funcs if not callable(f)]
    if not funcs or bad:
        raise InvalidArgumentError(
            f"reward_funcs={reward_funcs!r}: allowed: a callable or a non-empty list of callables "
            "(f(prompts=, completions=, completion_ids=, **columns) -> list[float]); model ids are not loaded here"
        )
    return funcs


def make_async_backend(
    genengine: Any,
    *,
    model: str,
    args: AsyncGRPOConfig,
    train_dataset: Any,
    reward_funcs: Any,
    processing_class: Any = None,
    tree_attention: str = "auto",
    lora_sync: LoraSync = "auto",
) -> tuple[GenEngineRolloutWorker, GenEngineWeightTransfer]:
    """The ``rollout_worker`` and ``weight_transfer`` to pass to ``AsyncGRPOTrainer`` for a genengine engine.

    ``genengine`` is an engine config (a backend name, a dict, a YAML path: what the ``GRPOTrainer`` integration
    takes; its ``model`` defaults to ``model``, the path the trainer loads) or a running async engine or
    ``EnginePool`` (used as is, not shut down by ``worker.shutdown()``). ``args`` is the trainer's
    ``AsyncGRPOConfig``: sampling, ``num_generations``, ``max_staleness``, ``max_inflight_tasks`` and
    ``queue_maxsize`` come from it; an unset ``token_budget`` (TRL would ask vLLM's server) is set to the model's
    ``max_position_embeddings``. ``tree_attention``: ``"auto"`` runs TRL's tree attention on torch
    (:mod:`~genengine.integrations.trl_async_patches`) where its FA3 kernel cannot run, ``"torch"`` always,
    ``"fa3"`` never. ``lora_sync`` (``"auto"``, ``"adapter"``, ``"merge"``): how a PEFT policy (the trainer's
    ``peft_config=``) is synced, once the transfer is among the trainer's ``callbacks`` (it must see the policy).
    Every check runs before an engine starts.
    """
    if not isinstance(args, AsyncGRPOConfig):
        raise InvalidArgumentError(f"args must be an AsyncGRPOConfig, got {type(args).__name__}")
    if tree_attention not in TREE_ATTENTION:
        allowed = ", ".join(map(repr, TREE_ATTENTION))
        raise InvalidArgumentError(f"tree_attention={tree_attention!r} is not one of {allowed}")
    check_lora_sync(lora_sync)
    funcs = _check_rewards(reward_funcs)
    if train_dataset is None or len(train_dataset) == 0 or "prompt" not in train_dataset[0]:
        raise InvalidArgumentError("train_dataset must be a non-empty dataset with a 'prompt' column")
    settings = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "max_completion_length": args.max_completion_length,
        "logprobs": 0,
    }
    sampling = replace(check_trl_settings(settings), n=int(args.num_generations))
    if args.max_staleness < 0:
        raise ConfigError(f"max_staleness={args.max_staleness} must be >= 0")
    if _world_size() > 1:
        raise ConfigError(
            f"WORLD_SIZE={_world_size()}: the TRL async integration runs in one training process (TRL uses the "
            "rollout worker on rank 0 only, and make_async_backend starts an engine wherever it is called); "
            "allowed: one process"
        )
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
    inflight = args.max_inflight_tasks if args.max_inflight_tasks > 0 else max(args.max_staleness, 1) * per_step
    if inflight < args.num_generations:
        raise ConfigError(
            f"max_inflight_tasks={inflight} is below num_generations={args.num_generations}: a group of completions "
            "is submitted as one request, so no group would ever start; allowed: >= num_generations, or -1 (TRL's "
            "max_staleness x samples per step)"
        )
    if args.token_budget is None:
        args.token_budget = _model_positions(model)
        _log.info("token_budget unset: set to the model's max_position_embeddings, %d", args.token_budget)
    owns = not is_async_engine(genengine)
    if owns:
        source = engine_config_source(genengine)
        config = resolve_engine_config(source, {}, model_name=model, seed=int(args.seed))
        check_engine_config(config, model_given=EngineConfig.from_any(source).model is not None)
    if processing_class is None:
        from transformers import AutoTokenizer

        processing_class = AutoTokenizer.from_pretrained(model)
    engine = create_engine(config) if owns else genengine
    try:
        worker = GenEngineRolloutWorker(
            engine,
            dataset=train_dataset,
            reward_funcs=funcs,
            tokenizer=processing_class,
            sampling=sampling,
            max_inflight=inflight,
            max_staleness=int(args.max_staleness),
            queue_maxsize=int(args.queue_maxsize),
            chat_template_kwargs=args.chat_template_kwargs if isinstance(args.chat_template_kwargs, dict) else None,
            seed=int(args.seed),
            owns_engine=owns,
        )
        transfer = GenEngineWeightTransfer(engine, worker=worker, lora_sync=lora_sync)
    except BaseException:
        if owns:
            engine.shutdown()
        raise
    if tree_attention == "torch" or (tree_attention == "auto" and tree_attention_needs_torch()):
        use_torch_tree_attention()
    allow_cpu_training()
    return worker, transfer
