"""LightRFT's face (``lightrft.strategy.sglang_utils``) on :class:`~genengine_sglang.engine.SGLangEngine`.

``get_sglang_engine``, ``get_sglang_engine_for_rollout`` and ``RLGenerationEngine`` keep the reference's
names, signatures, defaults and errors, so a LightRFT trainer switches by changing its import; its memory
saver is :mod:`genengine_sglang.sgl_model_saver`. ``RLGenerationEngine`` is the protocol engine plus the
reference's calls (its constructor, ``generate(prompt=..., input_ids=...)``, ``sleep``/``wake_up(release_weights=...)``,
``update_weights_from_tensor``), each marked ``# LEGACY`` (``typing.overload`` keeps the protocol's signature
first). Both faces go through the same state machine and the same weight checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

from genengine.backend import EngineConfig
from genengine.distributed import EngineGroup, check_tp_group_ranks, topology_from_env
from genengine.errors import ConfigError, DistributedSetupError, InconsistentInputsError, InvalidArgumentError
from genengine.integrations.lightrft import check_reference_args
from genengine_sglang._group import collective_timeout, torch_dist
from genengine_sglang._weightsync import LoadCall
from genengine_sglang.engine import SGLangEngine
from genengine_sglang.settings import (
    OUR_OPTIONS,
    SGLangSettings,
    check_model_dir,
    options_from_env,
    passthrough_options,
    resolve_settings,
)

if TYPE_CHECKING:
    import torch

    from genengine.backend import GenerationResult

__all__ = ["RLGenerationEngine", "get_sglang_engine", "get_sglang_engine_for_rollout"]


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()
# Per-prompt arguments of the reference's generate that gather_inputs concatenates across ranks when lists.
_PER_PROMPT = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "lora_path")


# ---- the reference's entry point ---------------------------------------------------------------------------
def get_sglang_engine(
    model_name_or_path: str,
    engine_mem_util: float,
    enable_engine_sleep: bool = True,
    tp_size: int = 1,
    skip_tokenizer_init: bool = False,
    dtype: str = "bfloat16",
    disable_cuda_graph: bool = False,
) -> RLGenerationEngine:
    """Initialize and configure a SGLang generation engine with distributed processing support.

    The world of the initialised ``torch.distributed`` default group is split into tensor-parallel groups
    of ``tp_size`` contiguous ranks; the first rank of each group starts an engine on the group's GPUs
    (``base_gpu_id`` = its local rank, port ``40000 + local_rank``), the others hold none and receive its
    outputs. Collective: every rank must call it.

    Args:
        model_name_or_path: Path to the model (a directory with ``config.json``), or the id of a Hugging Face
            model already in the local cache.
        engine_mem_util: Memory utilization fraction for the engine, in (0, 1] (SGLang's
            ``mem_fraction_static``).
        enable_engine_sleep: Whether to enable memory saver mode, so that ``sleep`` releases GPU memory
            (also drops ``expandable_segments`` from the engine processes' ``PYTORCH_CUDA_ALLOC_CONF``).
        tp_size: Tensor parallelism size for distributed inference.
        skip_tokenizer_init: Whether to skip tokenizer initialization; text and image prompts need the
            tokenizer (required for VLM use cases).
        dtype: Data type for model weights and computations ("bfloat16" or "float16").
        disable_cuda_graph: Whether to disable CUDA graph optimization.

    Engine options that this fixed signature cannot carry (e.g. ``attention_backend`` on machines without
    FlashAttention 3) come from ``$GENENGINE_SGLANG_OPTIONS``, a JSON object.

    Returns:
        The ``RLGenerationEngine`` of this rank's tensor-parallel group.

    Raises:
        AssertionError: If PyTorch distributed is not initialized (``DistributedSetupError``).
        AssertionError: If world size is not evenly divisible by tensor parallelism size.
        ValueError: For any other bad argument (``InvalidArgumentError``/``ConfigError``), before any
            process or GPU memory is taken.
    """
    check_reference_args(
        engine_mem_util=engine_mem_util,
        enable_engine_sleep=enable_engine_sleep,
        tp_size=tp_size,
        skip_tokenizer_init=skip_tokenizer_init,
        dtype=dtype,
        disable_cuda_graph=disable_cuda_graph,
    )
    model_dir = check_model_dir(model_name_or_path, what="model_name_or_path")
    options = {
        **options_from_env(),
        "skip_tokenizer_init": skip_tokenizer_init,
        "disable_cuda_graph": disable_cuda_graph,
    }
    config = EngineConfig(
        backend="sglang",
        model=model_dir,
        tp_size=tp_size,
        mem_util=float(engine_mem_util),
        dtype=dtype,
        enable_sleep=enable_engine_sleep,
        options=options,
    )
    settings = resolve_settings(config, environ={})
    return RLGenerationEngine(settings, require_distributed=True)


def get_sglang_engine_for_rollout(args: Any) -> RLGenerationEngine:
    """The reference's wrapper: ``get_sglang_engine`` from a trainer's argument namespace (``pretrain``,
    ``engine_mem_util``, ``enable_engine_sleep``, ``engine_tp_size``, ``bf16``)."""
    missing = [
        k
        for k in ("pretrain", "engine_mem_util", "enable_engine_sleep", "engine_tp_size", "bf16")
        if not hasattr(args, k)
    ]
    if missing:
        raise InvalidArgumentError(f"args lacks {', '.join(missing)} (the reference's rollout arguments)")
    return get_sglang_engine(
        args.pretrain,
        args.engine_mem_util,
        enable_engine_sleep=args.enable_engine_sleep,
        tp_size=args.engine_tp_size,
        dtype="bfloat16" if args.bf16 else "float16",
    )


# ---- the reference's constructor ---------------------------------------------------------------------------
def _reference_construction(
    tp_group_cpu: Any = None, num_gpu_per_node: int = 8, **kwargs: Any
) -> tuple[SGLangSettings, EngineGroup | None]:
    """``RLGenerationEngine(tp_group_cpu, num_gpu_per_node, **kwargs)`` as ``SGLangEngine``'s arguments;
    without ``tp_group_cpu`` the group is left to ``SGLangEngine`` (this rank alone). The group's layout is
    checked first, so that a wrong one is refused on every rank before anything else is resolved."""
    if tp_group_cpu is None:
        return _settings_from_engine_kwargs(kwargs, None), None
    ranks = _check_tp_group_cpu(tp_group_cpu, num_gpu_per_node)
    settings = _settings_from_engine_kwargs(kwargs, len(ranks))
    topo = topology_from_env(len(ranks), base_port=settings.base_port)
    return settings, EngineGroup(topo, tp_group_cpu, tp_group_cpu, "gloo", collective_timeout(settings))


def _check_tp_group_cpu(pg: Any, num_gpu_per_node: Any) -> tuple[int, ...]:
    """The ranks of the reference's ``tp_group_cpu`` once it is this rank's TP group of contiguous ranks (a
    gloo group on one node); else ``DistributedSetupError`` (an ``AssertionError``, as the reference's layout
    errors, raised explicitly so ``python -O`` keeps it). A wrong group (``[0, 2]`` in a world of 4) is seen
    alike by each of its members, and a rank that ``new_group`` left out gets a placeholder: every rank raises."""
    if isinstance(num_gpu_per_node, bool) or not isinstance(num_gpu_per_node, int) or num_gpu_per_node < 1:
        raise InvalidArgumentError(f"num_gpu_per_node={num_gpu_per_node!r} must be an integer >= 1")
    dist = torch_dist()
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedSetupError("tp_group_cpu was given but torch.distributed is not initialised")
    if not isinstance(pg, dist.ProcessGroup):
        if isinstance(pg, int) and pg == dist.GroupMember.NON_GROUP_MEMBER:
            raise DistributedSetupError(
                f"rank {dist.get_rank()} is not a member of tp_group_cpu (torch.distributed.new_group gives the "
                "ranks it does not list a placeholder): each rank must pass the TP group of contiguous ranks it "
                "belongs to, as torch.distributed.new_subgroups_by_enumeration returns it"
            )
        raise InvalidArgumentError(
            f"tp_group_cpu={pg!r} must be a torch.distributed ProcessGroup (this rank's TP group, gloo) or None"
        )
    ranks = tuple(int(r) for r in dist.get_process_group_ranks(pg))
    if len(ranks) > num_gpu_per_node:
        raise DistributedSetupError(
            f"a TP group of {len(ranks)} ranks spans more than num_gpu_per_node={num_gpu_per_node} GPUs: "
            "engines spanning nodes are not supported"
        )
    backend = str(dist.get_backend(pg))
    if backend != "gloo":
        raise DistributedSetupError(f"tp_group_cpu must be a gloo group (it carries pickled objects), got {backend!r}")
    check_tp_group_ranks(ranks, topology_from_env(len(ranks)), what="tp_group_cpu")
    return ranks


def _settings_from_engine_kwargs(kwargs: dict[str, Any], tp_size: int | None) -> SGLangSettings:
    """The reference constructor's ``sglang.Engine`` keyword arguments as settings."""
    kw = dict(kwargs)
    if "model_path" not in kw:
        raise InvalidArgumentError("RLGenerationEngine needs model_path=... (the sglang.Engine argument)")
    given_tp = kw.pop("tp_size", None)
    if tp_size is not None and given_tp is not None and given_tp != tp_size:
        raise DistributedSetupError(f"tp_size={given_tp} disagrees with the size {tp_size} of tp_group_cpu")
    step = kw.pop("gpu_id_step", 1)
    if step != 1:
        raise ConfigError(f"gpu_id_step={step!r}: only 1 is supported (a TP group uses contiguous GPUs)")
    dtype = kw.pop("dtype", "auto")
    dtype = {"half": "float16", "float": "float32"}.get(dtype, dtype)
    options: dict[str, Any] = {}
    server_args: dict[str, Any] = {}
    passthrough = passthrough_options()
    for key in list(kw):
        if key in ("model_path", "mem_fraction_static", "enable_memory_saver", "random_seed"):
            continue
        value = kw.pop(key)
        if key in OUR_OPTIONS or key in passthrough:
            options[key] = value
        else:
            server_args[key] = value
    if server_args:
        options["server_args"] = {**server_args, **options.get("server_args", {})}
    mem: Any = kw.get("mem_fraction_static")
    seed: Any = kw.get("random_seed")
    config = EngineConfig(
        backend="sglang",
        model=kw["model_path"],
        tp_size=tp_size or given_tp or 1,
        mem_util=0.8 if mem is None else mem,
        dtype=dtype,
        enable_sleep=bool(kw.get("enable_memory_saver", False)),
        seed=0 if seed is None else seed,
        options=options,
    )
    return resolve_settings(config)


# ---- the engine --------------------------------------------------------------------------------------------
class RLGenerationEngine(SGLangEngine):
    """``SGLangEngine`` with LightRFT's calls too (see the module docstring)."""

    @overload
    def __init__(
        self, settings: SGLangSettings, group: EngineGroup | None = None, *, require_distributed: bool = False
    ) -> None: ...

    @overload  # LEGACY: LightRFT's constructor, sglang.Engine's keyword arguments
    def __init__(self, tp_group_cpu: Any = None, num_gpu_per_node: int = 8, **kwargs: Any) -> None: ...

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``SGLangEngine``'s arguments, or the reference's: the TP group's gloo group and ``sglang.Engine``
        keyword arguments.

        The reference's ``kwargs`` are ``sglang.Engine``'s (``model_path``, ``mem_fraction_static``,
        ``enable_memory_saver``, ``base_gpu_id``, ``port``, ...) plus genengine's options
        (``weight_sync_mode``, ...). Without ``tp_group_cpu`` the engine serves this rank alone. Prefer
        ``get_sglang_engine`` or ``genengine.create_engine(backend="sglang", ...)``.
        """
        if (args and isinstance(args[0], SGLangSettings)) or "settings" in kwargs:
            super().__init__(*args, **kwargs)
        else:
            super().__init__(*_reference_construction(*args, **kwargs))

    @overload
    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: Any = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        image_data: Sequence[Any] | None = None,
    ) -> list[GenerationResult]: ...

    @overload  # LEGACY: LightRFT's generate, SGLang's arguments in and SGLang's output dicts out
    def generate(
        self,
        *,
        sampling_params: Any = None,
        image_data: Any = None,
        prompt: Any = None,
        input_ids: Any = None,
        return_logprob: Any = None,
        logprob_start_len: Any = None,
        top_logprobs_num: Any = None,
        lora_path: Any = None,
        custom_logit_processor: Any = None,
        gather_inputs: bool = False,
    ) -> Any: ...

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: Any = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        image_data: Any = None,
        prompt: Any = _UNSET,
        input_ids: Any = _UNSET,
        return_logprob: Any = _UNSET,
        logprob_start_len: Any = _UNSET,
        top_logprobs_num: Any = _UNSET,
        lora_path: Any = _UNSET,
        custom_logit_processor: Any = _UNSET,
        gather_inputs: Any = _UNSET,
    ) -> Any:
        """Protocol: ``generate(prompts, sampling_params, *, prompt_token_ids, image_data) -> list[GenerationResult]``.

        Reference (when any of ``prompt``, ``input_ids``, ``return_logprob``, ``logprob_start_len``,
        ``top_logprobs_num``, ``lora_path``, ``custom_logit_processor``, ``gather_inputs`` is passed):
        SGLang's arguments, SGLang's output dicts (a dict for a single prompt, a list otherwise). With
        ``gather_inputs=True`` every rank's prompts are generated together and each rank gets its own back.
        """
        given = {
            "prompt": prompt,
            "input_ids": input_ids,
            "return_logprob": return_logprob,
            "logprob_start_len": logprob_start_len,
            "top_logprobs_num": top_logprobs_num,
            "lora_path": lora_path,
            "custom_logit_processor": custom_logit_processor,
            "gather_inputs": gather_inputs,
        }
        reference = {k: v for k, v in given.items() if v is not _UNSET}
        if reference:
            if prompts is not None or prompt_token_ids is not None:
                raise InvalidArgumentError(
                    "mixed call: prompts/prompt_token_ids are the protocol's arguments, "
                    f"{', '.join(reference)} the reference's; use prompt=/input_ids= with the latter"
                )
            return self._generate_reference(sampling_params, image_data, **reference)
        return super().generate(prompts, sampling_params, prompt_token_ids=prompt_token_ids, image_data=image_data)

    @overload
    def sleep(self, level: int = 1) -> None: ...

    @overload  # LEGACY: LightRFT's sleep(release_weights=...)
    def sleep(self, *, release_weights: bool) -> None: ...

    def sleep(self, level: int = 1, *, release_weights: Any = _UNSET) -> None:
        """Protocol: ``sleep(level)``. Reference: ``sleep(release_weights=False)`` is level 1 (KV cache and CUDA
        graphs released, weights kept), ``sleep(release_weights=True)`` level 2 (weights released too; send
        them again after ``wake_up``)."""
        if release_weights is not _UNSET:
            if not isinstance(release_weights, bool):
                raise InvalidArgumentError(f"release_weights={release_weights!r} must be True or False")
            level = 2 if release_weights else 1
        super().sleep(level)

    # LEGACY: LightRFT's wake_up
    def wake_up(self, release_weights: bool = False) -> None:
        """Reference: take every released memory back (``release_weights`` is accepted for compatibility:
        whatever ``sleep`` released comes back)."""
        if not isinstance(release_weights, bool):
            raise InvalidArgumentError(f"release_weights={release_weights!r} must be True or False")
        self.wake()

    def _generate_reference(self, sampling_params: Any, image_data: Any, **kwargs: Any) -> Any:
        """The reference's generate: SGLang's arguments in, SGLang's output dicts out, every rank the same."""
        self._check_open()
        self._check_can_generate()
        gather = kwargs.pop("gather_inputs", False)
        if not isinstance(gather, bool):
            raise InvalidArgumentError(f"gather_inputs={gather!r} must be True or False")
        prompt, input_ids = kwargs.get("prompt"), kwargs.get("input_ids")
        if (prompt is None) == (input_ids is None):
            raise InvalidArgumentError("give prompt (text) or input_ids (token ids), exactly one of them")
        if prompt is not None and self._settings.skip_tokenizer_init:
            raise InvalidArgumentError(
                "prompt (text) needs the tokenizer, but the engine was created with skip_tokenizer_init=True"
            )
        args = {k: v for k, v in {"sampling_params": sampling_params, "image_data": image_data, **kwargs}.items()}
        args = {k: v for k, v in args.items() if v is not None}
        if not gather or self._group.topology.tp_size == 1:
            return self._on_leader("generate", lambda: self._reference_call(args))

        key = "prompt" if prompt is not None else "input_ids"
        single = isinstance(prompt, str) or (input_ids is not None and _flat_ids(input_ids))
        local: dict[str, list[Any]] = {key: [args[key]] if single else list(args[key])}
        for name in ("image_data", "custom_logit_processor", *_PER_PROMPT):
            value = args.get(name)
            if name == "image_data" and value is not None:
                local[name] = [value] if single else list(value)
            elif isinstance(value, list) and name != "image_data":
                local[name] = value
        shared = {k: v for k, v in args.items() if k not in local}
        gathered = self._group.gather_object(local)
        ranks = self._group.topology.tp_group_ranks

        def run() -> tuple[Any, list[int]]:
            assert gathered is not None
            for rank, part in zip(ranks, gathered, strict=True):
                if sorted(part) != sorted(local):
                    raise InconsistentInputsError(
                        f"with gather_inputs, every rank must pass the same kinds of arguments: rank {rank} passed "
                        f"{sorted(part)}, the leader {sorted(local)}"
                    )
            merged = {k: [x for part in gathered for x in part[k]] for k in local}
            return self._reference_call({**merged, **shared}), [len(part[key]) for part in gathered]

        out, counts = self._on_leader("generate", run)
        params = sampling_params[0] if isinstance(sampling_params, list) and sampling_params else sampling_params
        n = int(params.get("n", 1)) if isinstance(params, Mapping) else 1
        index = self._group.topology.tp_rank
        start = sum(counts[:index]) * n
        mine = out[start : start + counts[index] * n]
        return mine[0] if single and n == 1 else mine

    def _reference_call(self, args: dict[str, Any]) -> Any:
        """On the leader: ``sglang.Engine.generate(**args)``, run with SGLang's loop to itself (async requests
        may be running it). After a weight load that could not flush the prefix cache the request is built as
        that method builds it (``prompt`` is its ``text``), with the cache namespace of new requests."""
        self._check_sync_generate()
        key = self._cache_key()
        if key is None:
            return self._sgl(lambda: self._engine.generate(**args))
        from sglang.srt.managers.io_struct import GenerateReqInput

        fields = dict(args)
        obj = GenerateReqInput(text=fields.pop("prompt", None), extra_key=key, **fields)
        tm, loop = self._engine.tokenizer_manager, self._engine.loop
        return self._sgl(lambda: loop.run_until_complete(tm.generate_request(obj, None).__anext__()))

    # LEGACY: LightRFT's way to send weights, one tensor per call
    def update_weights_from_tensor(
        self, name: str, tensor: torch.Tensor, flush_cache: bool = False, load_format: str | None = None
    ) -> None:
        """Reference: one weight, checked by name and shape like ``load_weights``, in one SGLang call (as
        LightRFT sends them); the prefix cache is flushed only with ``flush_cache=True``."""
        if not isinstance(flush_cache, bool):
            raise InvalidArgumentError(f"flush_cache={flush_cache!r} must be True or False")
        if load_format is not None and not isinstance(load_format, str):
            raise InvalidArgumentError(f"load_format={load_format!r} must be None or a string")
        self._load([(name, tensor)], None, LoadCall("per_param", load_format, flush_cache))


def _flat_ids(value: Any) -> bool:
    """A single prompt's token ids (``[1, 2, 3]``) rather than a batch (``[[1, 2], [3]]``)."""
    return isinstance(value, Sequence) and bool(value) and all(isinstance(t, int) for t in value)
