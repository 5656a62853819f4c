"""The weight transfer of the TRL async integration (:mod:`genengine.integrations.trl_async`, which exports it):
TRL's ``WeightTransferProtocol`` over a genengine engine or ``EnginePool``, and the event-loop thread the worker and
the transfer share. With the trainer's policy in view (``callbacks=[transfer]``) a PEFT policy is synced
adapter-only where the engine serves adapters (:mod:`genengine.integrations.trl_lora`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine, Iterable
from typing import Any, Protocol

from transformers import TrainerCallback

from genengine.adapters import AdapterConfig, AdapterInfo
from genengine.errors import ConfigError, EngineStateError, InvalidArgumentError
from genengine.integrations.trl_lora import (
    ADAPTER_NAME,
    LoraSync,
    MergeHold,
    SyncMode,
    check_lora_sync,
    choose_lora_sync,
    is_peft_policy,
    log_choice,
    peft_adapter_weights,
    peft_base_weights,
)
from genengine.protocol import LoadReport, PauseMode, is_async_engine

__all__ = ["PAUSE_MODES", "GenEngineWeightTransfer"]

_log = logging.getLogger("genengine.integrations.trl_async")

PAUSE_MODES = ("keep", "wait")
"""How the transfer pauses the engine for a sync: ``keep`` holds in-flight samples and carries them over to the
new weights; ``wait`` lets them finish first. (``abort`` would throw away work the worker then has to redo.)"""


class LoopThread:
    """One asyncio loop on a daemon thread: the worker's rollouts and the transfer's pause/resume run on it, so
    the engine's streams and its pauses share one loop whichever thread the trainer calls from."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._thread is None or not self._thread.is_alive():
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=loop.run_forever, name=self._name, daemon=True)
                self._thread.start()
                self._loop = loop
            return self._loop

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._started())

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float, what: str) -> Any:
        future = self.submit(coro)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise EngineStateError(f"{what} did not return within {timeout_s:.0f}s (is the engine stuck?)") from None

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=timeout_s)
        if not thread.is_alive():
            loop.close()


class _Worker(Protocol):
    """What the transfer uses of ``trl_async.GenEngineRolloutWorker`` (which imports this module)."""

    engine: Any
    model_version: int
    _runner: LoopThread

    def use_adapter(self, name: str | None) -> None: ...


class GenEngineWeightTransfer(TrainerCallback):
    """TRL's ``WeightTransferProtocol`` over a genengine engine or ``EnginePool``: pause, one bucketed
    ``load_weights`` per sync labelled with the trainer's next ``model_version``, resume.

    With ``worker`` (the :class:`GenEngineRolloutWorker` of the same engine) the label is ``worker.model_version
    + 1`` (TRL bumps its version by one right after each sync) and the pause runs on the worker's loop; without
    it the syncs are counted from 1. Passed to the trainer as a callback too (``callbacks=[transfer]``) it sees the
    trainer's policy: a PEFT policy on an engine that serves adapters is then synced adapter-only (``lora_sync``,
    as the ``GRPOTrainer`` integration): the base weights once, then one ``load_adapter`` per sync, the worker's
    requests naming the adapter; TRL's merge of the adapter around ``send_weights`` is skipped for the sync.
    """

    def __init__(
        self,
        engine: Any,
        *,
        worker: _Worker | None = None,
        pause_mode: PauseMode = "keep",
        clear_cache: bool = True,
        control_timeout_s: float = 300.0,
        lora_sync: LoraSync = "auto",
    ) -> None:
        if pause_mode not in PAUSE_MODES:
            raise InvalidArgumentError(f"pause_mode={pause_mode!r} is not one of {', '.join(map(repr, PAUSE_MODES))}")
        if not is_async_engine(engine):
            raise ConfigError(f"{type(engine).__name__} does not serve the async calls (supports_async is not True)")
        if worker is not None and worker.engine is not engine:
            raise InvalidArgumentError("worker rolls out on another engine than this transfer's")
        self.engine: Any = engine
        self.pause_mode: PauseMode = pause_mode
        self.clear_cache = bool(clear_cache)
        self.control_timeout_s = float(control_timeout_s)
        self.lora_sync: LoraSync = check_lora_sync(lora_sync)
        self.sync_mode: SyncMode = "full"
        """What each sync sends (``trl_lora.SyncMode``): TRL's stream (``"full"``; a PEFT policy the transfer has not
        seen comes merged), the PEFT policy merged (``"merge"``) or only its adapter (``"adapter"``)."""
        self.last_load: LoadReport | None = None
        self.last_adapter: AdapterInfo | None = None
        """The last adapter-only sync's ``AdapterInfo``."""
        self.versions: list[int] = []
        """The version of each sync, in order (what ``engine.weight_version`` became)."""
        self._worker = worker
        self._runner = worker._runner if worker is not None else LoopThread("genengine-trl-transfer")
        self._policy: Any = None
        self._adapter_config: AdapterConfig | None = None
        self._base_synced = False
        self._merge_hold = MergeHold()

    # ---- the trainer's policy (as a TrainerCallback) ------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """The trainer is built: its policy decides what each sync sends (a ``ConfigError`` here for
        ``lora_sync='adapter'`` that cannot be honoured)."""
        self.use_policy(model)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.use_policy(model)

    def use_policy(self, model: Any) -> None:
        """Sync ``model`` (the trainer's policy): a PEFT policy adapter-only where ``lora_sync`` and the engine
        allow it, else merged; logged. The callback hooks call it; idempotent for the same policy."""
        if model is None or model is self._policy:
            return
        if not is_peft_policy(model):
            self._policy, self.sync_mode = model, "full"
            return
        dtensor = any(type(p).__name__ == "DTensor" for p in model.parameters())
        self.sync_mode, self._adapter_config, why = choose_lora_sync(
            model, self.engine, self.lora_sync, sharded="adapter-only sync of an FSDP policy" if dtensor else ""
        )
        self._policy, self._base_synced = model, False
        if self._worker is not None:
            self._worker.use_adapter(ADAPTER_NAME if self.sync_mode == "adapter" else None)
        log_choice(_log, "AsyncGRPOTrainer", self.sync_mode, why)

    # ---- TRL's protocol ----------------------------------------------------------------------------------
    def init_weight_transfer(self) -> None:
        """Check the engine is up; nothing to set up (weights reach the engine through ``load_weights``)."""
        if getattr(self.engine.state, "closed", False):
            raise EngineStateError("the engine is shut down: build a new backend with make_async_backend")
        if self._policy is None:
            unseen = "the transfer has not seen the trainer's policy: pass callbacks=[transfer] to the trainer"
            if self.lora_sync == "adapter":
                raise ConfigError(f"lora_sync='adapter' but {unseen}")
            _log.info("%s; a PEFT policy is then synced merged, as TRL streams it", unseen)

    def pause(self) -> None:
        """Hold generation for the sync (``keep``: in-flight samples wait and go on with the new weights; under
        adapter sync with the adapter they started with)."""
        coro = self.engine.pause_generation(self.pause_mode, clear_cache=self.clear_cache)
        self._runner.run(coro, self.control_timeout_s, f"engine.pause_generation({self.pause_mode!r})")
        if self.sync_mode == "adapter":
            self._merge_hold.hold(self._policy)  # TRL merges the adapter next: not needed, and not exact

    def send_weights(self, iterator: Iterable[tuple[str, Any]]) -> None:
        """Write the trainer's ``(name, tensor)`` stream in one ``load_weights`` (it checks every name and shape,
        writes in buckets and flushes the prefix cache), labelled with the trainer's next version. Under adapter
        sync the stream is not read: the policy's adapter is loaded instead (the base weights the first time)."""
        version = (self._worker.model_version if self._worker is not None else len(self.versions)) + 1
        if self.sync_mode == "adapter":
            close = getattr(iterator, "close", None)
            if close is not None:
                close()  # TRL's parameter walk, not needed: the adapter comes from the policy itself
            self._send_adapter(version)
        else:
            self.last_load = self.engine.load_weights(iterator, version=version)
        self.versions.append(version)

    def _send_adapter(self, version: int) -> None:
        import torch

        with torch.no_grad():
            if not self._base_synced:
                self.last_load = self.engine.load_weights(list(peft_base_weights(self._policy)), version=version)
                self._base_synced = True
            tensors = peft_adapter_weights(self._policy)
            self.last_adapter = self.engine.load_adapter(ADAPTER_NAME, tensors, self._adapter_config, version=version)

    def resume(self) -> None:
        """Let the held and queued requests go on, with the new weights."""
        try:
            self._runner.run(self.engine.resume_generation(), self.control_timeout_s, "engine.resume_generation()")
        finally:
            self._merge_hold.release()

    def destroy(self) -> None:
        """Nothing to release: the engine belongs to the worker (``worker.shutdown()``) or to the caller."""
        self._merge_hold.release()
        if self._worker is None:
            self._runner.stop()
