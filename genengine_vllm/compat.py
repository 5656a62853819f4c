"""The vLLM releases this plugin supports and was verified against, and where they differ: the one place.

``SUPPORTED`` are the releases the code is written for: each has a recorded API surface
(``surfaces/VERSION.json``, made by ``tools/engine_surface.py`` from the release's wheel) that
``tests/plugins/test_engine_surfaces.py`` checks the plugin's uses (``genengine_vllm.upstream``) against on the CPU.
``VERIFIED`` is the part of them run on the H200 (GPU suite and ``verify.sh``); pyproject's ``vllm`` extra
declares exactly that range (tests/plugins/test_engine_versions.py holds them equal); widen it only after both ends
have passed (docs/deployment.md's matrix). Where releases differ in what the plugin uses, a function here
branches on the feature, and ``BRANCHES`` names the use and the releases that lack it (the surface test holds
that list exact). 0.24.0 - 0.26.0 differ in one: ``WeightsMapper.get_unstacked_mapper`` (0.25.0 on), which
vLLM's own folder loader applies to a model's name mapper before reading an adapter; ``_lora_memory.stage_lora``
does the same where it exists (``hasattr``), as 0.24.0's loader uses the mapper as it is. And behaviour, same
names: before 0.26.0 ``LoRAModelManager.set_adapter_mapping`` rebuilds the punica metadata only when the batch's
mapping changed, so an ``add_lora`` between steps that moves adapters between GPU slots (LRU eviction at
``max_loras``) leaves the running batch reading the wrong slots; ``refresh_lora_mapping`` forces the rebuild there.
0.24.0 leaves its sleep allocator's pools to interpreter finalization, which can abort the exit ("pure virtual
method called"), and keeps them, with the engine's memory, after the engine's shutdown; ``release_cumem_pools_at_exit``
and ``release_cumem_pools`` release them, as 0.25.0 on do themselves (at exit and in ``Worker.shutdown``).
"""

from __future__ import annotations

import atexit
import functools
import gc
import sys
from collections.abc import Mapping
from typing import Any

from genengine.backend import VerifiedRange
from genengine.plugins.versions import VersionStatus, check_engine_version, installed_surface, recorded_surface

__all__ = [
    "BRANCHES",
    "SUPPORTED",
    "VERIFIED",
    "check_installed",
    "recorded_engine_args",
    "refresh_lora_mapping",
    "release_cumem_pools",
    "release_cumem_pools_at_exit",
    "surface",
]

VERIFIED = VerifiedRange("vllm", minimum="0.24.0", maximum="0.26.0")
"""Verified 2026-12-04 on the H200 with torch 2.11 (docs/deployment.md, "Supported engine versions")."""

SUPPORTED: tuple[str, ...] = ("0.24.0", "0.25.0", "0.25.1", "0.26.0")
"""Every release from 0.24.0 to 0.26.0 on the index (all pin torch 2.11.0), each with a recorded surface."""

BRANCHES: Mapping[str, tuple[str, ...]] = {
    # _lora_memory.stage_lora: the name mapper vLLM's adapter loader uses, unstacked from 0.25.0 on.
    "vllm.model_executor.models.utils:WeightsMapper.get_unstacked_mapper": ("0.24.0",),
    # release_cumem_pools(_at_exit): vLLM drops its sleep pools in Worker.shutdown and before interpreter
    # finalization, 0.25.0 on.
    "vllm.device_allocator.cumem:CuMemAllocator.release_pools": ("0.24.0",),
    # refresh_lora_mapping: the punica mapping rebuilt when slots move under an unchanged batch, 0.26.0 on.
    "vllm.lora.model_manager:LRUCacheLoRAModelManager._last_slot_layout": ("0.24.0", "0.25.0", "0.25.1"),
}
"""Each use of ``genengine_vllm.upstream.USES`` that some supported releases lack → those releases."""


def refresh_lora_mapping(adapter_manager: Any) -> bool:
    """After an out-of-band ``add_lora``/``remove_lora``: make the next step rebuild the LoRA slot metadata.

    vLLM 0.24.0-0.25.1 (lora/model_manager.py, ``LoRAModelManager.set_adapter_mapping``) skip the rebuild
    while the batch's ``LoRAMapping`` equals the last one, although ``add_lora`` may have LRU-evicted an active
    adapter and reassigned its slot (``lora_index_to_id``): the requests in flight would then run with another
    adapter's weights. 0.26.0 compares the slot layout too (``_last_slot_layout``), and needs nothing. True
    when the cached mapping was dropped."""
    if hasattr(adapter_manager, "_last_slot_layout"):  # BRANCHES: 0.26.0 on
        return False
    adapter_manager._last_mapping = None
    return True


_CUMEM_EXIT_REGISTERED = False


def release_cumem_pools_at_exit() -> bool:
    """After a sleep-enabled ``vllm.LLM`` started: where vLLM does not release its sleep pools before the
    interpreter finalizes (0.24.0), register the release vLLM 0.25.0 on register themselves.

    ``CuMemAllocator.use_memory_pool`` keeps each tag's ``(MemPool, allocator)`` alive for good
    (``allocator_and_pools``, for pytorch/pytorch#146431); left to finalization, GC may free the allocator
    before its ``MemPool``, whose destructor then calls into it and the process aborts with "pure virtual
    method called" (pytorch/pytorch#145168; 0.26.0 ``device_allocator/cumem.py:120-183``,
    ``CuMemAllocator.release_pools`` and its ``atexit`` hook). True when this registered the release."""
    global _CUMEM_EXIT_REGISTERED
    cls = _cumem_without_release()
    if cls is None or _CUMEM_EXIT_REGISTERED:
        return False
    atexit.register(_release_cumem_pools, cls)
    _CUMEM_EXIT_REGISTERED = True
    return True


def release_cumem_pools() -> bool:
    """After a sleep-enabled engine's shutdown: release vLLM's sleep pools where its ``Worker.shutdown`` does
    not (0.24.0), so that the engine's memory is free when shutdown returns and the process's next engine
    starts on an allocator without a foreign pool (0.25.0 on call ``CuMemAllocator.release_pools`` there,
    0.26.0 ``v1/worker/gpu_worker.py:1397-1405``). True when this released them."""
    cls = _cumem_without_release()
    if cls is None:
        return False
    _release_cumem_pools(cls)
    return True


def _cumem_without_release() -> Any:
    """vLLM's ``CuMemAllocator`` where it was loaded and does not release its pools itself (0.24.0), else None."""
    module = sys.modules.get("vllm.device_allocator.cumem")  # only if vLLM's allocator was ever loaded
    cls = getattr(module, "CuMemAllocator", None)
    if cls is None or hasattr(cls, "release_pools"):  # BRANCHES: 0.25.0 on
        return None
    return cls


def _release_cumem_pools(cls: Any) -> None:
    """vLLM 0.26.0's ``CuMemAllocator.release_pools``: the pools go first (their allocators still held), then
    the allocators."""
    pools = getattr(getattr(cls, "instance", None), "allocator_and_pools", None)
    if not pools:
        return
    entries = list(pools.values())
    pools.clear()
    mem_pools = [entry[0] for entry in entries]
    allocators = [entry[1] for entry in entries]
    entries.clear()
    mem_pools.clear()
    gc.collect()
    allocators.clear()


def check_installed(options: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> VersionStatus:
    """Refuse an installed vLLM outside ``VERIFIED`` unless the user allows it (see ``check_engine_version``)."""
    return check_engine_version(VERIFIED, options, backend="vllm", environ=environ)


def surface(version: str) -> dict[str, Any] | None:
    """The recorded surface of ``version`` (``surfaces/VERSION.json``), or None when none was recorded."""
    return recorded_surface("genengine_vllm", version)


@functools.cache
def recorded_engine_args() -> frozenset[str]:
    """``EngineArgs``' public field names where vLLM cannot be imported: the installed release's recorded
    ones (read from its metadata, vLLM not imported), else those of the newest verified release."""
    data = installed_surface("genengine_vllm", VERIFIED)
    return frozenset(f for f in data["fields"]["vllm.engine.arg_utils:EngineArgs"] if not f.startswith("_"))
