"""vLLM's worker side of an adapter loaded from memory: run by ``LLM.collective_rpc`` on this process's worker
(the engine core runs in-process, so the tensors are passed by reference, never serialized).

vLLM 0.24-0.26 load a ``LoRARequest`` only from a folder: ``WorkerLoRAManager._load_adapter`` (lora/worker_manager.py)
reads ``adapter_config.json`` and ``adapter_model.safetensors`` into a ``LoRAModel`` on the CPU
(``LoRAModel.from_local_checkpoint(device="cpu")``), then ``LoRAModelManager._create_merged_loras_inplace``
(lora/model_manager.py) packs q/k/v and gate/up, folds the scale into ``lora_B`` and pins every tensor
(``pin_memory``, one page-locked allocation per tensor), and ``activate_adapter`` copies them into the GPU slots.
Here the ``LoRAModel`` is built by vLLM's own ``LoRAModel.from_lora_tensors`` from one copy of the adapter made on
the worker's GPU (two ``torch.cat``: the snapshot a load promises, since the trainer keeps changing its tensors),
the scale already folded into ``lora_B`` (one multiply, the one ``LoRALayerWeights.optimize`` would do per
module), so nothing goes through the host and nothing is pinned. It is registered by vLLM's own ``add_lora``:
the worker's manager gets a ``_load_adapter`` that answers our adapter ids with the model staged here (any other
request still loads from its folder), which also covers vLLM reloading an adapter it evicted from its cache
(``max_cpu_loras``): the staged model is handed back as it is (packing and scale folding are idempotent on it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["drop_lora", "lora_manager", "refresh_mapping", "stage_lora"]

_STORE = "_genengine_memory_loras"


def _worker_manager(wrapper: Any) -> Any:
    """The worker's ``LRUCacheWorkerLoRAManager`` (``GPUModelRunner.lora_manager``), or None without LoRA."""
    worker = getattr(wrapper, "worker", wrapper)
    return getattr(worker.model_runner, "lora_manager", None)


def lora_manager(wrapper: Any) -> Any:
    """The worker's ``LRUCacheWorkerLoRAManager`` (``GPUModelRunner.lora_manager``), with our loader installed."""
    manager = _worker_manager(wrapper)
    if manager is None:
        raise RuntimeError("vLLM was started without LoRA (enable_lora=True)")
    if _STORE not in manager.__dict__:
        store: dict[int, Any] = {}
        original = manager._load_adapter

        def load_adapter(request: Any) -> Any:
            staged = store.get(request.lora_int_id)
            return original(request) if staged is None else staged

        manager._load_adapter = load_adapter
        manager.__dict__[_STORE] = store
    return manager


def _expected_modules(manager: Any) -> set[str]:
    """What ``WorkerLoRAManager._load_adapter`` accepts: the supported modules, packed ones as their parts."""
    adapter_manager = manager._adapter_manager
    packed = adapter_manager.packed_modules_mapping
    expected: set[str] = set()
    for module in adapter_manager.supported_lora_modules:
        expected.update(packed.get(module, [module]))
        if module == "experts":
            expected.add(module)
    return expected


def stage_lora(
    wrapper: Any, uid: int, pairs: Mapping[str, tuple[Any, Any]], r: int, scaling: float, targets: Any
) -> dict[str, float]:
    """Build adapter ``uid``'s ``LoRAModel`` on the worker's GPU and keep it for ``add_lora``; the seconds of each
    step. Refuses (``ValueError``, as vLLM's folder loader would) before anything is kept."""
    import time

    import torch
    from vllm.lora.peft_helper import PEFTHelper

    start = time.perf_counter()
    manager = lora_manager(wrapper)
    expected = _expected_modules(manager)
    unexpected = sorted(m for m in pairs if m.rpartition(".")[2] not in expected)
    if unexpected:
        raise ValueError(f"expected target modules in {sorted(expected)} but received {unexpected}")
    # lora_alpha == r: scaling 1 in vLLM's eyes, since lora_B below already carries it.
    helper = PEFTHelper.from_dict(
        {
            "r": r,
            "lora_alpha": r,
            "target_modules": targets,
            "bias": "none",
            "vllm_max_position_embeddings": manager.max_position_embeddings,
        }
    )
    helper.validate_legal(manager.lora_config)
    device, dtype = manager.device, manager.lora_config.lora_dtype
    modules = list(pairs)
    a_list = [pairs[m][0] for m in modules]
    b_list = [pairs[m][1] for m in modules]
    # One copy of each half on the GPU, in vLLM's LoRA dtype (no copy of the caller's tensors is kept, so a
    # trainer may change them as soon as this returns); then lora_B *= scaling, as vLLM's optimize() does.
    flat_a = torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for t in a_list])
    flat_b = torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for t in b_list])
    if scaling != 1:
        flat_b.mul_(scaling)
    tensors: dict[str, Any] = {}
    for module, a, view in zip(modules, a_list, flat_a.split([t.numel() for t in a_list]), strict=True):
        tensors[f"base_model.model.{module}.lora_A.weight"] = view.view(a.shape)
    for module, b, view in zip(modules, b_list, flat_b.split([t.numel() for t in b_list]), strict=True):
        tensors[f"base_model.model.{module}.lora_B.weight"] = view.view(b.shape)
    copied = time.perf_counter()
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(mapper, "get_unstacked_mapper"):  # compat.BRANCHES: 0.25.0 on
        mapper = mapper.get_unstacked_mapper()
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=uid,
        tensors=tensors,
        peft_helper=helper,
        device=device,
        dtype=dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    manager.__dict__[_STORE][uid] = lora
    return {"copy_s": copied - start, "build_s": time.perf_counter() - copied}


def drop_lora(wrapper: Any, uid: int) -> None:
    """Forget adapter ``uid``'s staged model (vLLM has removed it, or refused it)."""
    manager = _worker_manager(wrapper)
    if manager is not None:
        manager.__dict__.get(_STORE, {}).pop(uid, None)


def refresh_mapping(wrapper: Any) -> bool:
    """After ``add_lora``/``remove_lora`` (any adapter sync): the next step rebuilds the slot metadata where the
    vLLM release would keep a stale one (``compat.refresh_lora_mapping``). True when it had to."""
    from genengine_vllm.compat import refresh_lora_mapping

    manager = _worker_manager(wrapper)
    return manager is not None and refresh_lora_mapping(manager._adapter_manager)
