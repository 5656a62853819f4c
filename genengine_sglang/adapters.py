"""LoRA adapters on SGLang: ``load_adapter`` through SGLang's ``load_lora_adapter_from_tensors`` (0.5.17), a
request's adapter through ``GenerateReqInput.lora_path``.

SGLang serves adapters only when the engine starts with them enabled: pass SGLang's own server arguments as
options, ``enable_lora=True``, ``max_lora_rank`` and ``lora_target_modules`` (SGLang needs the last two when no
``lora_paths`` are given: they size its LoRA memory pool). Each genengine adapter object is loaded under its own
SGLang name (``<name>@<uid>``), so a replacement never changes a request in flight; the replaced one is unloaded
once no request of ours still uses it (SGLang's unload would otherwise wait for them, and a request held by a
``keep`` pause resubmits under it).

The tensors travel as one flattened bucket (``load_format="flattened_bucket"``, SGLang's ``FlattenedTensorBucket``)
in one shared-memory buffer: SGLang's scheduler keeps adapters in host memory (``LoRAAdapter._process_weight``
calls ``.cpu()`` on each tensor) and copies them to its GPU pool when a batch uses them, so host memory is where
they go anyway. ``adapter_sync = "tensors"`` keeps the first way (one host tensor each, which torch's
``ForkingPickler`` moves into its own shared-memory segment per tensor and hands over one file descriptor at a
time: 2.35 s for 420 tensors at 7B rank 16; docs/benchmarks.md).

The shared-memory buffers are recycled (``SharedBuffers``): a fresh one costs its allocation and a page fault per
page at the first copy into it (most of the flatten time at 7B rank 16), while in RL steady state each step loads a
new version of the same adapter, the same size. A buffer is reused only once SGLang no longer reads it: after the
unload of the adapter that used it succeeded (SGLang 0.5.17's ``unload_lora_adapter`` drops that adapter's host
tensors, the views of the buffer, and reads them nowhere else: its GPU pool copies them through a pinned copy of
its own), or after SGLang refused the load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from genengine.adapters import Adapter
from genengine.errors import ConfigError, GenEngineError
from genengine_sglang.compat import lora_tensors_per_rank

__all__ = [
    "ADAPTER_SYNC_MODES",
    "SGLANG_LORA_MODULES",
    "SGLangAdapters",
    "SharedBuffers",
    "adapter_settings",
    "config_dict",
    "flat_adapter",
    "sglang_name",
    "sglang_named_tensors",
    "sglang_tensors",
]

ADAPTER_SYNC_MODES = ("flattened", "cuda_ipc", "tensors")

SGLANG_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections SGLang 0.5.17 adapts on dense models (``sglang/srt/lora/utils.py``; qkv and gate/up are
fused there, which it does itself from the separate PEFT weights)."""


def adapter_settings(overrides: Mapping[str, Any]) -> tuple[bool, int, tuple[str, ...]]:
    """Whether the engine serves adapters, its max rank and the modules it adapts, from the server arguments."""
    if not overrides.get("enable_lora"):
        return False, 0, ()
    rank = overrides.get("max_lora_rank")
    targets = overrides.get("lora_target_modules")
    if rank is None or targets is None:
        raise ConfigError(
            "enable_lora=True: give max_lora_rank (an int) and lora_target_modules (a list such as ['q_proj', "
            "'v_proj'], or 'all') too, so that SGLang sizes its LoRA pool for the adapters load_adapter sends"
        )
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"max_lora_rank={rank!r} must be an integer >= 1")
    if targets == "all" or targets == ["all"]:
        modules = SGLANG_LORA_MODULES
    else:
        if isinstance(targets, str) or not all(isinstance(t, str) for t in targets):
            raise ConfigError(f"lora_target_modules={targets!r} must be a list of module names or 'all'")
        unknown = sorted(set(targets) - set(SGLANG_LORA_MODULES))
        if unknown:
            raise ConfigError(
                f"lora_target_modules {unknown}: SGLang adapts {', '.join(SGLANG_LORA_MODULES)} (or 'all')"
            )
        modules = tuple(targets)
    return True, rank, modules


def sglang_name(adapter: Adapter) -> str:
    """The adapter object's name in SGLang: unique per load, so a replacement is a new adapter there."""
    return f"{adapter.name}@{adapter.uid}"


def config_dict(adapter: Adapter) -> dict[str, Any]:
    """The PEFT ``adapter_config.json`` SGLang's ``LoRAConfig.from_dict`` reads."""
    targets = adapter.config.target_modules
    return {
        "peft_type": "LORA",
        "r": adapter.config.r,
        "lora_alpha": adapter.config.lora_alpha,
        "target_modules": targets if isinstance(targets, str) else list(targets),
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }


def sglang_tensors(adapter: Adapter) -> dict[str, Any]:
    """PEFT's names (``base_model.model.<module>.lora_A.weight``), on the CPU: SGLang keeps adapters in host memory
    until a batch needs them and serializes one copy per TP rank."""
    tensors: dict[str, Any] = {}
    for module, (a, b) in adapter.pairs.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.detach().cpu().contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.detach().cpu().contiguous()
    return tensors


_FUSED_B = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
"""SGLang's fused projections and their parts, in its order (``LoRAAdapter.normalize_qkv_proj``,
``normalize_gate_up_proj``: a ``lora_B`` under the fused name is taken as already stacked)."""


def sglang_named_tensors(adapter: Adapter) -> list[tuple[str, Any]]:
    """PEFT's names, but each fused projection's ``lora_B`` already stacked (q/k/v, gate/up, where the adapter has
    every part) under the fused name, which SGLang's scheduler would otherwise concatenate on its CPU
    (``lora/lora.py:295``, ``:485``); their ``lora_A`` stay apart (SGLang stacks those itself, and would repeat a
    fused one). Stacking is a ``torch.cat`` where the tensors are (the trainer's GPU)."""
    import torch

    pairs = adapter.pairs
    stacked: dict[str, tuple[str, list[str]]] = {}  # first part -> (fused module, its parts)
    for module in pairs:
        head, _, last = module.rpartition(".")
        for fused, parts in _FUSED_B:
            if last == parts[0] and all(f"{head}.{p}" in pairs for p in parts):
                stacked[module] = (f"{head}.{fused}", [f"{head}.{p}" for p in parts])
    in_stack = {part for _, members in stacked.values() for part in members}
    named: list[tuple[str, Any]] = []
    for module, (a, b) in pairs.items():
        named.append((f"base_model.model.{module}.lora_A.weight", a))
        if module in stacked:
            fused, members = stacked[module]
            named.append((f"base_model.model.{fused}.lora_B.weight", torch.cat([pairs[m][1] for m in members])))
        elif module not in in_stack:
            named.append((f"base_model.model.{module}.lora_B.weight", b))
    return named


def flat_adapter(
    adapter: Adapter, *, host: bool = True, take: Callable[[int], Any] | None = None
) -> tuple[Any, list[Any]]:
    """The adapter's tensors (``sglang_named_tensors``) as SGLang's flattened bucket: ``(flattened_tensor,
    metadata)``, one copy (the caller may change its tensors once the load returns), in one shared-memory host
    buffer (``host``: ``take(nbytes)`` gives it, a uint8 tensor of that size; a fresh one without) or where the
    tensors are (the GPU: to travel as one CUDA-IPC handle)."""
    import torch
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    first = next(iter(adapter.pairs.values()))[0]
    device, dtype = first.device, first.dtype
    for a, b in adapter.pairs.values():
        dtype = torch.promote_types(dtype, torch.promote_types(a.dtype, b.dtype))
    # One dtype (mixed ones promoted, which loses nothing): SGLang views each tensor's bytes back as its dtype,
    # which needs them aligned to its size.
    named = [(name, t.detach().to(device=device, dtype=dtype)) for name, t in sglang_named_tensors(adapter)]
    bucket = FlattenedTensorBucket(named_tensors=named)  # one torch.cat where the tensors are (the GPU)
    flat = bucket.get_flattened_tensor()
    if not host:
        if flat.is_cuda:  # another process reads it through IPC, with no stream ordering against ours
            torch.cuda.current_stream(flat.device).synchronize()
        return flat, bucket.get_metadata()
    shared = (take or new_shared_bytes)(flat.numel())
    shared.copy_(flat)
    return shared, bucket.get_metadata()


def new_shared_bytes(nbytes: int) -> Any:
    """A fresh uint8 tensor of ``nbytes`` in shared memory, allocated there at once where torch can
    (``share_memory_()`` on a fresh tensor copies it there again)."""
    import torch

    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is not None:
        return torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes))
    return torch.empty(nbytes, dtype=torch.uint8).share_memory_()


class SharedBuffers:
    """The shared-memory buffers of the flattened adapters: the one each loaded adapter's host tensors view in
    SGLang (by ``Adapter.uid``), and at most ``max_idle`` idle ones that the next loads reuse.

    Reuse takes an exact size match only: in steady state a new version of the same adapter has the same size, and
    a larger buffer sliced would keep its whole segment mapped in SGLang for a smaller adapter; a miss allocates a
    fresh one (the oldest idle one goes when more than ``max_idle`` wait)."""

    def __init__(self, max_idle: int = 2) -> None:
        self.max_idle = max_idle
        self.in_use: dict[int, Any] = {}
        self.idle: list[Any] = []  # oldest first

    def take(self, nbytes: int) -> tuple[Any, bool]:
        """A buffer of ``nbytes`` and whether it was reused (an idle one, its old bytes still there)."""
        for i in range(len(self.idle) - 1, -1, -1):
            if self.idle[i].numel() == nbytes:
                return self.idle.pop(i), True
        return new_shared_bytes(nbytes), False

    def hold(self, uid: int, buffer: Any) -> None:
        """``buffer`` now backs the loaded adapter ``uid`` in SGLang: never reused while that one is loaded."""
        self.in_use[uid] = buffer

    def give_back(self, buffer: Any) -> None:
        """``buffer`` is no longer read by SGLang (its load refused, or its adapter unloaded): reusable."""
        self.idle.append(buffer)
        del self.idle[: max(0, len(self.idle) - self.max_idle)]

    def release(self, uid: int, *, reusable: bool = True) -> None:
        """Adapter ``uid`` was unloaded (``reusable``) or may still be read (its unload failed: forget the buffer,
        whose memory stays until SGLang drops its own mapping)."""
        buffer = self.in_use.pop(uid, None)
        if buffer is not None and reusable:
            self.give_back(buffer)

    def clear(self) -> None:
        """Drop every buffer (shutdown)."""
        self.in_use.clear()
        self.idle.clear()


class SGLangAdapters:
    """``AdapterHost``'s hooks for ``SGLangEngine`` (a mixin before ``AsyncEngineBase`` in its bases)."""

    adapter_sync: str = "flattened"
    """How ``load_adapter`` hands an adapter to SGLang: ``"flattened"`` (one shared-memory bucket),
    ``"cuda_ipc"`` (the bucket on the GPU as one CUDA-IPC handle, SGLang's scheduler copying it to its host
    memory; one TP rank) or ``"tensors"`` (one host tensor each: the first way, kept to compare against)."""
    _settings: Any  # SGLangSettings (settings.py imports this module: no arrow back)
    _engine: Any
    if TYPE_CHECKING:  # SGLangEngine's and AsyncEngineBase's (a stub here would shadow the latter)

        def _on_leader(self, op: str, fn: Any) -> Any: ...
        def _sgl(self, fn: Any, what: str = ...) -> Any: ...

        # AdapterHost's (EngineBase's bases)
        _retired_adapters: list[Adapter]

        def _retire_adapter(self, adapter: Adapter, unload: Callable[[Adapter], None]) -> None: ...
        def _unload_idle_adapters(self, unload: Callable[[Adapter], None]) -> None: ...

    @property
    def supports_adapters(self) -> bool:  # type: ignore[override]
        return adapter_settings(self._settings.server_overrides)[0]

    @property
    def adapter_modules(self) -> tuple[str, ...]:  # type: ignore[override]
        return adapter_settings(self._settings.server_overrides)[2]

    def _max_lora_rank(self) -> int:
        return adapter_settings(self._settings.server_overrides)[1]

    @property
    def _shared_buffers(self) -> SharedBuffers:
        buffers: SharedBuffers | None = self.__dict__.get("_shared_buffers_pool")
        if buffers is None:
            buffers = self.__dict__["_shared_buffers_pool"] = SharedBuffers()
        return buffers

    def _drop_adapter_buffers(self) -> None:
        """Shutdown: the shared-memory buffers go (SGLang, stopped, reads none of them)."""
        self._shared_buffers.clear()

    def _add_adapter(self, adapter: Adapter, replaced: Adapter | None) -> None:
        import time

        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput

        if not lora_tensors_per_rank(self._engine):  # compat.BRANCHES: before 0.5.17
            raise GenEngineError(
                "this SGLang release cannot load adapters from tensors as genengine sends them: 0.5.17 can"
            )
        mode = self.adapter_sync
        if mode not in ADAPTER_SYNC_MODES:
            raise ConfigError(f"adapter_sync={mode!r} is not supported; allowed: {', '.join(ADAPTER_SYNC_MODES)}")
        if mode == "cuda_ipc" and getattr(self._settings, "tp_size", 1) > 1:
            raise ConfigError(
                "adapter_sync='cuda_ipc' serves one TP rank (each scheduler would open the leader's GPU memory); "
                "use 'flattened' with tp_size > 1"
            )
        start = time.perf_counter()
        self._unload_idle_adapters(self._unload_adapter)
        adapter.phases["unload_s"] = time.perf_counter() - start
        name = sglang_name(adapter)

        buffers = self._shared_buffers
        taken: list[Any] = []  # the shared-memory buffer of this load ("flattened")

        def take(nbytes: int) -> Any:
            buffer, reused = buffers.take(nbytes)
            adapter.phases["flatten_reused"] = float(reused)
            taken.append(buffer)
            return buffer

        def run() -> None:
            engine = self._engine
            begin = time.perf_counter()
            if mode != "tensors":
                shared, metadata = flat_adapter(adapter, host=mode == "flattened", take=take)
                copied = time.perf_counter()
                adapter.phases["flatten_s"] = copied - begin
                # One payload per TP rank (load_format None: serialize it as it is), each a handle of the buffer.
                payloads = engine._serialize_tensors_per_rank({"flattened_tensor": shared, "metadata": metadata}, None)
                load_format: str | None = "flattened_bucket"
            else:
                copied = begin
                payloads = engine._serialize_tensors_per_rank(sglang_tensors(adapter), None)
                load_format = None
            serialized = time.perf_counter()
            adapter.phases["serialize_s"] = serialized - copied
            request = LoadLoRAAdapterFromTensorsReqInput(
                lora_name=name,
                config_dict=config_dict(adapter),
                serialized_named_tensors=payloads,
                load_format=load_format,
            )
            call = engine.tokenizer_manager.load_lora_adapter_from_tensors(request, None)
            result = self._sgl(lambda: engine.loop.run_until_complete(call), "SGLang's load_lora_adapter_from_tensors")
            adapter.phases["scheduler_s"] = time.perf_counter() - serialized
            if not result.success:
                # Refused: no registered adapter of SGLang's views the buffer (a TP rank that loaded it where the
                # leader failed keeps an adapter no request can name).
                for buffer in taken:
                    buffers.give_back(buffer)
                raise GenEngineError(f"SGLang refused adapter {adapter.name!r}: {result.error_message}")
            for buffer in taken:  # any other error leaves the buffer out: SGLang may still read it
                buffers.hold(adapter.uid, buffer)

        self._on_leader("load_adapter", run)
        adapter.handle = name

    def _drop_adapter(self, adapter: Adapter) -> None:
        self._retire_adapter(adapter, self._unload_adapter)

    def _unload_adapter(self, adapter: Adapter) -> None:
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        name = sglang_name(adapter)

        def run() -> None:
            engine = self._engine
            call = engine.tokenizer_manager.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=name), None)
            result = self._sgl(lambda: engine.loop.run_until_complete(call), "SGLang's unload_lora_adapter")
            # Its buffer is reusable once SGLang dropped its host tensors (LoRAManager._unload_lora_adapter).
            self._shared_buffers.release(adapter.uid, reusable=result.success)
            if not result.success:
                raise GenEngineError(f"SGLang could not unload adapter {name!r}: {result.error_message}")

        self._on_leader("unload_adapter", run)
