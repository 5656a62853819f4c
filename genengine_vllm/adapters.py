"""LoRA adapters on vLLM: each ``load_adapter`` becomes a ``LoRARequest`` that requests carry
(``LLM.generate(lora_request=...)``, ``LLMEngine.add_request(lora_request=...)``).

vLLM 0.24-0.26's ``LoRARequest`` names a folder (``lora_path``; no tensors field). The engine core runs in this
process, so the adapter does not go through one: ``_lora_memory.stage_lora`` builds vLLM's ``LoRAModel`` from the
tensors on the worker's GPU and vLLM's own ``LLMEngine.add_lora`` registers it (the worker's loader answers our
ids from memory; verl patches the same loader to read tensors from the request). ``adapter_sync = "folder"``
keeps the first way: a PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``) in shared memory that
vLLM reads back (0.19 s at 7B rank 16 on an H200, against a few ms from memory: docs/benchmarks.md). Each load
gets its own ``lora_int_id`` (the adapter's uid), so a replacement never changes a request in flight; the
replaced one is removed once no request of ours uses it. vLLM serves adapters when started with
``enable_lora=True`` (its own ``EngineArgs``: ``max_lora_rank``, default 16; ``max_loras``, adapters per batch,
default 1).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from genengine.adapters import Adapter
from genengine.errors import ConfigError, GenEngineError

__all__ = ["ADAPTER_SYNC_MODES", "VLLMAdapters", "adapter_settings", "lora_base_names", "write_adapter_dir"]

_DEFAULT_RANK = 16  # vLLM's LoRAConfig.max_lora_rank default
_SHM = "/dev/shm"
_MEMORY_PATH = "genengine-memory://"
"""The ``lora_path`` of an adapter loaded from memory: never read (our loader answers its id), never empty
(``LoRARequest`` refuses an empty path; vLLM's own warm-up adapters say ``/not/a/real/path``)."""
ADAPTER_SYNC_MODES = ("memory", "folder")


def adapter_settings(llm_options: Mapping[str, Any]) -> tuple[bool, int]:
    """Whether vLLM serves adapters, and its max rank, from the ``vllm.LLM`` options."""
    if not llm_options.get("enable_lora"):
        return False, 0
    rank = llm_options.get("max_lora_rank", _DEFAULT_RANK)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"max_lora_rank={rank!r} must be an integer >= 1")
    return True, rank


def write_adapter_dir(adapter: Adapter, parent: str | None = None) -> str:
    """The adapter as a PEFT folder (what ``LoRARequest.lora_path`` names), in ``parent`` (default: shared memory)."""
    from safetensors.torch import save_file

    if parent is None and os.path.isdir(_SHM):
        parent = _SHM
    path = tempfile.mkdtemp(prefix=f"genengine-lora-{adapter.uid}-", dir=parent)
    try:
        tensors = {}
        for module, (a, b) in adapter.pairs.items():
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.detach().cpu().contiguous()
            tensors[f"base_model.model.{module}.lora_B.weight"] = b.detach().cpu().contiguous()
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        targets = adapter.config.target_modules
        config = {
            "peft_type": "LORA",
            "r": adapter.config.r,
            "lora_alpha": adapter.config.lora_alpha,
            "target_modules": targets if isinstance(targets, str) else list(targets),
            "bias": "none",
            "task_type": "CAUSAL_LM",
        }
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


_LORA_LAYOUTS: weakref.WeakKeyDictionary[Any, tuple[set[str], set[str], dict[str, str]]] = weakref.WeakKeyDictionary()
"""Per vLLM model: its LoRA-wrapped modules, their tails of four or more segments, and packed part -> whole."""


def _lora_layout(model: Any) -> tuple[set[str], set[str], dict[str, str]]:
    wrapped = {name for name, module in model.named_modules() if getattr(module, "base_layer", None) is not None}
    tails = {".".join(parts[i:]) for parts in (w.split(".") for w in wrapped) for i in range(len(parts) - 3)}
    packed: Mapping[str, Sequence[str]] = getattr(model, "packed_modules_mapping", None) or {}
    return wrapped, tails, {part: whole for whole, parts in packed.items() for part in parts}


def lora_base_names(model: Any, items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``items`` renamed for a vLLM model served with ``enable_lora``.

    vLLM wraps every LoRA-capable layer in a ``BaseLayerWithLoRA`` that keeps the original one as ``base_layer``, so
    ``...self_attn.qkv_proj.weight`` becomes ``...qkv_proj.base_layer.weight`` and the model's loader, which looks
    the names up, refuses a trainer's ``q_proj.weight``. A name whose module (after vLLM's packing of q/k/v and
    gate/up, ``packed_modules_mapping``) is wrapped gets the ``base_layer`` segment; the rest pass unchanged. verl
    renames on the trainer's side (``replace_lora_wrapper``); here the engine's own modules decide.
    """
    layout = _LORA_LAYOUTS.get(model)
    if layout is None:  # once per model: its modules do not change after vLLM wrapped them at start-up
        layout = _LORA_LAYOUTS[model] = _lora_layout(model)
    wrapped, tails, whole_of = layout
    if not wrapped:
        return items
    renamed = []
    for name, tensor in items:
        module, _, leaf = name.rpartition(".")
        if leaf in ("weight", "bias") and module and not module.endswith(".base_layer"):
            head, _, last = module.rpartition(".")
            target = f"{head}.{whole_of.get(last, last)}" if head else whole_of.get(last, last)
            # The same module path, or the same last four segments (a model whose HF prefix vLLM maps differently).
            if target in wrapped or ".".join(target.split(".")[-4:]) in tails:
                name = f"{module}.base_layer.{leaf}"
        renamed.append((name, tensor))
    return renamed


class VLLMAdapters:
    """``AdapterHost``'s hooks for ``VLLMEngine`` (a mixin before ``AsyncEngineBase`` in its bases)."""

    adapter_sync: str = "memory"
    """How ``load_adapter`` hands an adapter to vLLM: ``"memory"`` (built on the GPU from the tensors) or
    ``"folder"`` (a PEFT folder in shared memory that vLLM reads back: the first way, kept to compare against)."""
    settings: Any  # VLLMSettings
    _llm: Any
    _load_device: Any = None  # VLLMEngine's: this rank's GPU (a torch.device), None without CUDA
    _lock: Any  # VLLMEngine's DriverLock
    if TYPE_CHECKING:
        # AdapterHost's (EngineBase's bases)
        _retired_adapters: list[Adapter]

        def _retire_adapter(self, adapter: Adapter, unload: Callable[[Adapter], None]) -> None: ...
        def _unload_idle_adapters(self, unload: Callable[[Adapter], None]) -> None: ...

    @property
    def supports_adapters(self) -> bool:  # type: ignore[override]
        return adapter_settings(self.settings.llm_options)[0]

    def _max_lora_rank(self) -> int:
        return adapter_settings(self.settings.llm_options)[1]

    def _refresh_lora_mapping(self) -> None:
        """After vLLM's ``add_lora``/``remove_lora`` (under the lock, between steps): a release that would keep
        the running batch's stale slot metadata rebuilds it at the next step (``compat.refresh_lora_mapping``).
        A release that needs none (0.26.0 on) answers so once, and is not asked again."""
        from genengine_vllm import _lora_memory

        if self.__dict__.get("_lora_mapping_kept_right"):
            return
        if not any(self._llm.collective_rpc(_lora_memory.refresh_mapping)):
            self.__dict__["_lora_mapping_kept_right"] = True

    def _add_adapter(self, adapter: Adapter, replaced: Adapter | None) -> None:
        import time

        start = time.perf_counter()
        self._unload_idle_adapters(self._unload_adapter)
        adapter.phases["unload_s"] = time.perf_counter() - start
        mode = self.adapter_sync
        if mode not in ADAPTER_SYNC_MODES:
            raise ConfigError(f"adapter_sync={mode!r} is not supported; allowed: {', '.join(ADAPTER_SYNC_MODES)}")
        if mode == "folder":
            self._add_adapter_folder(adapter)
        else:
            self._add_adapter_memory(adapter)

    def _add_adapter_memory(self, adapter: Adapter) -> None:
        """``stage_lora`` on the worker (the GPU copy, vLLM's ``LoRAModel``), then vLLM's ``add_lora``."""
        import time

        from vllm.lora.request import LoRARequest

        from genengine_vllm import _lora_memory

        name = f"{adapter.name}@{adapter.uid}"
        request = LoRARequest(lora_name=name, lora_int_id=adapter.uid, lora_path=f"{_MEMORY_PATH}{name}")
        targets = adapter.config.target_modules
        start = time.perf_counter()
        try:
            with self._lock():
                (steps,) = self._llm.collective_rpc(
                    _lora_memory.stage_lora,
                    args=(
                        adapter.uid,
                        adapter.pairs,
                        adapter.config.r,
                        adapter.config.scaling,
                        targets if isinstance(targets, str) else list(targets),
                    ),
                )
                adapter.phases.update(steps)
                staged = time.perf_counter()
                try:
                    added = self._llm.llm_engine.add_lora(request)
                finally:
                    self._refresh_lora_mapping()
                    adapter.phases["add_lora_s"] = time.perf_counter() - staged
                if not added:
                    raise GenEngineError(f"vLLM refused adapter {adapter.name!r} (add_lora returned False)")
                # The copy from the caller's tensors and vLLM's copies into its slots run on this thread's
                # stream: done before we return (the trainer may write its tensors at once, on any stream) and
                # before the driver's next step (its own stream) reads the slots.
                synced = time.perf_counter()
                if self._load_device is not None:
                    import torch

                    torch.cuda.current_stream(self._load_device).synchronize()
                adapter.phases["sync_s"] = time.perf_counter() - synced
        except BaseException as exc:
            with self._lock():  # nothing of it stays in vLLM
                with contextlib.suppress(Exception):
                    self._llm.llm_engine.remove_lora(adapter.uid)
                with contextlib.suppress(Exception):
                    self._llm.collective_rpc(_lora_memory.drop_lora, args=(adapter.uid,))
                with contextlib.suppress(Exception):
                    self._refresh_lora_mapping()
            if isinstance(exc, Exception) and not isinstance(exc, GenEngineError):
                raise GenEngineError(f"vLLM refused adapter {adapter.name!r}: {exc}") from exc
            raise
        adapter.phases.setdefault("stage_s", staged - start)
        adapter.handle = request

    def _add_adapter_folder(self, adapter: Adapter) -> None:
        """The PEFT folder in shared memory, read back by vLLM's ``add_lora`` (the baseline)."""
        import time

        from vllm.lora.request import LoRARequest

        start = time.perf_counter()
        path = write_adapter_dir(adapter)
        written = time.perf_counter()
        adapter.phases["write_folder_s"] = written - start
        request = LoRARequest(lora_name=f"{adapter.name}@{adapter.uid}", lora_int_id=adapter.uid, lora_path=path)
        try:
            with self._lock():
                try:
                    added = self._llm.llm_engine.add_lora(request)
                finally:
                    self._refresh_lora_mapping()
        except BaseException as exc:
            shutil.rmtree(path, ignore_errors=True)
            if isinstance(exc, Exception) and not isinstance(exc, GenEngineError):
                raise GenEngineError(f"vLLM refused adapter {adapter.name!r}: {exc}") from exc
            raise
        finally:
            adapter.phases["add_lora_s"] = time.perf_counter() - written
        if not added:
            shutil.rmtree(path, ignore_errors=True)
            raise GenEngineError(f"vLLM refused adapter {adapter.name!r} (add_lora returned False)")
        adapter.handle = request

    def _drop_adapter(self, adapter: Adapter) -> None:
        self._retire_adapter(adapter, self._unload_adapter)

    def _unload_adapter(self, adapter: Adapter) -> None:
        """Remove ``adapter`` from vLLM, and its folder or its staged model."""
        with self._lock():
            try:
                self._llm.llm_engine.remove_lora(adapter.uid)
            finally:
                self._refresh_lora_mapping()
            if adapter.handle.lora_path.startswith(_MEMORY_PATH):
                from genengine_vllm import _lora_memory

                self._llm.collective_rpc(_lora_memory.drop_lora, args=(adapter.uid,))
        _remove_dir(adapter.handle.lora_path)

    def _remove_adapter_dirs(self) -> None:
        """At shutdown: the folders of every adapter still loaded or retired (vLLM is gone with them)."""
        registry: Mapping[str, Adapter] = self.__dict__.get("_adapters_by_name", {})
        for adapter in [*registry.values(), *self._retired_adapters]:
            if adapter.handle is not None:
                _remove_dir(adapter.handle.lora_path)


def _remove_dir(path: str) -> None:
    """An adapter's folder (nothing for one loaded from memory)."""
    if not path.startswith(_MEMORY_PATH):
        shutil.rmtree(path, ignore_errors=True)
