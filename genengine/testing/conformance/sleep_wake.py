"""The conformance tests of ``sleep`` and ``wake``: levels, staged wakes, and what a sleeping engine refuses."""

from __future__ import annotations

from typing import Any

import pytest

from genengine.engine.base import EngineBase
from genengine.errors import EngineSleepingError, InvalidArgumentError, WeightsNotLoadedError
from genengine.protocol import TAG_KV_CACHE, TAG_WEIGHTS, GenerationEngine, GenerationResult
from genengine.testing.conformance.base import GREEDY, PROMPTS, ConformanceBase, expect_raises

__all__ = ["SleepWakeTests"]


class SleepWakeTests(ConformanceBase):
    """Sleep levels 1 and 2 and the staged wake (weights before the KV cache)."""

    # ---- sleep / wake ----------------------------------------------------------------------------------
    def test_wake_while_awake_is_a_no_op(self, engine: GenerationEngine, baseline: list[GenerationResult]) -> None:
        engine.wake()
        engine.wake(["kv_cache"])
        engine.wake([])
        assert not engine.is_sleeping
        self.assert_baseline(engine, baseline)

    def test_sleep_level_1_cycle(
        self, engine: GenerationEngine, baseline: list[GenerationResult], original_weights: dict[str, Any]
    ) -> None:
        engine.sleep(1)
        state = engine.state
        assert engine.is_sleeping and state.sleep_level == 1
        assert state.released_tags == frozenset(engine.supported_tags)
        expect_raises(EngineSleepingError, lambda: engine.generate(PROMPTS, GREEDY))
        expect_raises(EngineSleepingError, lambda: engine.generate(prompt_token_ids=[[1, 2]]))
        expect_raises(EngineSleepingError, lambda: engine.load_weights(original_weights.items()))
        engine.sleep(1)  # double sleep: no-op
        engine.sleep(2)  # any sleep while asleep: no-op, the level stays
        assert engine.state.sleep_level == 1
        engine.flush_cache()  # nothing cached while asleep: allowed, a no-op
        engine.wake()
        assert not engine.is_sleeping and engine.state.sleep_level is None
        engine.wake()
        self.assert_baseline(engine, baseline)  # level 1 keeps the weights

    def test_staged_wake_after_level_1(self, engine: GenerationEngine, baseline: list[GenerationResult]) -> None:
        engine.sleep(1)
        engine.wake([TAG_WEIGHTS])
        assert engine.is_sleeping and engine.state.released_tags == frozenset({TAG_KV_CACHE})
        expect_raises(EngineSleepingError, lambda: engine.generate(PROMPTS, GREEDY))
        engine.wake([TAG_KV_CACHE])
        assert not engine.is_sleeping
        self.assert_baseline(engine, baseline)

    def test_bad_sleep_and_wake_arguments(self, engine: GenerationEngine, baseline: list[GenerationResult]) -> None:
        for level in (0, 3, -1, True, "1", None, 1.0, 2.5):
            with pytest.raises(InvalidArgumentError):
                engine.sleep(level)  # type: ignore[arg-type]
        for tags in (["bogus"], ["weights", "nope"]):
            with pytest.raises(InvalidArgumentError):
                engine.wake(tags)
        assert not engine.is_sleeping
        self.assert_baseline(engine, baseline)

    def test_level_2_needs_weights_before_generate(
        self, engine: GenerationEngine, baseline: list[GenerationResult], original_weights: dict[str, Any]
    ) -> None:
        if not self.supports_sleep_level_2:
            pytest.skip("no level-2 sleep")
        with self.restoring(engine, original_weights):
            engine.sleep(2)
            assert engine.state.sleep_level == 2 and not engine.state.weights_loaded
            engine.wake()
            assert not engine.is_sleeping and not engine.state.weights_loaded
            expect_raises(WeightsNotLoadedError, lambda: engine.generate(PROMPTS, GREEDY))
            first = next(iter(original_weights))
            engine.load_weights([(first, original_weights[first])])  # one tensor is not all of them
            expect_raises(WeightsNotLoadedError, lambda: engine.generate(PROMPTS, GREEDY))
            engine.load_weights(original_weights.items())
            assert engine.state.weights_loaded
            self.assert_baseline(engine, baseline)

    def test_staged_wake_after_level_2(
        self, engine: GenerationEngine, baseline: list[GenerationResult], original_weights: dict[str, Any]
    ) -> None:
        if not self.supports_sleep_level_2:
            pytest.skip("no level-2 sleep")
        with self.restoring(engine, original_weights):
            engine.sleep(2)
            engine.wake([TAG_WEIGHTS])
            engine.load_weights(original_weights.items())
            assert engine.state.released_tags == frozenset({TAG_KV_CACHE})
            expect_raises(EngineSleepingError, lambda: engine.generate(PROMPTS, GREEDY))
            engine.wake([TAG_KV_CACHE])
            assert not engine.is_sleeping and engine.state.weights_loaded
            self.assert_baseline(engine, baseline)

    def test_wake_takes_the_weights_back_before_the_kv_cache(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """One ``wake`` naming the KV cache first still takes the weights back first (no OOM from the KV pool).

        Seen on the real engine: its ``_resume`` is wrapped to record what it receives, and then runs as always.
        """
        if not isinstance(engine, EngineBase):
            pytest.skip("not an EngineBase: its resume step cannot be observed")
        received: list[tuple[str, ...]] = []
        resume = engine._resume

        def recording(tags: tuple[str, ...]) -> None:
            received.append(tuple(tags))
            resume(tags)

        monkeypatch.setattr(engine, "_resume", recording)
        for level in (1, 2) if self.supports_sleep_level_2 else (1,):
            with self.restoring(engine, original_weights):
                received.clear()
                engine.sleep(level)
                engine.wake([TAG_KV_CACHE, TAG_WEIGHTS])
                # An engine may wake a tag of its own with the KV cache (SGLang's "cuda_graph"): what it
                # resumes is in supported_tags order, in one call, weights first.
                assert len(received) == 1, f"level {level}: _resume received {received}"
                (tags,) = received
                assert tags[:1] == (TAG_WEIGHTS,) and TAG_KV_CACHE in tags, f"level {level}: _resume received {tags}"
                assert list(tags) == [t for t in engine.supported_tags if t in tags], f"level {level}: {tags}"
                assert not {TAG_WEIGHTS, TAG_KV_CACHE} & engine.state.released_tags
        self.assert_baseline(engine, baseline)
