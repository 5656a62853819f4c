"""The reference-style entry point: ``get_vllm_engine``, with the arguments of LightRFT's ``get_sglang_engine``.

Kept apart from :mod:`genengine_vllm.engine` so that the protocol class stays ``VLLMEngine(settings,
topology)`` + ``from_config``; this module only turns the reference's arguments into an ``EngineConfig``.
"""

from __future__ import annotations

from typing import Any

from genengine.backend import EngineConfig
from genengine.engine.checkpoint import resolve_model_dir
from genengine.errors import InvalidArgumentError
from genengine.integrations.lightrft import check_reference_args
from genengine_vllm.engine import VLLMEngine

__all__ = ["get_vllm_engine"]


def get_vllm_engine(
    model_name_or_path: str,
    engine_mem_util: float,
    enable_engine_sleep: bool = True,
    tp_size: int = 1,
    skip_tokenizer_init: bool = False,
    dtype: str = "bfloat16",
    disable_cuda_graph: bool = False,
    **vllm_options: Any,
) -> VLLMEngine:
    """The reference's ``get_sglang_engine`` arguments, for vLLM; extra keywords go to ``vllm.LLM``.

    Collective: every rank of the trainer's initialised ``torch.distributed`` world calls it; each rank
    holds one rank of its TP group's engine (contiguous ranks, external_launcher). ``disable_cuda_graph``
    maps to vLLM's ``enforce_eager``; ``seed`` (default 0) is the base seed of the TP groups.

    Raises:
        AssertionError: ``torch.distributed`` is not initialised, or its world size is not divisible by
            ``tp_size`` (``DistributedSetupError``, raised explicitly so ``python -O`` keeps it), as in the
            reference. ``genengine.create_engine(backend="vllm")`` also runs ``tp_size=1`` without it.
        ValueError: any other bad argument (``InvalidArgumentError``; ``ConfigError`` for ``vllm_options``),
            before vLLM starts or any GPU memory is taken.
        EngineStateError: another sleep-mode vLLM engine lives in this process (vLLM allows one).
    """
    check_reference_args(
        engine_mem_util=engine_mem_util,
        enable_engine_sleep=enable_engine_sleep,
        tp_size=tp_size,
        skip_tokenizer_init=skip_tokenizer_init,
        dtype=dtype,
        disable_cuda_graph=disable_cuda_graph,
    )
    model_dir = resolve_model_dir(model_name_or_path, what="model_name_or_path", error=InvalidArgumentError)
    seed = vllm_options.pop("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidArgumentError(f"seed={seed!r} must be an integer")
    config = EngineConfig(
        backend="vllm",
        model=model_dir,
        tp_size=tp_size,
        mem_util=float(engine_mem_util),
        dtype=dtype,
        enable_sleep=enable_engine_sleep,
        seed=seed,
        options={"skip_tokenizer_init": skip_tokenizer_init, "disable_cuda_graph": disable_cuda_graph, **vllm_options},
    )
    return VLLMEngine._create(config, require_distributed=True)
