"""verl 0.9.1's own code drives ``rollout.name=genengine`` on the embedded backend in a local Ray cluster.

verl's config is composed from its own ``ppo_trainer.yaml`` (as ``main_ppo`` does), its ``LLMServerManager``
launches the plugin's replica in the hybrid mode next to a trainer-worker stand-in (tests/support/verl_trainer.py,
which builds the server adapter through verl's ``get_rollout_class``), and requests go through verl's
``LLMServerClient``/``FullyAsyncLLMServerClient`` and its global load balancer, and through its agent loop manager.
"""

from __future__ import annotations

import asyncio
import os
import types
from typing import Any

import pytest

pytest.importorskip("ray")

from support.installed import installed

if not installed("verl.workers.rollout.llm_server"):  # not imported here: collection would import all of verl
    pytest.skip("verl 0.9.1 is not installed (make setup installs it)", allow_module_level=True)

from genengine import SamplingParams, create_engine
from genengine.errors import GenEngineError
from genengine.testing.conformance import load_checkpoint
from genengine.testing.tiny_model import tiny_model_dir

PROMPT = [11, 22, 33, 44, 55, 66]
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def verl_config(model_dir: str, *overrides: str) -> Any:
    """verl's trainer config, composed from its own YAML as ``main_ppo`` composes it."""
    import verl
    from hydra import compose, initialize_config_dir

    folder = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=folder, version_base=None):
        return compose(
            "ppo_trainer",
            overrides=[
                "actor_rollout_ref.rollout.name=genengine",
                f"actor_rollout_ref.model.path={model_dir}",
                "+actor_rollout_ref.rollout.engine_kwargs.genengine.backend=transformers",
                "actor_rollout_ref.rollout.dtype=float32",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                "actor_rollout_ref.rollout.n_gpus_per_node=1",
                "actor_rollout_ref.rollout.prompt_length=16",
                "actor_rollout_ref.rollout.response_length=8",
                "actor_rollout_ref.rollout.calculate_log_probs=True",
                "actor_rollout_ref.rollout.agent.num_workers=1",
                *overrides,
            ],
        )


def reference(model_dir: str, weights: str | None, prompt: list[int], max_new_tokens: int) -> tuple[list[int], Any]:
    """Greedy tokens and logprobs of the same engine in this process (with ``weights`` loaded, if given)."""
    with create_engine(backend="transformers", model=model_dir, dtype="float32") as engine:
        if weights is not None:
            engine.load_weights(load_checkpoint(weights).items())
        sp = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, logprobs=True, ignore_eos=True)
        out = engine.generate(prompt_token_ids=[prompt], sampling_params=sp)[0].outputs[0]
        return list(out.token_ids), list(out.logprobs or [])


class Rollout:
    """verl's LLMServerManager over the plugin, next to the trainer-worker stand-in."""

    def __init__(self, ray: Any, config: Any) -> None:
        from support.verl_trainer import VerlTrainerStandIn
        from verl.workers.rollout.llm_server import LLMServerManager

        import genengine.integrations.verl.plugin  # noqa: F401  (the entry point; this checkout's, not the venv's)

        self.ray = ray
        self.config = config
        trainer_cls = ray.remote(num_cpus=0)(VerlTrainerStandIn)
        self.trainer = trainer_cls.remote(config.actor_rollout_ref.rollout, config.actor_rollout_ref.model)
        group = types.SimpleNamespace(workers=[self.trainer], world_size=1)
        self.manager = LLMServerManager.create(config, worker_group=group)
        self.replica = self.manager.get_replicas()[0]
        self.server = self.replica.server_handle

    def client(self, fully_async: bool = False) -> Any:
        from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient

        return self.manager.get_client(FullyAsyncLLMServerClient if fully_async else LLMServerClient)

    async def running(self) -> None:
        """Until the server's engine runs a request, and a little more (so that it has tokens)."""
        while not await self.server.in_flight.remote():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)

    def state(self) -> Any:
        return self.ray.get(self.server.info.remote(), timeout=60)["state"]

    def sync(self, checkpoint: str, global_steps: int | None, kind: str = "sync") -> Any:
        """verl's naive sync: sleep the replica, then the worker's resume(weights), update, resume(kv_cache)."""
        asyncio.run(self.replica.sleep())
        self.ray.get(self.trainer.resume.remote(["weights"]), timeout=120)
        report = self.ray.get(self.trainer.update_weights.remote(checkpoint, global_steps, kind), timeout=120)
        self.ray.get(self.trainer.resume.remote(["kv_cache"]), timeout=120)
        return report

    def close(self) -> None:
        ray = self.ray
        for actor in (self.server, self.trainer, self.manager.global_load_balancer):
            ray.kill(actor)


@pytest.fixture(scope="module")
def rollout(cluster: Any, model: str) -> Any:
    r = Rollout(cluster, verl_config(model))
    yield r
    r.close()


def generate(client: Any, prompt: list[int], params: dict[str, Any], request_id: str = "r") -> Any:
    return asyncio.run(client.generate(request_id, prompt_ids=prompt, sampling_params=dict(params)))


def test_verl_client_generates_token_outputs_with_processed_logprobs(rollout: Any, model: str) -> None:
    """verl's LLMServerClient through its load balancer: the engine's greedy tokens and processed logprobs, stop
    reason "completed", and no weight version before the first sync (as verl's servers report None)."""
    assert rollout.ray.get(rollout.trainer.rollout_class.remote()) == "GenEngineServerAdapter"
    want, logprobs = reference(model, None, PROMPT, 5)
    out = generate(rollout.client(), PROMPT, {**GREEDY, "max_tokens": 5, "ignore_eos": True})
    assert type(out).__name__ == "TokenOutput"
    assert out.token_ids == want
    assert out.log_probs == pytest.approx(logprobs, abs=1e-4)
    assert out.stop_reason == "completed"
    assert out.extra_fields["global_steps"] is None
    no_logprobs = generate(rollout.client(), PROMPT, {**GREEDY, "logprobs": False, "max_tokens": 3})
    assert no_logprobs.log_probs is None


def test_max_tokens_follows_verls_rule_when_absent(rollout: Any) -> None:
    """No max_tokens: min(response_length, prompt_length + response_length - len(prompt)) (verl's vLLM server)."""
    params = {**GREEDY, "ignore_eos": True}
    assert len(generate(rollout.client(), PROMPT, params).token_ids) == 8  # response_length
    long_prompt = list(range(3, 23))  # 20 tokens: 16 + 8 - 20 = 4 left
    assert len(generate(rollout.client(), long_prompt, params).token_ids) == 4
    assert len(generate(rollout.client(), PROMPT, {**params, "max_new_tokens": 2}).token_ids) == 2


def test_bad_sampling_params_are_refused_by_name(rollout: Any) -> None:
    with pytest.raises(Exception, match=r"repetition_penalty=1\.3"):
        generate(rollout.client(), PROMPT, {**GREEDY, "repetition_penalty": 1.3})
    with pytest.raises(Exception, match="unknown sampling parameter 'beam_width'"):
        generate(rollout.client(), PROMPT, {**GREEDY, "beam_width": 2})


def test_abort_all_requests_holds_new_generates_until_resume(rollout: Any) -> None:
    """abort_all_requests: the request in flight comes back "aborted" with its partial tokens; one sent after it
    waits until resume_generation, then completes. verl's FullyAsyncLLMServerClient resubmits an aborted request
    after resume and returns the whole budget."""
    client = rollout.client()
    long = {**GREEDY, "max_tokens": 1000, "ignore_eos": True}

    async def scenario() -> tuple[Any, Any, bool, Any]:
        running = asyncio.ensure_future(client.generate("a", prompt_ids=PROMPT, sampling_params=dict(long)))
        await rollout.running()
        await rollout.replica.abort_all_requests()
        aborted = await running
        later = asyncio.ensure_future(
            client.generate("b", prompt_ids=PROMPT, sampling_params={**GREEDY, "max_tokens": 3})
        )
        await asyncio.sleep(1.0)
        held = not later.done()
        await rollout.replica.resume_generation()
        return aborted, await later, held, None

    aborted, later, held, _ = asyncio.run(scenario())
    assert aborted.stop_reason == "aborted" and len(aborted.token_ids) < 1000
    assert held, "a generate sent after abort_all_requests finished before resume_generation"
    assert later.stop_reason == "completed" and len(later.token_ids) == 3

    fully = rollout.client(fully_async=True)

    async def resumed() -> Any:
        task = asyncio.ensure_future(
            fully.generate("c", prompt_ids=PROMPT, sampling_params={**long, "max_tokens": 300})
        )
        await rollout.running()
        await rollout.replica.abort_all_requests()
        await asyncio.sleep(0.2)
        await rollout.replica.resume_generation()
        return await task

    whole = asyncio.run(resumed())
    assert len(whole.token_ids) == 300 and len(whole.log_probs) == 300


def test_weight_update_from_sync_and_async_generators_with_sleep_and_wake(rollout: Any, model: str) -> None:
    """verl's hybrid sync through the adapter: the replica sleeps (weights and KV freed), the worker wakes the
    weights, streams a sync generator (then an async one) into one load session labelled with global_steps,
    wakes the KV cache; the outputs are the new weights' (the prefix cache cached before the sync is not used),
    and ``extra_fields["global_steps"]`` is the step."""
    other = str(tiny_model_dir(seed=1))
    new_tokens, _ = reference(model, other, PROMPT, 6)
    old_tokens, _ = reference(model, None, PROMPT, 6)
    assert new_tokens != old_tokens
    params = {**GREEDY, "max_tokens": 6, "ignore_eos": True}
    assert generate(rollout.client(), PROMPT, params).token_ids == old_tokens  # fills the prefix cache

    asyncio.run(rollout.replica.sleep())
    state = rollout.state()
    assert set(state.released_tags) == {"weights", "kv_cache"} and state.sleep_level == 2
    with pytest.raises(Exception, match=r"(?i)sleep|asleep"):
        generate(rollout.client(), PROMPT, params)
    rollout.ray.get(rollout.trainer.resume.remote(["weights"]), timeout=120)
    assert set(rollout.state().released_tags) == {"kv_cache"}
    version, num_tensors = rollout.ray.get(rollout.trainer.update_weights.remote(other, 3, "sync"), timeout=120)
    assert version == 3 and num_tensors == len(load_checkpoint(other))
    rollout.ray.get(rollout.trainer.resume.remote(["kv_cache"]), timeout=120)
    assert not rollout.state().released_tags
    out = generate(rollout.client(), PROMPT, params)
    assert out.token_ids == new_tokens
    assert out.extra_fields["global_steps"] == 3

    assert rollout.sync(model, 4, kind="async") == (4, num_tensors)
    out = generate(rollout.client(), PROMPT, params)
    assert out.token_ids == old_tokens
    assert out.extra_fields["global_steps"] == 4


def test_a_sync_the_server_refuses_fails_at_once_and_the_next_one_works(rollout: Any, model: str) -> None:
    """A sync into an engine whose weights sleep (the worker skipped resume(["weights"])) fails at once with the
    engine's error (not at the transport's timeout), and the next sync forms a new group and lands."""
    import time

    asyncio.run(rollout.replica.sleep())
    start = time.monotonic()
    with pytest.raises(Exception, match=r"wake\(\['weights'\]\) before load_weights"):
        rollout.ray.get(rollout.trainer.update_weights.remote(model, 5, "sync"), timeout=120)
    assert time.monotonic() - start < 30
    rollout.ray.get(rollout.trainer.resume.remote(["weights"]), timeout=120)
    rollout.ray.get(rollout.trainer.update_weights.remote(model, 5, "sync"), timeout=120)
    rollout.ray.get(rollout.trainer.resume.remote(["kv_cache"]), timeout=120)
    out = generate(rollout.client(), PROMPT, {**GREEDY, "max_tokens": 2})
    assert out.extra_fields["global_steps"] == 5


def test_a_sync_in_the_middle_of_generation_spans_two_versions(rollout: Any, model: str) -> None:
    """A sync while a request runs (no abort): genengine holds it, loads, and goes on with the new weights; the
    output names both versions (min/max_global_steps), and global_steps is the newer."""
    client = rollout.client()
    long = {**GREEDY, "max_tokens": 1000, "ignore_eos": True}

    async def scenario() -> Any:
        task = asyncio.ensure_future(client.generate("m", prompt_ids=PROMPT, sampling_params=dict(long)))
        await rollout.running()
        await asyncio.wrap_future(rollout.trainer.update_weights.remote(model, 9, "sync").future())
        return await task

    out = asyncio.run(scenario())
    assert len(out.token_ids) == 1000
    assert out.extra_fields["global_steps"] == 9
    assert out.extra_fields["max_global_steps"] == 9
    assert out.extra_fields["min_global_steps"] < 9


def test_verl_agent_loop_manager_runs_on_the_plugin(rollout: Any) -> None:
    """verl's AgentLoopManager (its single-turn agent loop, chat template, padding) on the plugin's server."""
    import numpy as np
    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager

    manager = AgentLoopManager.create(rollout.config, llm_client=rollout.client())
    prompts = np.empty(2, dtype=object)
    prompts[0] = [{"role": "user", "content": "hello there"}]
    prompts[1] = [{"role": "user", "content": "one two three"}]
    batch = DataProto(non_tensor_batch={"raw_prompt": prompts}, meta_info={"global_steps": 1})
    try:
        out = manager.generate_sequences(batch)
    finally:
        for worker in manager.agent_loop_workers:
            rollout.ray.kill(worker)
    responses = out.batch["responses"]
    assert tuple(responses.shape) == (2, 8)
    assert int(out.batch["response_mask"].sum()) > 0
    assert "rollout_log_probs" in out.batch


def test_verl_v1_agent_loop_manager_tq_puts_the_plugins_outputs_into_transfer_queue(
    rollout: Any, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl 0.9.1's default trainer (``trainer.use_v1=True``: main_ppo's TaskRunnerV1) on the plugin: TransferQueue
    initialised from verl's own ``transfer_queue`` config as TaskRunnerV1.run does, its ``AgentLoopManagerTQ``
    dispatching a batch the way the trainer submits one (prompts registered "pending" in TransferQueue), the
    agent-loop workers putting the plugin's outputs into TransferQueue, and verl's sync ``ReplayBuffer`` sampling
    them with the weight version in the tags (the trainer reads min/max_global_steps as ints). About 20 s on two
    cores: importing ``verl.trainer.ppo.v1`` imports verl's whole v1 trainer, here and in the agent-loop worker."""
    import numpy as np
    import transfer_queue as tq  # not skipped when missing: verl's default trainer needs it (make setup installs it)
    from omegaconf import OmegaConf
    from transfer_queue.controller import TransferQueueController
    from transfer_queue.storage.simple_storage import SimpleStorageUnit
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl.utils import tensordict_utils as tu

    # The local cluster has two CPUs; TransferQueue's controller and storage units each reserve one, and the agent
    # loop worker needs one free to be placed. Nothing else changes.
    monkeypatch.setitem(TransferQueueController._default_options, "num_cpus", 0)
    monkeypatch.setitem(SimpleStorageUnit._default_options, "num_cpus", 0)
    config = verl_config(
        model, "actor_rollout_ref.rollout.n=2", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"
    )
    config.transfer_queue.enable = True  # what TaskRunnerV1.run sets
    OmegaConf.resolve(config)
    rollout.sync(model, 6)  # the trainer's naive sync before step 7 (PPOTrainerSync.on_init_end / on_step_end)
    tq.init(config.transfer_queue)
    workers: list[Any] = []
    try:
        manager = AgentLoopManagerTQ.create(config=config, llm_client=rollout.client())
        workers = list(manager.agent_loop_workers)
        raw = np.empty(2, dtype=object)
        raw[0] = [{"role": "user", "content": "hello there"}]
        raw[1] = [{"role": "user", "content": "one two three"}]
        uids = np.array(["p0", "p1"], dtype=object)
        batch = tu.get_tensordict({"raw_prompt": raw, "uid": uids, "index": np.array([0, 1], dtype=object)})
        tu.assign_non_tensor_data(batch, "global_steps", 7)
        tags = [{"is_prompt": True, "status": "pending", "global_steps": 7} for _ in uids]
        tq.kv_batch_put(keys=list(uids), partition_id="train", tags=tags)  # PPOTrainer._submit_batch_to_rollout
        manager.generate_sequences(batch)
        sampler = config.trainer.v1.sampler
        buffer = ReplayBuffer(
            trainer_mode="sync",
            trainer_config=config.trainer.v1.get("sync", {}),
            max_off_policy_threshold=sampler.max_off_policy_threshold,
            max_off_policy_strategy=sampler.max_off_policy_strategy,
            sampler_kwargs=sampler.sampler_kwargs,
            poll_interval=0.1,
            train_batch_size=2,
            gen_batch_size=2,
        )
        meta, _ = buffer.sample(global_steps=7, partition_id="train", batch_size=2)
        assert sorted(meta.keys) == ["p0_0_0", "p0_1_0", "p1_0_0", "p1_1_0"]
        data = tq.kv_batch_get(  # as the trainer's _compute_metrics reads them
            keys=meta.keys, partition_id="train", select_fields=["responses", "response_mask", "rollout_log_probs"]
        )
        lengths = data["responses"].offsets().diff()
        assert all(0 < int(n) <= 8 for n in lengths)  # response_length
        assert all(t["status"] == "success" and t["global_steps"] == 7 for t in meta.tags)
        # the trainer's _compute_metrics: np.array([...], dtype=int) over the weight versions of each trajectory
        assert np.array([t["min_global_steps"] for t in meta.tags], dtype=int).tolist() == [6] * 4
        assert np.array([t["max_global_steps"] for t in meta.tags], dtype=int).tolist() == [6] * 4
    finally:
        for worker in workers:
            rollout.ray.kill(worker)
        tq.close()


class _ActorWorkerGroup:
    """What verl's ``CheckpointEngineManager`` calls on the actor worker group in its naive (colocated) sync: the
    trainer-worker stand-in's ``update_weights(global_steps, mode="naive")``, from ``checkpoint``."""

    def __init__(self, trainer: Any, checkpoint: str) -> None:
        self.trainer, self.checkpoint = trainer, checkpoint

    def update_weights(self, global_steps: int, mode: str) -> list[Any]:
        assert mode == "naive"
        return [self.trainer.naive_sync.remote(self.checkpoint, global_steps)]


def test_verl_v1_colocate_async_step_boundary_resumes_a_partial_rollout(rollout: Any, model: str) -> None:
    """verl's v1 ``colocate_async`` trainer (PPOTrainerColocateAsync) at a step boundary, through verl's own
    CheckpointEngineManager: a request from its FullyAsyncLLMServerClient is in flight; on_sample_end aborts the
    replicas and sleeps them (the client's retry waits at the paused server meanwhile), on_step_end syncs the new
    weights (naive: wake weights, update, wake KV) and resumes generation. The request completes its whole budget
    across the two weight versions (min/max_global_steps) with a logprob per token."""
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.utils.config import omega_conf_to_dataclass

    ce_config = omega_conf_to_dataclass(rollout.config.actor_rollout_ref.rollout.checkpoint_engine)
    ce_config.backend = "naive"  # as PPOTrainer._setup sets it
    manager = CheckpointEngineManager(
        config=ce_config, actor_wg=_ActorWorkerGroup(rollout.trainer, model), replicas=[rollout.replica]
    )
    manager.sleep_replicas()
    manager.update_weights(10)  # PPOTrainerColocateAsync.on_init_end
    client = rollout.client(fully_async=True)
    long = {**GREEDY, "max_tokens": 300, "ignore_eos": True}

    async def scenario() -> Any:
        task = asyncio.ensure_future(client.generate("ca", prompt_ids=PROMPT, sampling_params=dict(long)))
        await rollout.running()
        await manager.abort_replicas()  # on_sample_end
        await asyncio.sleep(1.5)  # the client's retry (1 s after the aborted output) now waits at the server
        await manager.sleep_replicas()
        assert not task.done()
        await manager.update_weights(11)  # on_step_end
        await manager.resume_generation_replicas()
        return await asyncio.wait_for(task, timeout=120)

    out = asyncio.run(scenario())
    assert len(out.token_ids) == 300 and len(out.log_probs) == 300
    assert out.extra_fields["min_global_steps"] == 10
    assert out.extra_fields["max_global_steps"] == 11 == out.extra_fields["global_steps"]


# ---- bad configs: refused before anything starts ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("actor_rollout_ref.rollout.engine_kwargs.genengine.backend=nosuch", "nosuch"),
        ("+actor_rollout_ref.rollout.engine_kwargs.genengine.options.nosuch_option=1", "nosuch_option"),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size=3", "tensor_model_parallel_size=3 does not divide"),
        ("+actor_rollout_ref.rollout.engine_kwargs.genengine.backnd=sglang", "did you mean 'backend'"),
    ],
)
def test_bad_rollout_configs_fail_before_any_engine_starts(model: str, override: str, match: str) -> None:
    """The replica verl's LLMServerManager builds refuses the config in the driver, with genengine's message,
    before any server actor or engine exists (no Ray cluster needed: nothing is started)."""
    from verl.workers.rollout.replica import get_rollout_replica_class

    import genengine.integrations.verl.plugin  # noqa: F401

    overrides = [override]
    if "tensor_model" in override:
        overrides.append("actor_rollout_ref.rollout.n_gpus_per_node=4")
    config = verl_config(model, *overrides)
    rollout_config = config.actor_rollout_ref.rollout
    with pytest.raises(GenEngineError, match=match):
        get_rollout_replica_class("genengine")(
            replica_rank=0, config=rollout_config, model_config=config.actor_rollout_ref.model, gpus_per_node=4
        )
