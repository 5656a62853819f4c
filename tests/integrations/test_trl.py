"""TRL 1.16's own GRPOTrainer and RLOOTrainer, generating on the embedded engine through genengine.integrations.trl.

A real TRL run on the tiny model with the demo's toy reward: the rollouts are the engine's, after each weight sync
the engine's greedy tokens and logprobs are the HF policy's, and the reward rises as it does on TRL's own
``use_vllm=False`` path from the same seed. Bad configs fail before TRL loads the model.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from genengine.cli.demos.sync import TRL_PROMPTS as PROMPTS
from genengine.models.tiny_model import tiny_model_dir

HAVE_TRL = find_spec("trl") is not None
needs_trl = pytest.mark.skipif(
    not HAVE_TRL, reason="trl is not installed: pip install -e '.[trl]' (the dev extra installs it)"
)

STEPS = 8
LR = 1e-2
"""Both paths go from ~0.005 to 0.2-1.0 of the target token in 8 steps at this rate (seeds 0-2, measured)."""
ENGINE = {"backend": "transformers", "dtype": "float32", "options": {"device": "cpu"}}


def test_ci_installs_trl() -> None:
    """CI must run the TRL tests, not skip them: the dev extra installs trl."""
    if not HAVE_TRL and os.environ.get("CI"):
        pytest.fail("trl is missing in CI: the dev extra (genengine[trl]) should install it")
    if not HAVE_TRL:
        pytest.skip("trl is not installed (not CI)")


@dataclass
class Setup:
    model_dir: str
    tokenizer: Any
    target: int
    dataset: Any


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    if not HAVE_TRL:
        pytest.skip("trl is not installed: pip install -e '.[trl]'")
    import torch
    import transformers
    from datasets import Dataset

    import genengine
    from genengine.cli.demos.sync import pick_target

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the demo: the tiny model gains nothing from two threads on a busy 2-core machine
    transformers.utils.logging.set_verbosity_error()
    model_dir = str(tiny_model_dir())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    with genengine.create_engine(ENGINE, model=model_dir) as engine:
        target, _ = pick_target(engine, tokenizer, 16)
    yield Setup(model_dir, tokenizer, target, Dataset.from_dict({"prompt": PROMPTS}))
    torch.set_num_threads(threads)


def demo_reward(target: int, seen: list[list[list[int]]] | None = None) -> Any:
    """The demo's reward (share of completion tokens equal to ``target``) as a TRL reward function."""
    from genengine.cli.demos.sync import rewards_and_advantages

    def reward(completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
        if seen is not None:
            seen.append([list(c) for c in completion_ids])
        samples = [([], list(c), []) for c in completion_ids]
        rewards, _ = rewards_and_advantages(samples, target, len(samples))  # one group: only the rewards are used
        return [float(r) for r in rewards]

    return reward


def grpo_config(tmp: Path, steps: int, **changes: Any) -> Any:
    from trl import GRPOConfig

    settings: dict[str, Any] = {
        "output_dir": str(tmp),
        "per_device_train_batch_size": 16,
        "num_generations": 8,
        "max_completion_length": 16,
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "max_steps": steps,
        "logging_steps": 1,
        "report_to": [],
        "seed": 0,
        "use_cpu": True,
        "bf16": False,
        "save_strategy": "no",
        "disable_tqdm": True,
    }
    return GRPOConfig(**{**settings, **changes})


def policy(setup: Setup) -> Any:
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(setup.model_dir, dtype=torch.float32)


@dataclass
class Record:
    """What the spies saw: every rollout batch the engine made, every batch the reward scored, each sync."""

    rollouts: list[list[list[int]]] = field(default_factory=list)
    rewarded: list[list[list[int]]] = field(default_factory=list)
    loads: int = 0
    syncs: list[dict[str, Any]] = field(default_factory=list)
    asleep_when_rewarded: list[bool] = field(default_factory=list)


def hf_greedy(model: Any, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their (unscaled) logprobs from the HF policy itself, one full forward per token."""
    import torch

    tokens: list[int] = []
    lps: list[float] = []
    seq = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
            tok = int(logits.argmax())
            tokens.append(tok)
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            seq.append(tok)
    return tokens, lps


def spy(trainer: Any, setup: Setup, record: Record) -> None:
    """Record around the real engine and the real sync (nothing is replaced: each spy calls the real method)."""
    from genengine import SamplingParams

    gen = trainer.vllm_generation
    engine = gen.engine
    real_generate, real_load, real_sync = engine.generate, engine.load_weights, gen.sync_weights
    probes = [setup.tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    greedy = SamplingParams(temperature=0, max_new_tokens=8, logprobs=True, ignore_eos=True)

    def generate(*args: Any, **kwargs: Any) -> Any:
        results = real_generate(*args, **kwargs)
        if kwargs.get("sampling_params") is gen._sampling:  # TRL's rollouts, not this spy's greedy probes
            record.rollouts.append([list(o.token_ids) for r in results for o in r.outputs])
        return results

    def load_weights(*args: Any, **kwargs: Any) -> Any:
        record.loads += 1
        return real_load(*args, **kwargs)

    def sync_weights() -> None:
        real_sync()
        # With sleep mode the KV cache stays released until generate() wakes it, right after this sync: the probe
        # wakes it a moment early (generate's wake is then a no-op).
        engine.wake()
        ours = real_generate(prompt_token_ids=probes, sampling_params=greedy)
        theirs = [hf_greedy(trainer.model, ids, 8) for ids in probes]
        record.syncs.append(
            {
                "version": engine.weight_version,
                "step": trainer.state.global_step,
                "same_tokens": [r.outputs[0].token_ids == t for r, (t, _) in zip(ours, theirs, strict=True)],
                "lp_gap": max(
                    abs(a - b)
                    for r, (_, lps) in zip(ours, theirs, strict=True)
                    for a, b in zip(r.outputs[0].logprobs, lps, strict=True)
                ),
                "engine_lps": [lp for r in ours for lp in r.outputs[0].logprobs],
            }
        )

    engine.generate, engine.load_weights, gen.sync_weights = generate, load_weights, sync_weights


def run_on_engine(
    setup: Setup,
    tmp: Path,
    steps: int,
    *,
    model: Any = None,
    reward_funcs: Any = None,
    before_train: Any = None,
    lora_sync: str = "auto",
    **changes: Any,
) -> tuple[Any, Record]:
    """A GRPO run on the engine, spied on (``spy``); ``model`` is the policy (default: the tiny model),
    ``reward_funcs(seen)`` builds the reward (default: the demo's) and ``before_train(trainer)`` adds a caller's
    own checks, once the spies are in place."""
    from genengine.integrations.trl import GRPOTrainer

    record = Record()
    reward = (reward_funcs or partial(demo_reward, setup.target))(record.rewarded)
    holder: dict[str, Any] = {}

    def watched(*args: Any, **kwargs: Any) -> list[float]:
        record.asleep_when_rewarded.append(holder["trainer"].vllm_generation.engine.is_sleeping)
        return reward(*args, **kwargs)  # type: ignore[no-any-return]

    watched.__name__ = "target_share"
    trainer = GRPOTrainer(
        model=policy(setup) if model is None else model,
        reward_funcs=watched,
        args=grpo_config(tmp, steps, **changes),
        train_dataset=setup.dataset,
        processing_class=setup.tokenizer,
        genengine=ENGINE,
        lora_sync=lora_sync,
    )
    holder["trainer"] = trainer
    spy(trainer, setup, record)
    try:
        if before_train is not None:
            before_train(trainer)
        trainer.train()
    except BaseException:
        trainer.vllm_generation.shutdown()
        raise
    return trainer, record


def rewards_of(trainer: Any) -> list[float]:
    return [h["reward"] for h in trainer.state.log_history if "reward" in h]


def rise(rewards: list[float]) -> float:
    k = max(1, len(rewards) // 4)
    return sum(rewards[-k:]) / k - sum(rewards[:k]) / k


@needs_trl
def test_grpo_on_the_embedded_engine_learns_as_trl_does(setup: Setup, tmp_path: Path) -> None:
    import trl

    from genengine.integrations.trl import GenEngineGeneration

    trainer, record = run_on_engine(setup, tmp_path / "engine", STEPS)
    gen = trainer.vllm_generation
    try:
        assert isinstance(gen, GenEngineGeneration) and isinstance(gen, trl.generation.vllm_generation.VLLMGeneration)
        # The rollouts are the engine's: the reward scored exactly what the engine generated, batch by batch.
        assert len(record.rollouts) == STEPS and record.rewarded == record.rollouts
        assert not any(record.asleep_when_rewarded), "without vllm_enable_sleep_mode the engine never sleeps"
        # One sync per step, each one bucketed load_weights call labelled with the step.
        assert [s["version"] for s in record.syncs] == list(range(STEPS)) == [s["step"] for s in record.syncs]
        assert record.loads == STEPS and gen.engine.weight_version == STEPS - 1
        n_params = len(list(trainer.model.named_parameters()))
        assert gen.last_load is not None and (gen.last_load.num_tensors, gen.last_load.num_buckets) == (n_params, 1)
        # After each sync the engine is the policy: same greedy tokens, same logprobs (float32 on both sides) ...
        for s in record.syncs:
            assert all(s["same_tokens"]) and s["lp_gap"] < 1e-4, s
        # ... and the policy did change, so the equality above could have failed.
        first, last = record.syncs[0]["engine_lps"], record.syncs[-1]["engine_lps"]
        assert max(abs(a - b) for a, b in zip(first, last, strict=True)) > 1e-2
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert len(logs) == STEPS and all(math.isfinite(h["loss"]) for h in logs)
        # TRL's own check of the rollout logprobs against the policy's (its importance-sampling correction's input).
        assert all(h["sampling/sampling_logp_difference/max"] < 1e-4 for h in logs), logs

        # generate() answers in VLLMGeneration's shapes and types.
        prompt_ids, completion_ids, logprobs, token_ids = gen.generate([[5, 6, 7], [8, 9]], None, 1)
        assert prompt_ids == [[5, 6, 7], [8, 9]] and all(isinstance(t, int) for c in completion_ids for t in c)
        assert logprobs is not None and token_ids is not None
        assert [len(c) for c in completion_ids] == [len(lp) for lp in logprobs] == [len(t) for t in token_ids]
        assert all(len(x) == 1 and isinstance(x[0], float) for lp in logprobs for x in lp)
        assert [[x[0] for x in t] for t in token_ids] == completion_ids
        limit = trainer.model.config.max_position_embeddings  # what vLLM would infer; TRL's tool loop reads it
        assert gen.max_model_len == gen.llm.llm_engine.model_config.max_model_len == limit
    finally:
        gen.shutdown()

    # TRL's own generation (use_vllm=False), same seed: the reward rises on both paths.
    hf = trl.GRPOTrainer(
        model=policy(setup),
        reward_funcs=demo_reward(setup.target),
        args=grpo_config(tmp_path / "hf", STEPS),
        train_dataset=setup.dataset,
        processing_class=setup.tokenizer,
    )
    hf.train()
    ours, theirs = rewards_of(trainer), rewards_of(hf)
    print(f"reward per step, genengine: {[round(r, 3) for r in ours]}")
    print(f"reward per step, TRL use_vllm=False: {[round(r, 3) for r in theirs]}")
    assert len(ours) == len(theirs) == STEPS
    assert rise(ours) > 0.1 and rise(theirs) > 0.1, (ours, theirs)


@needs_trl
def test_sleep_mode_frees_the_engine_between_rollouts(setup: Setup, tmp_path: Path) -> None:
    trainer, record = run_on_engine(setup, tmp_path, 2, vllm_enable_sleep_mode=True)
    engine = trainer.vllm_generation.engine
    try:
        assert record.asleep_when_rewarded == [True, True], "asleep (level 2) while the trainer scores and steps"
        assert engine.state.sleep_level == 2 and not engine.state.weights_loaded
        assert [s["version"] for s in record.syncs] == [0, 1]
        for s in record.syncs:  # the weights a level-2 sleep dropped came back from the policy, whole
            assert all(s["same_tokens"]) and s["lp_gap"] < 1e-4, s
        assert record.rewarded == record.rollouts and len(record.rollouts) == 2
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert all(h["sampling/sampling_logp_difference/max"] < 1e-4 for h in logs)
    finally:
        trainer.vllm_generation.shutdown()


HAVE_PEFT = find_spec("peft") is not None


@needs_trl
@pytest.mark.skipif(not HAVE_PEFT, reason="peft is not installed (the dev extra installs it)")
def test_lora_policy_syncs_its_merged_weights(setup: Setup, tmp_path: Path) -> None:
    """A PEFT (LoRA) policy: each sync hands the engine the merged weights (base + B @ A * scale, under the base
    model's names), so after a training step the engine's weights are the merged policy's, and so are its greedy
    tokens and logprobs (the spy compares them with the PeftModel's own forward)."""
    import torch
    from peft import LoraConfig, get_peft_model

    base = policy(setup)
    initial = {n: p.detach().clone() for n, p in base.named_parameters()}
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    syncs: list[dict[str, float]] = []

    def compare_after_each_sync(trainer: Any) -> None:
        gen = trainer.vllm_generation
        spied = gen.sync_weights

        def sync_weights() -> None:
            spied()
            peft_model = trainer.model
            with torch.no_grad():
                peft_model.merge_adapter()
                try:
                    merged = {
                        n.removeprefix("base_model.model.").replace(".base_layer", ""): p.detach().clone()
                        for n, p in peft_model.named_parameters()
                        if "lora_" not in n
                    }
                finally:
                    peft_model.unmerge_adapter()
            served = dict(gen.engine.model.named_parameters())
            assert set(merged) == set(initial) and set(served) >= set(merged)
            syncs.append(
                {
                    "gap": max(float((served[n] - t).abs().max()) for n, t in merged.items()),
                    "moved": max(float((served[n] - initial[n]).abs().max()) for n in merged),
                }
            )

        gen.sync_weights = sync_weights

    def odd_share(seen: list[list[list[int]]]) -> Any:
        """The share of odd token ids: unlike the demo's reward it varies from the first batch on, so the first
        step already moves the adapter."""

        def reward(completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
            seen.append([list(c) for c in completion_ids])
            return [sum(t % 2 for t in c) / max(1, len(c)) for c in completion_ids]

        return reward

    trainer, record = run_on_engine(
        setup,
        tmp_path,
        2,
        model=get_peft_model(base, lora),
        reward_funcs=odd_share,
        before_train=compare_after_each_sync,
        lora_sync="merge",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
    )
    try:
        assert trainer.vllm_generation.sync_mode == "merge"
        assert len(syncs) == 2 and [s["version"] for s in record.syncs] == [0, 1]
        assert syncs[0]["moved"] == 0.0, "before the first step the adapter is zero: merged == base"
        assert syncs[1]["moved"] > 1e-3, "after a step the merged weights differ from the base: the check can fail"
        for sync in syncs:
            assert sync["gap"] < 1e-6, syncs  # the engine holds the merged weights, not the base ones
        for s in record.syncs:  # ... and generates as the merged policy does
            assert all(s["same_tokens"]) and s["lp_gap"] < 1e-4, s
        assert not any("lora_" in n for n in trainer.vllm_generation.engine.model.state_dict())
    finally:
        trainer.vllm_generation.shutdown()


@needs_trl
@pytest.mark.skipif(not HAVE_PEFT, reason="peft is not installed (the dev extra installs it)")
def test_lora_policy_syncs_only_its_adapter(setup: Setup, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A PEFT policy on an engine that serves adapters: after the first sync (base weights once) each sync sends
    only the adapter, labelled with the step; the engine's base weights stay the base (no merged copy), the rollouts
    name the adapter, and the engine's greedy tokens and logprobs with it are the PeftModel's own."""
    import logging

    from peft import LoraConfig, get_peft_model

    base = policy(setup)
    initial = {n: p.detach().clone() for n, p in base.named_parameters()}
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    probes = [setup.tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    seen: list[dict[str, Any]] = []

    def check_after_each_sync(trainer: Any) -> None:
        from genengine import SamplingParams

        gen = trainer.vllm_generation
        spied, real_load_adapter = gen.sync_weights, gen.engine.load_adapter
        adapter_loads: list[int] = []

        def load_adapter(name: str, tensors: Any, config: Any, **kw: Any) -> Any:
            tensors = list(tensors)
            assert tensors and all(".lora_A." in n or ".lora_B." in n for n, _ in tensors)
            adapter_loads.append(len(tensors))
            return real_load_adapter(name, tensors, config, **kw)

        gen.engine.load_adapter = load_adapter

        def sync_weights() -> None:
            spied()
            engine = gen.engine
            greedy = SamplingParams(temperature=0, max_new_tokens=8, logprobs=True, ignore_eos=True, adapter="policy")
            ours = engine.generate(prompt_token_ids=probes, sampling_params=greedy)
            theirs = [hf_greedy(trainer.model, ids, 8) for ids in probes]
            served = dict(engine.model.named_parameters())
            # PEFT starts lora_B at zero: how far it moved is how far the adapter moved.
            moved = max(float(p.detach().abs().max()) for n, p in trainer.model.named_parameters() if "lora_B" in n)
            seen.append(
                {
                    "version": engine.adapters["policy"].version,
                    "versions": {o.weight_versions for r in ours for o in r.outputs},
                    "same_tokens": all(r.outputs[0].token_ids == t for r, (t, _) in zip(ours, theirs, strict=True)),
                    "lp_gap": max(
                        abs(a - b)
                        for r, (_, lps) in zip(ours, theirs, strict=True)
                        for a, b in zip(r.outputs[0].logprobs, lps, strict=True)
                    ),
                    "base_gap": max(float((served[n] - t).abs().max()) for n, t in initial.items()),
                    "adapter_loads": list(adapter_loads),
                    "moved": moved,
                }
            )

        gen.sync_weights = sync_weights

    def odd_share(seen_ids: list[list[list[int]]]) -> Any:
        def reward(completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
            seen_ids.append([list(c) for c in completion_ids])
            return [sum(t % 2 for t in c) / max(1, len(c)) for c in completion_ids]

        return reward

    caplog.set_level(logging.INFO, logger="genengine.integrations.trl")
    trainer, record = run_on_engine(
        setup,
        tmp_path,
        3,
        model=get_peft_model(base, lora),
        reward_funcs=odd_share,
        before_train=check_after_each_sync,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
    )
    try:
        gen = trainer.vllm_generation
        assert gen.sync_mode == "adapter" and gen._sampling.adapter == "policy"
        assert "only the adapter" in caplog.text
        assert [s["version"] for s in seen] == [0, 1, 2] and record.loads == 1, "the base is sent once, not per step"
        assert [len(s["adapter_loads"]) for s in seen] == [1, 2, 3]
        assert seen[-1]["moved"] > 1e-3, "training moved the adapter: the comparison below can fail"
        for s in seen:
            assert s["versions"] == {((0, s["version"]),)}, s
            assert s["base_gap"] == 0.0, "the engine's base weights changed: a merged copy was sent"
            assert s["same_tokens"] and s["lp_gap"] < 1e-4, s
        assert record.rollouts and rewards_of(trainer)
        assert not any("lora_" in n for n in gen.engine.model.state_dict())
    finally:
        trainer.vllm_generation.shutdown()


@needs_trl
@pytest.mark.skipif(not HAVE_PEFT, reason="peft is not installed (the dev extra installs it)")
def test_lora_sync_adapter_is_refused_where_it_cannot_be_served(setup: Setup, tmp_path: Path) -> None:
    """``lora_sync='adapter'`` with a PEFT config the engines do not serve (DoRA) fails at construction, naming
    why; a bad ``lora_sync`` value is refused before the model loads."""
    from peft import LoraConfig, get_peft_model

    from genengine.errors import ConfigError
    from genengine.integrations.trl import GRPOTrainer

    dora = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"], task_type="CAUSAL_LM")
    kwargs: dict[str, Any] = {
        "reward_funcs": demo_reward(setup.target),
        "args": grpo_config(tmp_path, 1, per_device_train_batch_size=8, num_generations=4),
        "train_dataset": setup.dataset,
        "processing_class": setup.tokenizer,
        "genengine": ENGINE,
    }
    with pytest.raises(ConfigError, match="use_dora"):
        GRPOTrainer(model=get_peft_model(policy(setup), dora), lora_sync="adapter", **kwargs)
    with pytest.raises(ConfigError, match="lora_sync='sometimes'"):
        GRPOTrainer(model=policy(setup), lora_sync="sometimes", **kwargs)


@needs_trl
def test_rloo_runs_on_the_engine(setup: Setup, tmp_path: Path) -> None:
    """RLOO asks for no logprobs (TRL passes logprobs=None), so generate returns None for them."""
    from trl import RLOOConfig

    from genengine.integrations.trl import RLOOTrainer

    seen: list[list[list[int]]] = []
    args = RLOOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
    )
    trainer = RLOOTrainer(
        model=policy(setup),
        reward_funcs=demo_reward(setup.target, seen),
        args=args,
        train_dataset=setup.dataset,
        processing_class=setup.tokenizer,
        genengine=ENGINE,
    )
    gen = trainer.vllm_generation
    made: list[list[list[int]]] = []
    real = gen.generate

    def generate(*a: Any, **kw: Any) -> Any:
        out = real(*a, **kw)
        assert out[2] is None and out[3] is None
        made.append(out[1])
        return out

    gen.generate = generate
    try:
        trainer.train()
        assert len(made) == 2 and seen == made
        assert gen.engine.weight_version == 1
        assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    finally:
        gen.shutdown()


# ---- bad configs: refused before TRL loads the model or any engine starts --------------------------------------
class PolicyLoaded(Exception):
    """Raised by the stand-in policy loader: TRL's __init__ got as far as loading the policy."""


@pytest.fixture
def loader(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """TRL's policy loader (``create_model_from_path``, called in the trainer's __init__ for a model path) replaced
    by one that records the call and stops there: a refusal must come before it is called."""
    if not HAVE_TRL:
        pytest.skip("trl is not installed: pip install -e '.[trl]'")
    from trl.trainer import grpo_trainer, rloo_trainer

    calls: list[str] = []

    def load(name: str, **_: Any) -> Any:
        calls.append(name)
        raise PolicyLoaded(name)

    monkeypatch.setattr(grpo_trainer, "create_model_from_path", load)
    monkeypatch.setattr(rloo_trainer, "create_model_from_path", load)
    return calls


BAD_CONFIGS: list[tuple[dict[str, Any], Any, list[str]]] = [
    ({}, {"backend": "sglng"}, ["unknown backend 'sglng'", "Installed backends: "]),
    ({}, {"backend": "transformers", "mem_utl": 0.5}, ["unknown engine config key 'mem_utl'", "mem_util"]),
    ({"vllm_mode": "server"}, ENGINE, ["vllm_mode='server'", "no server mode", "allowed: 'colocate'"]),
    ({"vllm_structured_outputs_regex": "a+"}, ENGINE, ["vllm_structured_outputs_regex='a+'", "allowed: None"]),
    ({"vllm_tensor_parallel_size": 2}, ENGINE, ["vllm_tensor_parallel_size=2", "allowed: 1"]),
    ({"vllm_model_impl": "transformers"}, ENGINE, ["vllm_model_impl='transformers'", "allowed: 'vllm'"]),
    ({"repetition_penalty": 1.1}, ENGINE, ["repetition_penalty=1.1", "allowed: 1.0"]),
    ({"min_p": 0.1}, ENGINE, ["min_p=0.1", "allowed: None or 0.0"]),
    ({"generation_kwargs": {"min_tokens": 2}}, ENGINE, ["'min_tokens' is not supported by genengine", "allowed: "]),
    ({"generation_kwargs": {"seed": 3}}, ENGINE, ["generation_kwargs['seed']", "genengine={'seed': ...}"]),
    ({"top_p": 0.0}, ENGINE, ["top_p=0.0 must be in (0, 1]"]),
    ({}, {**ENGINE, "tp_size": 2}, ["tp_size=2", "allowed: 1"]),
    (
        {"vllm_enable_sleep_mode": True},
        {**ENGINE, "enable_sleep": False},
        ["vllm_enable_sleep_mode=True", "enable_sleep=False", "allowed: "],
    ),
    ({"trust_remote_code": True}, ENGINE, ["trust_remote_code=True", "'transformers'", "allowed: False"]),
    # The TRL key the user set, not only the genengine field it becomes.
    ({"vllm_gpu_memory_utilization": 1.5}, ENGINE, ["vllm_gpu_memory_utilization=1.5", "allowed: a number in (0, 1]"]),
    # The checks create_engine makes, run before the policy loads: the model folder and the backend's options.
    ({}, {**ENGINE, "model": "./model"}, ["model='./model' does not exist", "leave it out"]),
    ({}, {**ENGINE, "options": {"devcie": "cpu"}}, ["unknown option 'devcie'", "did you mean 'device'"]),
    ({}, {**ENGINE, "options": {"device": "gpu"}}, ["device='gpu'", "allowed are 'cpu', 'cuda'"]),
    # A string that is neither a backend name nor a file.
    ({}, "transfomers", ["genengine='transfomers' is neither", "did you mean 'transformers'", "a backend name ("]),
    ({}, "engine.yaml", ["genengine='engine.yaml' is neither", "the path of a YAML file that exists"]),
]


@needs_trl
@pytest.mark.parametrize(("changes", "engine", "words"), BAD_CONFIGS, ids=[str(c[2][0]) for c in BAD_CONFIGS])
def test_bad_config_is_refused_before_the_model_loads(
    changes: dict[str, Any], engine: Any, words: list[str], tmp_path: Path, loader: list[str]
) -> None:
    """The policy is a real model folder, and TRL's loader is a spy: the refusal comes before TRL loads it."""
    from genengine.errors import GenEngineError
    from genengine.integrations.trl import GRPOTrainer

    args = grpo_config(tmp_path, 1, **changes)
    with pytest.raises(GenEngineError) as info:
        GRPOTrainer(model=str(tiny_model_dir()), reward_funcs=lambda **_: [], args=args, genengine=engine)
    assert loader == [], "the policy loader was called before the refusal"
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@needs_trl
@pytest.mark.parametrize(
    ("engine", "words"),
    [
        ({"backend": "vllm", "dtype": "float32"}, ["dtype='float32' is not supported by the vllm backend"]),
        ({"backend": "vllm", "options": {"max_model_lenn": 9}}, ["unknown option 'max_model_lenn'"]),
        ({"backend": "sglang", "options": {"weight_sync_mode": "fast"}}, ["weight_sync_mode='fast'"]),
    ],
)
def test_gpu_backend_settings_are_checked_before_the_model_loads(
    engine: dict[str, Any], words: list[str], tmp_path: Path, loader: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """sglang's and vllm's own settings checks (plain functions, run without the engine) come before the policy
    loads too; the engines are not installed here, so the registry's installed check is stood in for."""
    from genengine.errors import ConfigError
    from genengine.integrations import trl as integration
    from genengine.integrations import trl_config

    monkeypatch.setattr(trl_config, "get_backend", lambda name: None)
    with pytest.raises(ConfigError) as info:
        integration.GRPOTrainer(
            model=str(tiny_model_dir()), reward_funcs=lambda **_: [], args=grpo_config(tmp_path, 1), genengine=engine
        )
    assert loader == []
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@needs_trl
def test_a_backend_name_alone_is_a_config(
    tmp_path: Path, loader: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``genengine="transformers"`` is the backend's name (it passes every check: TRL goes on to load the
    policy); a file of that name wins, as a YAML path. The trainer logs that genengine replaces vLLM."""
    import logging

    from genengine.integrations.trl import GRPOTrainer, resolve_engine_config

    model = str(tiny_model_dir())
    settings = {"vllm_gpu_memory_utilization": 0.3}
    config = resolve_engine_config("transformers", settings, model_name=model, seed=0)
    assert (config.backend, config.model, config.mem_util) == ("transformers", model, 0.3)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "transformers").write_text("backend: transformers\ndtype: float32\n")
    assert resolve_engine_config("transformers", settings, model_name=model, seed=0).dtype == "float32"

    with caplog.at_level(logging.INFO, logger="genengine.integrations.trl"), pytest.raises(PolicyLoaded):
        GRPOTrainer(model=model, reward_funcs=lambda **_: [], args=grpo_config(tmp_path, 1), genengine="transformers")
    with caplog.at_level(logging.INFO, logger="genengine.integrations.trl"), pytest.raises(PolicyLoaded):
        args = grpo_config(tmp_path, 1, use_vllm=True)
        GRPOTrainer(model=model, reward_funcs=lambda **_: [], args=args, genengine=ENGINE)
    assert loader == [model, model]
    lines = [r.getMessage() for r in caplog.records if r.name == "genengine.integrations.trl"]
    records = [r for r in caplog.records if r.name == "genengine.integrations.trl"]
    assert len(lines) == 2 and all(r.levelno == logging.INFO for r in records), lines
    assert all("genengine backend 'transformers' generates in place of TRL's vLLM" in line for line in lines)
    assert "use_vllm" not in lines[0]
    assert "use_vllm=True is set too: genengine's engine runs, TRL builds no vllm.LLM" in lines[1]


EXAMPLE_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs").glob("*.yaml"))


@needs_trl
@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=[p.stem for p in EXAMPLE_CONFIGS])
def test_example_configs_work_as_they_are(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/trl.md: the per-backend YAML files work as they are. The engine serves the policy's path, and the
    file passes every check the trainer makes before the policy loads (for sglang and vllm, which are not
    installed here, their own settings checks, which run without the engine)."""
    from genengine.integrations import trl as integration
    from genengine.integrations import trl_config

    assert {p.stem for p in EXAMPLE_CONFIGS} == {"transformers", "sglang", "vllm"}
    model = str(tiny_model_dir())
    config = integration.resolve_engine_config(str(path), {}, model_name=model, seed=5, process_index=2)
    assert config.backend == path.stem and config.model == model and config.seed == 0 + 2
    if path.stem != "transformers":
        monkeypatch.setattr(trl_config, "get_backend", lambda name: None)
    integration.check_engine_config(config, model_given="model" in path.read_text())


@needs_trl
def test_each_process_engine_gets_its_own_seed(tmp_path: Path) -> None:
    """With several training processes, each one's engine is seeded ``seed + process index`` (the genengine
    config's seed, else TRL's): the same prompts on two processes get different completions. A stand-in
    accelerator and a stand-in engine class: nothing is trained or loaded."""
    from types import SimpleNamespace

    from genengine import EngineConfig
    from genengine.integrations.trl import GenEngineGeneration

    seen: list[EngineConfig] = []

    class Recorder:
        @classmethod
        def from_config(cls, config: EngineConfig) -> Recorder:
            seen.append(config)
            return cls()

        def generate(self) -> None: ...
        def sleep(self) -> None: ...
        def wake(self) -> None: ...
        def load_weights(self) -> None: ...
        def flush_cache(self) -> None: ...
        def shutdown(self) -> None: ...

    def accelerator(index: int, count: int) -> Any:
        return SimpleNamespace(
            process_index=index,
            num_processes=count,
            state=SimpleNamespace(deepspeed_plugin=None),
            wait_for_everyone=lambda: None,
        )

    policy = SimpleNamespace(name_or_path=str(tmp_path))
    for genengine in ({"backend": Recorder}, {"backend": Recorder, "seed": 100}):
        for index in range(4):
            gen = GenEngineGeneration(
                model=policy,
                accelerator=accelerator(index, 4),
                processing_class=None,
                max_completion_length=8,
                genengine=genengine,
                seed=7,
            )
            assert isinstance(gen.engine, Recorder)
    assert [c.seed for c in seen] == [7, 8, 9, 10, 100, 101, 102, 103]
    assert all(c.model == str(tmp_path) for c in seen)


@needs_trl
def test_bad_config_from_yaml_and_for_rloo(tmp_path: Path) -> None:
    from trl import RLOOConfig

    from genengine.errors import BackendNotFoundError, ConfigError
    from genengine.integrations.trl import GRPOTrainer, RLOOTrainer

    path = tmp_path / "engine.yaml"
    path.write_text("backend: vlm\ndtype: bfloat16\n")
    with pytest.raises(BackendNotFoundError, match="unknown backend 'vlm'"):
        GRPOTrainer(model="nowhere", reward_funcs=lambda **_: [], args=grpo_config(tmp_path, 1), genengine=str(path))
    args = RLOOConfig(output_dir=str(tmp_path), vllm_mode="server", use_cpu=True, report_to=[])
    with pytest.raises(ConfigError, match="vllm_mode='server'"):
        RLOOTrainer(model="nowhere", reward_funcs=lambda **_: [], args=args, genengine=ENGINE)
    assert args.use_vllm is False, "the caller's config object is left as given"


@needs_trl
def test_quantized_policy_is_refused(tmp_path: Path) -> None:
    from transformers import BitsAndBytesConfig

    from genengine.errors import ConfigError
    from genengine.integrations.trl import GRPOTrainer

    with pytest.raises(ConfigError, match="quantized policies are not supported"):
        GRPOTrainer(
            model="nowhere",
            reward_funcs=lambda **_: [],
            args=grpo_config(tmp_path, 1),
            quantization_config=BitsAndBytesConfig(load_in_4bit=True),
            genengine=ENGINE,
        )


def _import_integration(code_before: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(code_before) + textwrap.dedent(
        """
        import sys
        try:
            import genengine.integrations.trl
        except ImportError as exc:
            print(type(exc).__name__, exc)
            print("imported:", sorted(m for m in ("torch", "trl") if sys.modules.get(m) is not None))
        """
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ, **(env or {})}
    )


def test_missing_trl_is_named_with_the_install_command() -> None:
    """TRL's absence, as importlib.metadata reports it (the rest of the environment is this one)."""
    out = _import_integration(
        """
        import importlib.metadata as md
        real = md.version
        def version(name):
            if name == "trl":
                raise md.PackageNotFoundError(name)
            return real(name)
        md.version = version
        """
    ).stdout
    assert "TRLVersionError" in out and "needs trl==1.16.0, which is not installed" in out
    assert "pip install trl==1.16.0, or in a clone of genengine: pip install -e '.[trl]'" in out
    assert "imported: []" in out, "nothing heavy is imported before the check"


def test_another_trl_version_is_refused_before_it_is_imported(tmp_path: Path) -> None:
    """A TRL 1.15.0 first on the path (its package raises if imported at all)."""
    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "__init__.py").write_text("raise RuntimeError('the wrong trl was imported')\n")
    dist = tmp_path / "trl-1.15.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: trl\nVersion: 1.15.0\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    out = _import_integration("", env={"PYTHONPATH": path}).stdout
    assert "trl 1.15.0 is installed; allowed: trl==1.16.0" in out and "imported: []" in out, out


def test_import_genengine_loads_no_integration() -> None:
    code = "import genengine, sys; print(sorted(m for m in ('trl', 'genengine.integrations.trl') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@needs_trl
@pytest.mark.parametrize("walk", ["parameters", "zero3", "fsdp2"])
def test_sync_hands_the_engine_a_list_only_of_the_models_own_parameters(walk: str) -> None:
    """Where TRL's walk yields the model's own parameters, ``sync_weights`` hands the engine a list of them (no
    memory held that the model does not hold; the engine checks the whole sync first and, on vLLM, loads it in
    one call); where the walk makes a tensor per parameter (ZeRO-3: copies; FSDP2: ``full_tensor()`` gathers,
    stood in for here by fresh copies), a stream, bounded by buckets."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from genengine.integrations.trl import GenEngineGeneration

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    seen: list[Any] = []

    def load_weights(tensors: Any, version: int) -> str:
        seen.append(tensors)
        seen.append(list(tensors))
        return "report"

    gen = GenEngineGeneration.__new__(GenEngineGeneration)
    gen.model, gen.enable_sleep_mode, gen.weight_version_fn, gen._syncs = model, False, None, 0
    gen._dist = SimpleNamespace(
        is_zero3=walk == "zero3",
        fsdp_version=2 if walk == "fsdp2" else None,
        is_fsdp=walk == "fsdp2",
        gather_params=lambda params: contextlib.nullcontext(),
    )
    if walk == "fsdp2":
        gen._iter_named_params = lambda: ((n, p.detach().clone()) for n, p in model.named_parameters())
    gen.engine = SimpleNamespace(load_weights=load_weights)
    gen.sync_weights()
    source, pairs = seen
    assert [name for name, _ in pairs] == [name for name, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    if walk == "parameters":
        assert isinstance(source, list)
        assert all(t.data_ptr() == params[n].data_ptr() for n, t in pairs)
    else:
        assert not isinstance(source, list)
        assert all(t.data_ptr() != params[n].data_ptr() and torch.equal(t, params[n]) for n, t in pairs)
    assert gen.last_load == "report"
