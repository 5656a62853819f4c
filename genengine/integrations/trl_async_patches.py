"""What TRL's async trainer needs to run where its CUDA-only pieces cannot: its tree attention in plain torch,
and its MFU lookup skipped off CUDA.

``trl.experimental.async_grpo`` packs each micro-batch into a prefix trie and runs attention through
``flash_attn_varlen_func`` from the ``kernels-community/flash-attn3`` Hub kernel: CUDA only, and fetched from the
Hub on first use. On a CPU, or on a GPU machine that cannot reach the Hub, training would fail at its first
forward. :func:`use_torch_tree_attention` points TRL's kernel lookup at :func:`varlen_attention`, the same
variable-length causal attention (bottom-right aligned, as FlashAttention's) written with torch's
``scaled_dot_product_attention``, one trie segment at a time: exact, slower on long batches.

The trainer's ``__init__`` also asks ``torch.cuda.get_device_name`` for the device's peak FLOPs (for its MFU
metric), which fails on a CPU; :func:`allow_cpu_training` makes that lookup answer None (MFU not logged, as
TRL does for an unknown device) when the training device is not a CUDA device.
"""

from __future__ import annotations

import importlib.util
import logging
from types import SimpleNamespace
from typing import Any

__all__ = ["allow_cpu_training", "tree_attention_needs_torch", "use_torch_tree_attention", "varlen_attention"]

_log = logging.getLogger(__name__)


def varlen_attention(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    **unsupported: Any,
) -> Any:
    """``flash_attn_varlen_func``'s result for ``q`` ``(total_q, heads, dim)`` and ``k``/``v`` ``(total_k,
    kv_heads, dim)``: segment ``i`` is rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of ``q`` attending to rows
    ``cu_seqlens_k[i]:cu_seqlens_k[i+1]`` of ``k``/``v``; causal is aligned bottom-right (the queries are the
    last keys). Sliding windows and softcapping are refused (TRL's tree attention passes them only for models
    that use them)."""
    import torch
    import torch.nn.functional as F

    del max_seqlen_q, max_seqlen_k  # the segment bounds say it all
    if unsupported.get("softcap"):
        raise NotImplementedError("genengine's torch tree attention has no softcapping; allowed: softcap=None")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"genengine's torch tree attention has no sliding window; got {window_size}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads is not a multiple of {kv_heads} key/value heads")
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = q.new_empty(q.shape)
    for s in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[s], bounds_q[s + 1], bounds_k[s], bounds_k[s + 1]
        if q1 == q0:
            continue
        qs = q[q0:q1].transpose(0, 1)  # (heads, Lq, dim)
        ks = k[k0:k1].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        vs = v[k0:k1].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        mask = None
        if causal:
            lq, lk = q1 - q0, k1 - k0
            rows = torch.arange(lq, device=q.device).unsqueeze(1)
            cols = torch.arange(lk, device=q.device).unsqueeze(0)
            mask = cols <= rows + (lk - lq)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=softmax_scale)
        out[q0:q1] = o.transpose(0, 1)
    return out


def tree_attention_needs_torch() -> bool:
    """True where TRL's FA3 kernel cannot run: no CUDA device, or the ``kernels`` package is missing."""
    import torch

    return not torch.cuda.is_available() or importlib.util.find_spec("kernels") is None


def use_torch_tree_attention() -> None:
    """Make TRL's tree attention (``trl.experimental.async_grpo.packing``) call :func:`varlen_attention` in
    place of the FA3 Hub kernel, for every trainer in this process. Idempotent."""
    from trl.experimental.async_grpo import packing

    kernel = SimpleNamespace(flash_attn_varlen_func=varlen_attention)
    if getattr(packing._flash_attn, "__genengine__", False):
        return

    def torch_kernel() -> Any:
        return kernel

    torch_kernel.__genengine__ = True  # type: ignore[attr-defined]
    packing._flash_attn = torch_kernel  # type: ignore[assignment]
    _log.info("TRL's tree attention runs on genengine's torch varlen attention (no FA3 kernel here)")


def allow_cpu_training() -> None:
    """Let ``AsyncGRPOTrainer`` start on a CPU: its peak-FLOPs lookup (CUDA only) answers None off CUDA, so the
    MFU metrics are left out as for an unknown GPU. Idempotent; CUDA devices keep TRL's lookup."""
    from trl.experimental.async_grpo import async_grpo_trainer

    original = async_grpo_trainer.get_peak_flops_per_device
    if getattr(original, "__genengine__", False):
        return

    def peak_flops(accelerator: Any, dtype: str) -> float | None:
        if accelerator.device.type != "cuda":
            return None
        return original(accelerator, dtype)  # type: ignore[no-any-return]

    peak_flops.__genengine__ = True  # type: ignore[attr-defined]
    async_grpo_trainer.get_peak_flops_per_device = peak_flops  # type: ignore[assignment]
