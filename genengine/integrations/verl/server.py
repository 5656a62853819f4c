"""The server actor verl's client and load balancer call: genengine's Ray replica actor with verl's methods.

:class:`GenEngineServer` is :class:`genengine.ray.replica.EngineReplica` (the engine built by ``create_engine``
inside the actor, its transport endpoints, its load sessions) plus the methods verl's ``LLMServerClient``,
``RolloutReplica`` and server adapter call on a vLLM or SGLang server: ``generate`` (token in, ``TokenOutput``
out), ``wake_up``/``sleep`` by tags, the KV-cache calls, ``abort_all_requests``/``resume_generation`` and
``set_global_steps``. Generation runs on the engine's async layer (``genengine.engine.aio``): pauses, held requests
and weight-version labels are genengine's, not re-implemented here. Weights arrive through a transport group
the adapter forms (``transport_join``/``receive_weights``): one load session per sync, the prefix cache
flushed at its commit.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from genengine.errors import InvalidArgumentError
from genengine.integrations.verl.config import engine_settings
from genengine.ray.replica import EngineReplica

__all__ = ["SERVER_PREFIX", "GenEngineServer", "server_name", "to_sampling_params"]

SERVER_PREFIX = "genengine_server_"

_DROPPED = {"repetition_penalty": 1.0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
"""verl sampling keys genengine takes only at their neutral value (verl's agent loop always sends
``repetition_penalty=1.0``)."""


def server_name(replica_rank: int, node_rank: int = 0) -> str:
    """The Ray actor name of a replica's server (the adapter finds it by name, like verl's vLLM adapter)."""
    return f"{SERVER_PREFIX}{replica_rank}_{node_rank}"


def to_sampling_params(params: dict[str, Any], max_tokens: int, ignore_eos: bool) -> Any:
    """genengine ``SamplingParams`` for verl's sampling dict (vLLM spelling), or a clear error naming the key."""
    from genengine.protocol import SamplingParams

    kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "ignore_eos": ignore_eos}
    for key, value in params.items():
        if key in ("max_tokens", "max_new_tokens"):
            continue
        if key == "logprobs":
            kwargs["logprobs"] = bool(value) if value is not None else False  # vLLM's 0: the sampled token's
        elif key in _DROPPED:
            if value not in (None, _DROPPED[key]):
                raise InvalidArgumentError(
                    f"sampling parameter {key}={value!r} is not supported by genengine; allowed: {_DROPPED[key]}"
                )
        else:
            kwargs[key] = value  # SamplingParams names the unknown key and what is allowed
    if kwargs.get("n", 1) != 1:
        raise InvalidArgumentError(
            f"sampling parameter n={kwargs['n']!r}: verl sends one request per sample; allowed: 1"
        )
    return SamplingParams.coerce(kwargs)


def _mode(rollout_mode: Any) -> str:
    return str(getattr(rollout_mode, "value", rollout_mode))


class GenEngineServer(EngineReplica):
    """One replica's server: a genengine engine in a Ray actor, answering verl's server calls."""

    def __init__(
        self,
        config: Any,
        model_config: Any,
        rollout_mode: Any,
        workers: list[Any],
        replica_rank: int,
        node_rank: int = 0,
        gpus_per_node: int = 1,
        nnodes: int = 1,
        cuda_visible_devices: str | None = None,
    ) -> None:
        super().__init__(replica_rank)
        if cuda_visible_devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        self.settings = engine_settings(config, model_config)
        self.mode = _mode(rollout_mode)
        self.workers = workers
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.global_steps: int | None = None
        self.max_model_len = self.settings.max_model_len or _max_positions(model_config)
        self._rejecting = False
        self._ignore_eos = bool(getattr(config, "ignore_eos", False))

    # ---- start --------------------------------------------------------------------------------------------
    async def launch_server(self, **_: Any) -> None:
        """Build the engine (``EngineReplica.start``). verl's extra arguments (master address, ports) are for
        vLLM's data parallelism; genengine's engine leader does TP itself."""
        await self.start(self.incarnation, self.settings.engine)

    def get_server_address(self) -> tuple[str, str]:
        """A unique key for verl's load balancer: genengine serves no HTTP (token in, token out over Ray)."""
        import ray

        return ray.util.get_node_ip_address(), f"genengine-{self.replica_rank}"

    def get_master_address(self) -> tuple[None, None, None]:
        return None, None, None

    def get_rollout_config(self) -> Any:
        return self.settings

    # ---- generate -----------------------------------------------------------------------------------------
    def _max_tokens(self, prompt_len: int, params: dict[str, Any]) -> int:
        """verl's rule (its vLLM server's): ``max_tokens`` or ``max_new_tokens`` if given, else the response
        length capped by what is left of prompt_length + response_length; clamped to [1, room in the context]."""
        s = self.settings
        room = (self.max_model_len - prompt_len) if self.max_model_len else None
        if room is not None and room < 1:
            raise InvalidArgumentError(
                f"prompt length ({prompt_len}) leaves no room to generate within max_model_len "
                f"({self.max_model_len}); allowed: prompts shorter than max_model_len"
            )
        if "max_tokens" in params:
            wanted = params["max_tokens"]
        elif "max_new_tokens" in params:
            wanted = params["max_new_tokens"]
        else:
            wanted = min(s.response_length, s.prompt_length + s.response_length - prompt_len)
        if isinstance(wanted, bool) or not isinstance(wanted, int):
            raise InvalidArgumentError(f"max_tokens={wanted!r} must be an integer")
        return max(1, wanted if room is None else min(wanted, room))

    # verl's server names (generate, sleep, resume_generation) win on this actor: verl calls them with its own
    # arguments, and nothing calls them as EngineReplica's; the replica's own are reached as EngineReplica.x(self).
    async def generate(  # type: ignore[override]
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        priority: int = 0,
        **_: Any,
    ) -> Any:
        """Token in, ``TokenOutput`` out: the sampled tokens, their processed logprobs when asked for,
        ``stop_reason`` "completed" or "aborted", and in ``extra_fields`` the weight version (verl's
        ``global_steps``) that sampled them (``min_/max_global_steps`` when a sync landed mid-request)."""
        from verl.workers.rollout.replica import TokenOutput

        if video_data is not None or audio_data is not None:
            raise InvalidArgumentError("video_data and audio_data are not supported by genengine; allowed: None")
        if self._rejecting:
            return TokenOutput(token_ids=[], stop_reason="aborted", extra_fields={"global_steps": self.global_steps})
        prompt_ids = [int(t) for t in prompt_ids]
        params = dict(sampling_params)
        max_tokens = self._max_tokens(len(prompt_ids), params)
        sp = to_sampling_params(params, max_tokens, ignore_eos=bool(params.pop("ignore_eos", self._ignore_eos)))
        engine = self._async()
        result = await engine.generate_async(
            prompt_token_ids=prompt_ids, sampling_params=sp, image_data=image_data or None, request_id=request_id
        )
        out = result.outputs[0]
        extra: dict[str, Any] = {"num_cached_tokens": None}
        versions = [v for _, v in out.weight_versions]
        if self.global_steps is None and not self._synced:
            extra["global_steps"] = None
        else:
            extra["global_steps"] = versions[-1] if versions else self.global_steps
            if len(set(versions)) > 1:
                extra["min_global_steps"], extra["max_global_steps"] = versions[0], versions[-1]
        return TokenOutput(
            token_ids=list(out.token_ids),
            log_probs=list(out.logprobs) if sp.logprobs and out.logprobs is not None else None,
            stop_reason="aborted" if out.finish_reason == "abort" else "completed",
            extra_fields=extra,
        )

    _synced = False

    # ---- sleep / wake -------------------------------------------------------------------------------------
    def _kv_tags(self) -> list[str]:
        """verl's "kv_cache" is every tag but the weights (SGLang's "cuda_graph" too)."""
        return [t for t in self._engine().supported_tags if t != "weights"]

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if self.node_rank != 0 or self.mode == "standalone":
            return
        if self.mode == "colocated" or not tags:
            wanted = None
        else:
            wanted = []
            for tag in tags:
                wanted += self._kv_tags() if tag == "kv_cache" else [tag]
        await EngineReplica.wake(self, self.incarnation, wanted)

    async def sleep(self) -> None:  # type: ignore[override]
        if self.node_rank != 0 or self.mode == "standalone" or not self.settings.free_cache_engine:
            return
        level = 1 if self.mode == "colocated" else self.settings.sleep_level
        await EngineReplica.sleep(self, self.incarnation, level)

    async def clear_kv_cache(self) -> None:
        if not self._engine().state.released_tags:
            await self.flush_cache(self.incarnation)

    async def release_kv_cache(self) -> None:
        """Free the KV cache for a weight sync, weights in place (verl's vLLM: sleep, then wake the weights)."""
        if self.node_rank != 0 or self.mode == "colocated" or not self.settings.free_cache_engine:
            return
        await EngineReplica.sleep(self, self.incarnation, 1)
        await EngineReplica.wake(self, self.incarnation, ["weights"])

    async def resume_kv_cache(self) -> None:
        if self.node_rank != 0 or self.mode == "colocated" or not self.settings.free_cache_engine:
            return
        await EngineReplica.wake(self, self.incarnation, self._kv_tags())

    # ---- abort / resume -----------------------------------------------------------------------------------
    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """Pause generation with genengine's "abort" mode: requests in flight end now with their partial tokens
        (``stop_reason="aborted"``), new ones wait for ``resume_generation`` (or, with ``reject_request``,
        come back aborted at once)."""
        engine = self._async()
        self._rejecting = reject_request
        if engine.paused not in (None, "abort"):
            await engine.resume_generation()
        ids = await engine.abort()
        await engine.pause_generation("abort", clear_cache=reset_prefix_cache)  # what arrived meanwhile ends too
        return {"aborted_count": len(ids), "request_ids": ids}

    async def resume_generation(self, expect: str | None = None) -> None:  # type: ignore[override]
        """Go on after ``abort_all_requests`` (verl calls it without arguments; ``expect`` keeps
        ``EngineReplica``'s signature)."""
        self._rejecting = False
        await self._async().resume_generation()

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        aborted = await self._async().abort([request_id])
        return {"aborted": bool(aborted), "request_id": request_id}

    async def wait_for_requests_to_drain(self) -> None:
        engine = self._async()
        while engine.paused is None and engine.in_flight:
            await asyncio.sleep(0.01)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def start_profile(self, **_: Any) -> None:
        """Not supported by genengine yet (a no-op, as verl's servers are when profiling is off)."""

    async def stop_profile(self) -> None:
        """Not supported by genengine yet."""

    # ---- weights ------------------------------------------------------------------------------------------
    async def weight_version(self) -> tuple[str, int]:
        """This incarnation's id (the transport calls take it) and the engine's weight version."""
        return self.incarnation, self._async().weight_version

    async def receive_weights(self, check_finite: bool = False) -> Any:
        """Receive one sync from the adapter into the engine (one load session, the prefix cache flushed at its
        commit). Requests in flight that nobody paused are held (genengine's "keep" pause) and go on with the
        new weights: their outputs carry both versions (``weight_versions``)."""
        engine = self._async()
        held = engine.paused is None and engine.in_flight > 0
        if held:
            await engine.pause_generation("keep", clear_cache=True)
        try:
            reply = await self.transport_receive(self.incarnation, check_finite)
        finally:
            if held:
                await engine.resume_generation()
        self._synced = True
        return reply.value, reply.version


def _max_positions(model_config: Any) -> int | None:
    """The model's context length from verl's ``HFModelConfig.hf_config`` (or the model folder's config.json)."""
    hf_config = getattr(model_config, "hf_config", None)
    value = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(value, int):
        return value
    path = None
    for key in ("local_path", "path"):
        path = model_config.get(key) if hasattr(model_config, "get") else getattr(model_config, key, None)
        if path:
            break
    if isinstance(path, str) and os.path.isfile(os.path.join(path, "config.json")):
        import json

        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            value = json.load(fh).get("max_position_embeddings")
        return value if isinstance(value, int) else None
    return None
