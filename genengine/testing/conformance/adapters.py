"""Conformance tests of LoRA adapters (``load_adapter``, ``SamplingParams(adapter=...)``, ``unload_adapter``),
for engines that declare ``supports_adapters``; skipped for the others.

The reference is transformers on the CPU with the adapter merged into a copy of the weights
(``W + lora_alpha / r * B @ A``): an engine serving the adapter unmerged must sample what that model samples.
They leave the engine with no adapter loaded.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from genengine.adapters import supports_adapters
from genengine.errors import EngineSleepingError, InvalidArgumentError, WeightLoadError
from genengine.protocol import GenerationResult, is_async_engine
from genengine.testing.conformance.base import GREEDY, PROMPTS, ConformanceBase, reference_logprobs, token_ids_of

__all__ = ["AdapterTests", "merged_model", "random_adapter"]

_PEFT = "base_model.model."


def random_adapter(
    weights: dict[str, Any], targets: tuple[str, ...], *, r: int, seed: int, std: float = 0.05
) -> dict[str, Any]:
    """A LoRA adapter with random (non-zero) ``A`` and ``B`` on every module named by ``targets``, as PEFT's
    ``get_peft_model_state_dict`` names its tensors; float32."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, Any] = {}
    for name, weight in sorted(weights.items()):
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or weight.dim() != 2 or module.rpartition(".")[2] not in targets:
            continue
        out_features, in_features = weight.shape
        tensors[f"{_PEFT}{module}.lora_A.weight"] = torch.randn((r, in_features), generator=gen) * std
        tensors[f"{_PEFT}{module}.lora_B.weight"] = torch.randn((out_features, r), generator=gen) * std
    return tensors


def merged_model(hf_model: Any, adapter: dict[str, Any], scaling: float) -> Any:
    """A float32 copy of ``hf_model`` with ``adapter`` merged into its weights: the reference."""
    import torch

    merged = copy.deepcopy(hf_model)
    params = dict(merged.named_parameters())
    with torch.no_grad():
        for key, a in adapter.items():
            if ".lora_A." not in key:
                continue
            module = key[len(_PEFT) :].partition(".lora_A.")[0]
            b = adapter[key.replace(".lora_A.", ".lora_B.")]
            params[f"{module}.weight"] += scaling * (b.float() @ a.float())
    return merged.eval()


class AdapterTests(ConformanceBase):
    """Adapters served per request, their versions, and the refusal of a bad one."""

    adapter_targets: ClassVar[tuple[str, ...]] = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """The modules the suite's adapters target (attention and MLP)."""
    adapter_rank: ClassVar[int] = 8

    def _config(self, r: int | None = None) -> dict[str, Any]:
        rank = self.adapter_rank if r is None else r
        return {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(self.adapter_targets)}

    @pytest.fixture
    def adapter_engine(self, engine: Any) -> Iterator[Any]:
        if not supports_adapters(engine):
            pytest.skip("the engine does not declare supports_adapters")
        yield engine
        for name in list(engine.adapters):
            engine.unload_adapter(name)

    def _check_against_merged(
        self, hf_model: Any, adapter: dict[str, Any], results: list[GenerationResult], scaling: float
    ) -> None:
        import torch

        merged = merged_model(hf_model, adapter, scaling)
        if self.greedy_matches_hf:
            for result in results:
                out = result.outputs[0]
                with torch.no_grad():
                    logits = merged(torch.tensor([result.prompt_token_ids + out.token_ids])).logits[0]
                start = len(result.prompt_token_ids) - 1
                argmax = logits[start : start + len(out.token_ids)].argmax(-1).tolist()
                assert out.token_ids == argmax, "greedy tokens differ from the merged model's"
        bound = self.logprob_bound(merged, results, GREEDY)
        diffs = [
            abs(a - b)
            for result in results
            for a, b in zip(
                result.outputs[0].logprobs or [],
                reference_logprobs(merged, result.prompt_token_ids, result.outputs[0].token_ids, GREEDY),
                strict=True,
            )
        ]
        assert sum(diffs) / len(diffs) <= bound, f"mean |Δlogprob| {sum(diffs) / len(diffs):.2e} > {bound:.2e}"

    def check_sync_modes_agree(
        self,
        engine: Any,
        original_weights: dict[str, Any],
        *,
        fast: str,
        slow: str,
        targets: tuple[str, ...] | None = None,
        device: str = "cuda",
    ) -> None:
        """For a backend with two ways to hand an adapter over (its ``adapter_sync``): the same adapter on
        ``targets`` (default: the suite's), held as a trainer holds it (bf16 on ``device``), loaded each way serves
        the same greedy tokens; and the engine keeps its own copy (the trainer zeroing its tensors after the load
        changes nothing served)."""
        import torch

        targets = self.adapter_targets if targets is None else targets
        adapter = {
            k: v.to(device, torch.bfloat16)
            for k, v in random_adapter(original_weights, targets, r=self.adapter_rank, seed=3).items()
        }
        config = {**self._config(), "target_modules": list(targets)}
        default = engine.adapter_sync
        try:
            try:
                engine.adapter_sync = slow
                engine.load_adapter("sync-slow", adapter.items(), config)
                engine.adapter_sync = fast
                info = engine.load_adapter("sync-fast", adapter.items(), config)
            finally:
                engine.adapter_sync = default
            assert info.phases, "load_adapter reports no steps"
            served = {
                name: engine.generate(PROMPTS, dataclasses.replace(GREEDY, adapter=name))
                for name in ("sync-slow", "sync-fast")
            }
            base = engine.generate(PROMPTS, GREEDY)
            assert token_ids_of(served["sync-fast"]) != token_ids_of(base), "the adapter changed no output"
            assert token_ids_of(served["sync-fast"]) == token_ids_of(served["sync-slow"]), (
                f"adapter_sync={fast!r} serves other tokens than {slow!r}"
            )
            for fast_r, slow_r in zip(served["sync-fast"], served["sync-slow"], strict=True):
                pairs = zip(fast_r.outputs[0].logprobs, slow_r.outputs[0].logprobs, strict=True)
                diffs = [abs(a - b) for a, b in pairs]
                assert max(diffs) <= 1e-3, f"logprobs differ by up to {max(diffs):.2e}"
            for tensor in adapter.values():
                tensor.zero_()
            again = engine.generate(PROMPTS, dataclasses.replace(GREEDY, adapter="sync-fast"))
            assert token_ids_of(again) == token_ids_of(served["sync-fast"]), "the engine served the trainer's tensors"
        finally:  # the module's engine serves the other tests: leave it with the adapters it had
            for name in ("sync-slow", "sync-fast"):
                if name in engine.adapters:
                    engine.unload_adapter(name)

    def test_adapter_generates_as_merged_model(
        self,
        adapter_engine: Any,
        original_weights: dict[str, Any],
        hf_model: Any,
        baseline: list[GenerationResult],
    ) -> None:
        engine = adapter_engine
        adapter = random_adapter(original_weights, self.adapter_targets, r=self.adapter_rank, seed=1)
        info = engine.load_adapter("conf-a", adapter.items(), self._config(), version=7)
        assert info.name == "conf-a" and info.version == 7 and info.num_tensors == len(adapter)
        assert {"check_s", "add_s", "retire_s"} <= set(info.phases) and all(v >= 0 for v in info.phases.values())
        assert set(engine.adapters) == {"conf-a"} and engine.adapters["conf-a"].version == 7
        with_adapter = dataclasses.replace(GREEDY, adapter="conf-a")
        # One call mixing base and adapter requests: each is served with its own weights.
        mixed = engine.generate(PROMPTS + PROMPTS, [with_adapter] * len(PROMPTS) + [GREEDY] * len(PROMPTS))
        served, base = mixed[: len(PROMPTS)], mixed[len(PROMPTS) :]
        assert token_ids_of(base) == token_ids_of(baseline), "a base request changed when an adapter was loaded"
        assert token_ids_of(served) != token_ids_of(baseline), "the adapter changed no output"
        assert all(o.weight_versions == ((0, 7),) for r in served for o in r.outputs)
        assert all(o.weight_versions[0][1] != 7 for r in base for o in r.outputs)
        self._check_against_merged(hf_model, adapter, served, self._config()["lora_alpha"] / self.adapter_rank)
        engine.unload_adapter("conf-a")
        assert dict(engine.adapters) == {}
        with pytest.raises(InvalidArgumentError, match="conf-a"):
            engine.generate(PROMPTS, with_adapter)
        with pytest.raises(InvalidArgumentError, match="not loaded"):
            engine.unload_adapter("conf-a")
        self.assert_baseline(engine, baseline)

    def test_base_weights_load_beside_an_adapter(
        self,
        adapter_engine: Any,
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        baseline: list[GenerationResult],
    ) -> None:
        """The trainer's base weights (HF names) load into an engine that serves adapters: what TRL's adapter sync
        does once, and the merge fallback every step. Engines wrap the targeted layers for LoRA (vLLM moves their
        weights under ``base_layer``), so the names must still land."""
        engine = adapter_engine
        adapter = random_adapter(original_weights, self.adapter_targets, r=self.adapter_rank, seed=8)
        engine.load_adapter("conf-f", adapter, self._config(), version=1)
        params = dataclasses.replace(GREEDY, adapter="conf-f")
        served = token_ids_of(engine.generate(PROMPTS, params))
        with self.restoring(engine, original_weights):
            engine.load_weights(other_weights.items())
            assert token_ids_of(engine.generate(PROMPTS, GREEDY)) != token_ids_of(baseline), (
                "the base load wrote nothing"
            )
            engine.load_weights(original_weights.items())
        self.assert_baseline(engine, baseline)
        assert token_ids_of(engine.generate(PROMPTS, params)) == served, "the adapter's outputs changed"

    def test_bad_adapter_is_refused_and_the_previous_one_kept(
        self, adapter_engine: Any, original_weights: dict[str, Any]
    ) -> None:
        engine = adapter_engine
        good = random_adapter(original_weights, self.adapter_targets, r=self.adapter_rank, seed=2)
        engine.load_adapter("conf-b", good, self._config(), version=1)
        params = dataclasses.replace(GREEDY, adapter="conf-b")
        before = token_ids_of(engine.generate(PROMPTS, params))
        first_a = next(k for k in good if ".lora_A." in k)
        wrong_shape = dict(good)
        wrong_shape[first_a] = good[first_a][:, :-1]
        missing_b = {k: v for k, v in good.items() if k != first_a.replace(".lora_A.", ".lora_B.")}
        over = engine.max_lora_rank + 1
        too_big = random_adapter(original_weights, self.adapter_targets, r=over, seed=3)
        bad: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
            ("wrong shape", wrong_shape, self._config()),
            ("missing lora_B", missing_b, self._config()),
            ("rank over max_lora_rank", too_big, self._config(over)),
            ("unknown target module", good, {**self._config(), "target_modules": ["not_a_proj"]}),
            ("module outside target_modules", good, {**self._config(), "target_modules": ["q_proj"]}),
        ]
        for what, tensors, config in bad:
            with pytest.raises((WeightLoadError, InvalidArgumentError)):
                engine.load_adapter("conf-b", tensors, config, version=2)
            assert engine.adapters["conf-b"].version == 1, f"{what}: the refused adapter replaced the good one"
            assert token_ids_of(engine.generate(PROMPTS, params)) == before, f"{what}: outputs changed"

    def test_replacing_an_adapter(self, adapter_engine: Any, original_weights: dict[str, Any]) -> None:
        """A new load under the same name serves later requests with its version; a request in flight finishes
        under the adapter it started with (async engines)."""
        engine = adapter_engine
        first = random_adapter(original_weights, self.adapter_targets, r=self.adapter_rank, seed=4)
        second = random_adapter(original_weights, self.adapter_targets, r=self.adapter_rank, seed=5)
        params = dataclasses.replace(GREEDY, adapter="conf-c", max_new_tokens=48, ignore_eos=True)
        engine.load_adapter("conf-c", first, self._config(), version=1)
        one = engine.generate(PROMPTS[:1], params)[0].outputs[0]
        if is_async_engine(engine):

            async def replaced_midway() -> Any:
                stream = engine.stream(PROMPTS[0], params)
                chunk = await asyncio.wait_for(stream.__anext__(), 30)
                assert chunk.token_ids
                adapter_engine.load_adapter("conf-c", second, self._config(), version=2)
                return await asyncio.wait_for(stream.collect(), 60)

            midway = asyncio.run(replaced_midway()).outputs[0]
            assert midway.token_ids == one.token_ids, "a request in flight changed adapter midway"
            assert midway.weight_versions == ((0, 1),)
        else:
            engine.load_adapter("conf-c", second, self._config(), version=2)
        two = engine.generate(PROMPTS[:1], params)[0].outputs[0]
        assert two.weight_versions == ((0, 2),) and engine.adapters["conf-c"].version == 2
        assert two.token_ids != one.token_ids, "the replacement was not served"
        engine.load_adapter("conf-c", first, self._config())  # version None: the replaced one's label stays
        again = engine.generate(PROMPTS[:1], params)[0].outputs[0]
        assert again.token_ids == one.token_ids and again.weight_versions == ((0, 2),)

    def test_an_adapter_replaced_during_a_pause(self, adapter_engine: Any, original_weights: dict[str, Any]) -> None:
        """A trainer's adapter-only sync: pause("keep") with a request mid-generation, the adapter replaced under
        its name, resume. The request finishes under the adapter it started with (its tokens those of that adapter
        alone, its version that one's, its KV recomputed with it); one submitted during the pause starts after
        the resume, under the new one (async engines)."""
        if not is_async_engine(adapter_engine):
            pytest.skip("the engine does not declare supports_async")
        engine: Any = adapter_engine  # both protocols' calls
        first = random_adapter(original_weights, self.adapter_targets, r=self.adapter_rank, seed=7)
        second = random_adapter(original_weights, self.adapter_targets, r=self.adapter_rank, seed=8)
        params = dataclasses.replace(GREEDY, adapter="conf-p", max_new_tokens=48, ignore_eos=True)
        engine.load_adapter("conf-p", second, self._config(), version=2)
        under_second = engine.generate(PROMPTS[1:2], params)[0].outputs[0]
        engine.load_adapter("conf-p", first, self._config(), version=1)
        under_first = engine.generate(PROMPTS[:1], params)[0].outputs[0]

        async def synced_midway() -> tuple[Any, Any]:
            started = engine.stream(PROMPTS[0], params)
            assert (await asyncio.wait_for(started.__anext__(), 30)).token_ids
            try:
                await engine.pause_generation("keep", clear_cache=True)
                queued = engine.stream(PROMPTS[1], params)
                engine.load_adapter("conf-p", second, self._config(), version=2)
            finally:
                await engine.resume_generation()
            return await asyncio.wait_for(started.collect(), 60), await asyncio.wait_for(queued.collect(), 60)

        started, queued = (r.outputs[0] for r in asyncio.run(synced_midway()))
        assert started.weight_versions == ((0, 1),), "a request in flight changed adapter at the sync"
        assert started.token_ids == under_first.token_ids, "its tokens are not the first adapter's alone"
        assert queued.weight_versions == ((0, 2),), "a request queued during the pause kept the replaced adapter"
        assert queued.token_ids == under_second.token_ids

    def test_adapter_survives_sleep_and_is_refused_while_asleep(
        self, adapter_engine: Any, original_weights: dict[str, Any]
    ) -> None:
        engine = adapter_engine
        adapter = random_adapter(original_weights, self.adapter_targets, r=self.adapter_rank, seed=6)
        engine.load_adapter("conf-d", adapter, self._config(), version=3)
        params = dataclasses.replace(GREEDY, adapter="conf-d")
        before = token_ids_of(engine.generate(PROMPTS, params))
        engine.sleep(1)
        with pytest.raises(EngineSleepingError):
            engine.load_adapter("conf-e", adapter, self._config())
        engine.wake()
        assert token_ids_of(engine.generate(PROMPTS, params)) == before
