"""Conformance tests of the async capability (streaming, abort, pause/resume across a weight update, weight
versions), for engines that declare ``supports_async``; skipped for the others.

They leave the engine awake, unpaused, with nothing in flight and the original weights.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import pytest

from genengine.errors import EngineSleepingError, EngineStateError, InvalidArgumentError, WeightsNotLoadedError
from genengine.protocol import (
    TAG_WEIGHTS,
    AsyncGenerationEngine,
    GenerationResult,
    GenerationStream,
    SamplingParams,
    is_async_engine,
)
from genengine.testing.conformance.base import GREEDY, PROMPTS, ConformanceBase, reference_logprobs

__all__ = ["AsyncTests"]

# Long enough that a stream read for a few chunks is still running when the test acts on it.
_LONG = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True, logprobs=True)
# Near the tiny model's context (1024): a stream read for a chunk runs for far longer than a short timeout.
_LONGEST = SamplingParams(temperature=0.0, max_new_tokens=960, ignore_eos=True)


# Bounds, so that an engine that stops answering fails its test with a message instead of hanging the suite.
CHUNK_TIMEOUT_S = 30.0
TEST_TIMEOUT_S = 120.0


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TEST_TIMEOUT_S))


async def _read(stream: Any, count: int) -> list[int]:
    """Read a stream until it has given ``count`` tokens (or ended); returns them. The stream stays open."""
    tokens: list[int] = []
    while len(tokens) < count:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), CHUNK_TIMEOUT_S)
        except StopAsyncIteration:
            break
        tokens.extend(chunk.token_ids)
    return tokens


async def _settled(engine: Any) -> int:
    """``in_flight`` once it reached 0, or after ``CHUNK_TIMEOUT_S`` (an abort may take a scheduler step)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CHUNK_TIMEOUT_S
    while (count := int(engine.in_flight)) and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return count


_SWITCH = SamplingParams(temperature=0.0, max_new_tokens=160, ignore_eos=True, logprobs=True)
"""Long enough that the request still runs when the pause lands, 4 tokens in, on a loaded 2-core machine too
(with 40, a run that raced to the end before the pause was seen once)."""


async def _switch_weights(
    engine: Any,
    prompt: str,
    clear_cache: bool,
    loads: Sequence[tuple[int, dict[str, Any]]],
    original: dict[str, Any],
) -> GenerationResult:
    """``_SWITCH`` on ``prompt``, switched after 4 tokens by pause(keep) → each of ``loads`` (weights labelled
    version + step) → resume; the engine gets ``original`` and its version back afterwards."""
    start = engine.weight_version
    try:
        stream = engine.stream(prompt, _SWITCH)
        await _read(stream, 4)
        await engine.pause_generation("keep", clear_cache=clear_cache)
        for step, weights in loads:
            engine.load_weights(weights.items(), version=start + step)
        await engine.resume_generation()
        return await stream.collect()
    finally:
        await _unpause(engine)
        engine.load_weights(original.items(), version=start)


async def _unpause(engine: Any) -> None:
    """Resumed (awake) with nothing in flight, whatever a test left: for its ``finally``."""
    if engine.is_sleeping:
        engine.wake()
    await engine.resume_generation()
    await engine.abort()


class AsyncTests(ConformanceBase):
    """Async tests; skipped for engines without ``supports_async``."""

    async_logprob_tolerance: ClassVar[float | None] = None
    """Mean |Δ logprob| allowed against transformers on each weight version's span (None: the suite's own)."""

    @pytest.fixture(scope="class")
    @classmethod
    def other_hf_model(cls, other_model_dir: str) -> Any:
        import torch
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32).eval()

    @pytest.fixture
    def async_engine(self, engine: Any) -> Iterator[Any]:
        """The class engine, for the async tests only (not autouse: a class fixture would cover every test of
        the suite); skips when the engine has no async capability, and leaves it unpaused and idle."""
        if not is_async_engine(engine):
            pytest.skip("the engine does not declare supports_async")
        assert engine.paused is None, f"an earlier test left the engine paused ({engine.paused!r})"
        yield engine
        if not engine.state.closed:
            _run(_unpause(engine))

    def _tolerance(self) -> float:
        own = self.async_logprob_tolerance
        return own if own is not None else self.logprob_tolerance * 4

    def _assert_close(self, got: list[float], want: list[float]) -> None:
        assert len(got) == len(want)
        if got:
            mean = sum(abs(a - b) for a, b in zip(got, want, strict=True)) / len(got)
            assert mean <= self._tolerance(), f"mean |Δ logprob| {mean:.3g} > {self._tolerance():.3g}"

    # ---- the typed contract ----------------------------------------------------------------------------------
    def test_it_has_every_member_of_the_async_protocol(self, async_engine: Any) -> None:
        """The declaration ``supports_async`` promises ``AsyncGenerationEngine``: every call and property is
        there, and ``stream`` returns a ``GenerationStream``."""
        assert isinstance(async_engine, AsyncGenerationEngine)

        async def main() -> Any:
            stream = async_engine.stream(PROMPTS[0], {"max_new_tokens": 2, "temperature": 0.0})
            await stream.collect()
            return stream

        assert isinstance(_run(main()), GenerationStream)

    # ---- the synchronous path is unchanged -------------------------------------------------------------------
    def test_sync_outputs_carry_one_weight_version(self, async_engine: Any, baseline: list[GenerationResult]) -> None:
        for result in baseline:
            for out in result.outputs:
                assert out.weight_versions == ((0, async_engine.weight_version),)

    def test_generate_async_equals_generate(self, async_engine: Any, baseline: list[GenerationResult]) -> None:
        async def main() -> list[GenerationResult]:
            return list(await asyncio.gather(*(async_engine.generate_async(p, GREEDY) for p in PROMPTS)))

        results = _run(main())
        assert [[o.token_ids for o in r.outputs] for r in results] == [
            [o.token_ids for o in r.outputs] for r in baseline
        ]
        for got, want in zip(results, baseline, strict=True):
            assert got.prompt_token_ids == want.prompt_token_ids
            self._assert_close(got.outputs[0].logprobs or [], want.outputs[0].logprobs or [])

    # ---- abort -----------------------------------------------------------------------------------------------
    def test_abort_mid_stream_keeps_partial_tokens_and_logprobs(self, async_engine: Any, hf_model: Any) -> None:
        async def main() -> tuple[list[int], list[str], GenerationResult]:
            stream = async_engine.stream(PROMPTS[0], _LONG, request_id="abort-me")
            head = await _read(stream, 3)
            aborted = await async_engine.abort("abort-me")
            return head, aborted, await stream.collect()

        head, aborted, result = _run(main())
        out = result.outputs[0]
        assert aborted == ["abort-me"] and result.prompt_token_ids
        assert out.finish_reason == "abort" and len(head) <= len(out.token_ids) < _LONG.max_new_tokens
        assert out.token_ids[: len(head)] == head
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        self._assert_close(out.logprobs, reference_logprobs(hf_model, result.prompt_token_ids, out.token_ids, _LONG))

    def test_stream_chunks_add_up_to_the_result(self, async_engine: Any) -> None:
        async def main() -> tuple[list[Any], GenerationResult]:
            stream = async_engine.stream(PROMPTS[1], {"max_new_tokens": 17, "temperature": 0.0, "logprobs": True})
            chunks = [chunk async for chunk in stream]
            return chunks, stream.result()

        chunks, result = _run(main())
        out = result.outputs[0]
        assert [t for c in chunks for t in c.token_ids] == out.token_ids
        assert [lp for c in chunks for lp in c.logprobs or []] == out.logprobs
        assert chunks[-1].finish_reason == out.finish_reason and out.finish_reason in ("stop", "length")
        assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)

    def test_closing_a_stream_early_aborts_its_request(self, async_engine: Any) -> None:
        async def main() -> int:
            stream = async_engine.stream(PROMPTS[2], _LONG)
            await _read(stream, 2)
            await stream.aclose()
            return int(async_engine.in_flight)

        assert _run(main()) == 0

    # ---- pause / load / resume -------------------------------------------------------------------------------
    def test_pause_keep_load_resume_switches_weights_at_a_known_token(
        self,
        async_engine: Any,
        hf_model: Any,
        other_hf_model: Any,
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
    ) -> None:
        """Tokens before the switch are model A's, after it model B's, each checked by teacher forcing."""
        params = _SWITCH
        start = async_engine.weight_version
        result = _run(_switch_weights(async_engine, PROMPTS[2], True, [(1, other_weights)], original_weights))
        out = result.outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == params.max_new_tokens
        assert len(out.weight_versions) == 2, out.weight_versions
        (zero, v0), (switch, v1) = out.weight_versions
        assert (zero, v0, v1) == (0, start, start + 1) and 4 <= switch < params.max_new_tokens
        prompt, tokens, logprobs = result.prompt_token_ids, out.token_ids, out.logprobs or []
        self._assert_close(logprobs[:switch], reference_logprobs(hf_model, prompt, tokens[:switch], params))
        after = reference_logprobs(other_hf_model, prompt + tokens[:switch], tokens[switch:], params)
        self._assert_close(logprobs[switch:], after)

    def test_pause_keep_reusing_the_old_kv_still_labels_the_switch(
        self, async_engine: Any, hf_model: Any, original_weights: dict[str, Any], other_weights: dict[str, Any]
    ) -> None:
        """``clear_cache=False``: the old KV goes on (no parity claim after the switch), the versions are exact."""
        params = _SWITCH
        start = async_engine.weight_version
        result = _run(_switch_weights(async_engine, PROMPTS[1], False, [(7, other_weights)], original_weights))
        out = result.outputs[0]
        assert len(out.token_ids) == params.max_new_tokens and len(out.weight_versions) == 2, out.weight_versions
        (_, v0), (switch, v1) = out.weight_versions
        assert (v0, v1) == (start, start + 7) and 4 <= switch < params.max_new_tokens
        prompt, tokens = result.prompt_token_ids, out.token_ids
        self._assert_close((out.logprobs or [])[:switch], reference_logprobs(hf_model, prompt, tokens[:switch], params))

    def test_pause_abort_loses_nothing_the_caller_was_not_told(self, async_engine: Any) -> None:
        async def main() -> list[tuple[list[int], GenerationResult]]:
            streams = [async_engine.stream(p, _LONG) for p in PROMPTS]
            seen = [await _read(stream, 1) for stream in streams]
            await async_engine.pause_generation("abort")
            assert async_engine.in_flight == 0
            queued = asyncio.ensure_future(async_engine.generate_async(PROMPTS[0], {"max_new_tokens": 2}))
            await asyncio.sleep(0.05)
            assert not queued.done(), "a request submitted during a pause must wait for resume"
            await async_engine.resume_generation()
            assert len((await queued).outputs[0].token_ids) == 2
            for tokens, stream in zip(seen, streams, strict=True):
                async for chunk in stream:
                    tokens.extend(chunk.token_ids)
            return [(tokens, stream.result()) for tokens, stream in zip(seen, streams, strict=True)]

        for seen, result in _run(main()):
            assert result.outputs[0].finish_reason == "abort" and result.outputs[0].token_ids == seen

    def test_pause_wait_drains_in_flight_requests(self, async_engine: Any) -> None:
        async def main() -> GenerationResult:
            params = {"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True}
            stream = async_engine.stream(PROMPTS[3], params)
            await _read(stream, 1)
            await async_engine.pause_generation("wait")
            assert async_engine.in_flight == 0
            await async_engine.resume_generation()
            return await stream.collect()

        out = _run(main()).outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 30

    def test_a_load_while_pause_wait_drains_is_refused(self, async_engine: Any) -> None:
        """``pause_generation("wait")`` sets the pause at once but returns only when the requests ended: a load
        meanwhile would land under them, so it is refused until the pause returned."""

        async def main() -> GenerationResult:
            stream = async_engine.stream(PROMPTS[0], _LONG)
            await _read(stream, 1)
            pausing = asyncio.ensure_future(async_engine.pause_generation("wait"))
            await asyncio.sleep(0.01)
            assert not pausing.done() and async_engine.paused == "wait"
            with pytest.raises(EngineStateError, match=r"pause_generation\('wait'\) has not returned yet"):
                async_engine.load_weights([])
            await async_engine.abort()
            await asyncio.wait_for(pausing, CHUNK_TIMEOUT_S)
            async_engine.load_weights([])  # drained: a load may go now
            await async_engine.resume_generation()
            return await stream.collect()

        assert _run(main()).outputs[0].finish_reason == "abort"

    def test_two_loads_in_one_keep_pause_give_one_span_of_the_last_version(
        self, async_engine: Any, hf_model: Any, original_weights: dict[str, Any], other_weights: dict[str, Any]
    ) -> None:
        """Two loads between a pause and its resume: the first one's span got no token, so it is relabelled
        (one new span, of the last version) rather than kept as an empty ``(k, +1)``. The last load puts the
        original weights back, so every token is the original model's, across the switch too."""
        start = async_engine.weight_version
        loads = [(1, other_weights), (2, original_weights)]
        result = _run(_switch_weights(async_engine, PROMPTS[2], True, loads, original_weights))
        out = result.outputs[0]
        assert len(out.token_ids) == _SWITCH.max_new_tokens and len(out.weight_versions) == 2, out.weight_versions
        (zero, v0), (switch, v2) = out.weight_versions
        assert (zero, v0, v2) == (0, start, start + 2) and 4 <= switch < _SWITCH.max_new_tokens
        want = reference_logprobs(hf_model, result.prompt_token_ids, out.token_ids, _SWITCH)
        self._assert_close(out.logprobs or [], want)

    def test_a_request_queued_during_a_pause_is_labelled_with_the_version_it_runs_on(
        self,
        async_engine: Any,
        other_hf_model: Any,
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
    ) -> None:
        """Submitted while paused, started after ``load_weights(version=N)`` and the resume: every token is N's
        (checked by teacher forcing), so its span and chunks say N; labelled with the version it was submitted
        under, a trainer would treat on-policy tokens as off-policy."""
        engine = async_engine
        start = engine.weight_version

        async def main() -> tuple[list[Any], GenerationResult]:
            try:
                await engine.pause_generation("keep")
                stream = engine.stream(PROMPTS[3], _SWITCH)
                engine.load_weights(other_weights.items(), version=start + 3)
                await engine.resume_generation()
                chunks = [chunk async for chunk in stream]
                return chunks, stream.result()
            finally:
                await _unpause(engine)
                engine.load_weights(original_weights.items(), version=start)

        chunks, result = _run(main())
        out = result.outputs[0]
        assert len(out.token_ids) == _SWITCH.max_new_tokens and out.weight_versions == ((0, start + 3),)
        assert {chunk.weight_version for chunk in chunks} == {start + 3}
        want = reference_logprobs(other_hf_model, result.prompt_token_ids, out.token_ids, _SWITCH)
        self._assert_close(out.logprobs or [], want)

    def test_resume_while_asleep_raises_and_stays_paused(
        self, async_engine: Any, baseline: list[GenerationResult], original_weights: dict[str, Any]
    ) -> None:
        """With nothing held or queued too: asleep (also after ``wake(["weights"])`` only) or with incomplete
        weights, resume raises and the pause stays; requests submitted after it would find no engine to run."""
        engine = async_engine

        async def main() -> None:
            await engine.pause_generation("abort")
            engine.sleep(1)
            with pytest.raises(EngineSleepingError, match="asleep"):
                await engine.resume_generation()
            assert engine.paused == "abort"
            engine.wake([TAG_WEIGHTS])
            with pytest.raises(EngineSleepingError, match="asleep"):
                await engine.resume_generation()
            assert engine.paused == "abort"
            engine.wake()
            if self.supports_sleep_level_2:
                engine.sleep(2)
                engine.wake()
                with pytest.raises(WeightsNotLoadedError):
                    await engine.resume_generation()
                assert engine.paused == "abort"
                engine.load_weights(original_weights.items())
            await engine.resume_generation()
            assert engine.paused is None

        with self.restoring(engine, original_weights):
            _run(main())
        self.assert_baseline(engine, baseline)

    def test_queued_requests_start_only_when_the_engine_can_generate(
        self, async_engine: Any, baseline: list[GenerationResult]
    ) -> None:
        """A request queued during a pause holds no memory, so the engine may sleep; the resume then raises and
        stays paused (the request still queued), and after wake and resume the request runs."""
        engine = async_engine

        async def main() -> GenerationResult:
            await engine.pause_generation("abort")
            queued = engine.stream(PROMPTS[2], GREEDY)
            engine.sleep(1)
            with pytest.raises(EngineSleepingError):
                await engine.resume_generation()
            assert engine.paused == "abort" and engine.in_flight == 1
            engine.wake()
            await engine.resume_generation()
            return await queued.collect()

        result = _run(main())
        assert [o.token_ids for o in result.outputs] == [o.token_ids for o in baseline[2].outputs]

    def test_a_duplicate_request_id_among_queued_requests_is_refused(
        self, async_engine: Any, baseline: list[GenerationResult]
    ) -> None:
        """The second request is refused at once and leaves nothing behind; the first runs after the resume."""
        engine = async_engine

        async def main() -> GenerationResult:
            await engine.pause_generation("abort")
            first = engine.stream(PROMPTS[0], GREEDY, request_id="queued-twice")
            with pytest.raises(InvalidArgumentError, match="'queued-twice' is already in flight"):
                engine.stream(PROMPTS[1], GREEDY, request_id="queued-twice")
            assert engine.in_flight == 1
            await engine.resume_generation()
            return await first.collect()

        result = _run(main())
        assert result.prompt_token_ids == baseline[0].prompt_token_ids
        assert [o.token_ids for o in result.outputs] == [o.token_ids for o in baseline[0].outputs]

    def test_abort_with_no_ids_ends_queued_requests_too(self, async_engine: Any) -> None:
        """``abort()`` means all: every request submitted and not finished, as ``in_flight`` counts them, held
        ones and those queued during the pause. None of them runs after the resume."""
        engine = async_engine

        async def main() -> tuple[list[int], list[str], GenerationResult, GenerationResult]:
            held = engine.stream(PROMPTS[0], _LONG, request_id="held")
            head = await _read(held, 1)
            await engine.pause_generation("keep")
            queued = engine.stream(PROMPTS[1], _LONG, request_id="queued")
            assert engine.in_flight == 2
            aborted = await engine.abort()
            assert engine.in_flight == 0
            await engine.resume_generation()
            return head, sorted(aborted), await held.collect(), await queued.collect()

        head, aborted, held, queued = _run(main())
        assert aborted == ["held", "queued"]
        assert held.outputs[0].finish_reason == "abort" and held.outputs[0].token_ids[: len(head)] == head
        assert queued.outputs[0].finish_reason == "abort" and queued.outputs[0].token_ids == []

    def test_a_pause_that_times_out_leaves_the_engine_unpaused(
        self, async_engine: Any, baseline: list[GenerationResult]
    ) -> None:
        """``wait_for(pause_generation("wait"), ...)`` giving up (a cancellation) must not leave the pause set:
        later requests would queue for a resume nobody makes. The running request goes on."""
        engine = async_engine

        async def main() -> tuple[int, GenerationResult, GenerationResult]:
            long = engine.stream(PROMPTS[0], _LONGEST)
            await _read(long, 1)  # 959 tokens to go: far longer than the timeout
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(engine.pause_generation("wait"), 0.2)
            assert engine.paused is None
            running = engine.in_flight
            after = await asyncio.wait_for(engine.generate_async(PROMPTS[1], GREEDY), CHUNK_TIMEOUT_S)
            await engine.abort()
            return running, after, await long.collect()

        running, after, long = _run(main())
        assert running == 1 and long.outputs[0].finish_reason == "abort"
        assert [o.token_ids for o in after.outputs] == [o.token_ids for o in baseline[1].outputs]

    # ---- callers that give up ---------------------------------------------------------------------------------
    def test_a_cancelled_collect_or_generate_async_aborts_its_request(
        self, async_engine: Any, baseline: list[GenerationResult]
    ) -> None:
        """A caller that gives up on ``generate_async`` or ``collect`` (``wait_for`` timing out, its task
        cancelled) aborts the request it waited for, running or queued during a pause: ``in_flight`` returns to
        0 and the engine may sleep. Left running unread, it would hold its memory and refuse every sleep."""
        engine = async_engine

        async def main() -> dict[str, int]:
            left: dict[str, int] = {}
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(engine.generate_async(PROMPTS[0], _LONGEST), 0.2)
            left["wait_for(generate_async) timed out"] = await _settled(engine)

            stream = engine.stream(PROMPTS[1], _LONGEST)
            await _read(stream, 1)
            collecting = asyncio.ensure_future(stream.collect())
            await asyncio.sleep(0.05)
            collecting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await collecting
            left["collect() task cancelled"] = await _settled(engine)

            await engine.pause_generation("abort")
            queued = asyncio.ensure_future(engine.generate_async(PROMPTS[2], _LONGEST))
            await asyncio.sleep(0.05)
            left["queued during a pause, before the cancel"] = engine.in_flight
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            left["queued generate_async task cancelled"] = await _settled(engine)
            await engine.resume_generation()
            await asyncio.sleep(0.05)
            left["after the resume"] = await _settled(engine)
            return left

        left = _run(main())
        assert left == {
            "wait_for(generate_async) timed out": 0,
            "collect() task cancelled": 0,
            "queued during a pause, before the cancel": 1,
            "queued generate_async task cancelled": 0,
            "after the resume": 0,
        }, f"requests in flight after each cancellation: {left}"
        engine.sleep(1)  # nothing runs any more: allowed
        engine.wake()
        self.assert_baseline(engine, baseline)

    # ---- under load ------------------------------------------------------------------------------------------
    def test_200_concurrent_requests_with_random_aborts(self, async_engine: Any) -> None:
        rng = random.Random(0)

        async def main() -> tuple[dict[str, list[int]], dict[str, GenerationResult], set[str]]:
            seen: dict[str, list[int]] = {}
            results: dict[str, GenerationResult] = {}

            async def one(i: int) -> None:
                rid = f"load-{i}"
                params = {"max_new_tokens": rng.randint(1, 24), "temperature": 1.0, "seed": i, "logprobs": True}
                seen[rid] = []
                stream = async_engine.stream(PROMPTS[i % len(PROMPTS)], params, request_id=rid)
                async for chunk in stream:
                    seen[rid].extend(chunk.token_ids)
                results[rid] = stream.result()

            tasks = [asyncio.ensure_future(one(i)) for i in range(200)]
            aborted: set[str] = set()
            for _ in range(40):
                await asyncio.sleep(rng.random() * 0.01)
                rid = f"load-{rng.randrange(200)}"
                aborted.update(await async_engine.abort(rid))
            await asyncio.gather(*tasks)
            return seen, results, aborted

        seen, results, aborted = _run(main())
        assert set(results) == {f"load-{i}" for i in range(200)}
        for rid, result in results.items():
            out = result.outputs[0]
            assert out.token_ids == seen[rid], rid
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
            assert (out.finish_reason == "abort") == (rid in aborted), rid
        assert async_engine.in_flight == 0

    # ---- the rules -------------------------------------------------------------------------------------------
    def test_sleep_with_requests_in_flight_is_refused(
        self, async_engine: Any, baseline: list[GenerationResult]
    ) -> None:
        async def main() -> None:
            stream = async_engine.stream(PROMPTS[0], _LONG)
            await _read(stream, 1)
            with pytest.raises(EngineStateError, match="running or held"):
                async_engine.sleep(1)
            with pytest.raises(EngineStateError, match="pause_generation"):
                async_engine.load_weights([])
            # A bad argument is still named first: the refusal for requests comes after the engine's own checks.
            with pytest.raises(InvalidArgumentError, match="level=3"):
                async_engine.sleep(3)
            with pytest.raises(InvalidArgumentError, match="bucket_bytes=0"):
                async_engine.load_weights([], bucket_bytes=0)
            await async_engine.abort()
            assert (await stream.collect()).outputs[0].finish_reason == "abort"

        _run(main())
        assert not async_engine.is_sleeping
        async_engine.sleep(1)
        async_engine.wake()
        assert [o.token_ids for r in async_engine.generate(PROMPTS, GREEDY) for o in r.outputs] == [
            o.token_ids for r in baseline for o in r.outputs
        ]

    def test_greedy_continuation_equals_the_uninterrupted_sample(self, async_engine: Any) -> None:
        params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)

        async def main() -> tuple[GenerationResult, GenerationResult]:
            whole = await async_engine.generate_async(PROMPTS[1], params)
            prompt, head = whole.prompt_token_ids, whole.outputs[0].token_ids[:8]
            rest = await async_engine.generate_async(
                None, {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}, prompt_token_ids=prompt + head
            )
            return whole, rest

        whole, rest = _run(main())
        assert whole.outputs[0].token_ids[8:] == rest.outputs[0].token_ids

    def test_bad_async_input_is_rejected(self, async_engine: Any) -> None:
        async def main() -> None:
            with pytest.raises(InvalidArgumentError, match="mode"):
                await async_engine.pause_generation("drain")
            with pytest.raises(InvalidArgumentError, match="clear_cache"):
                await async_engine.pause_generation("keep", clear_cache="yes")
            with pytest.raises(InvalidArgumentError, match="one prompt"):
                await async_engine.generate_async(["a", "b"])
            with pytest.raises(InvalidArgumentError, match="request_id"):
                await async_engine.generate_async("a", request_id=5)
            for bad in (5, {"id"}):  # not None, an id, nor a list of ids: refused, naming what is allowed
                with pytest.raises(InvalidArgumentError, match=r"request_ids=.*allowed are None, an id, or a list"):
                    await async_engine.abort(bad)
            stream = async_engine.stream(PROMPTS[0], _LONG, request_id="twice")
            with pytest.raises(InvalidArgumentError, match="already in flight"):
                async_engine.stream(PROMPTS[0], request_id="twice")
            await async_engine.abort("twice")
            await stream.collect()
            assert async_engine.paused is None

        _run(main())
        with pytest.raises(InvalidArgumentError, match="version"):
            async_engine.load_weights([], version=-1)
