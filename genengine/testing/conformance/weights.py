"""The conformance tests of ``load_weights``: equality with a fresh engine, buckets, failures, trainer tensors."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

from genengine.engine.base import EngineBase
from genengine.errors import EngineStateError, InvalidArgumentError, WeightLoadError, WeightsNotLoadedError
from genengine.protocol import (
    TAG_KV_CACHE,
    TAG_WEIGHTS,
    GenerationEngine,
    GenerationResult,
    SupportsLoadSessions,
)
from genengine.testing.conformance.base import (
    GREEDY,
    PROMPTS,
    ConformanceBase,
    breaking_stream,
    engine_prefix_hits,
    expect_raises,
    reference_logprobs,
    smallest_bucket,
    token_ids_of,
)

__all__ = ["WeightsTests"]

# ---- trainer tensors (issues 15 and 20): helpers of the section "trainer tensors" in EngineConformance -------
_UNREADABLE: Any = None


def _unreadable_like(tensor: Any) -> Any:
    """A tensor with ``tensor``'s metadata whose data cannot be read: every operation but ``detach`` raises.

    It stands for a trainer tensor that passes every check (a kind with data, floating, the right shape) and
    fails only when the engine copies it, inside ``_apply_weights``: a lazily loaded tensor whose file went
    away, or a FakeTensor that escaped its FakeTensorMode (copying one raises). Any read fails, so it fails on
    every backend: ``copy_`` into a parameter, ``.to(device)``, pickling for another process.
    """
    import torch

    global _UNREADABLE
    if _UNREADABLE is None:

        class Unreadable(torch.Tensor):
            __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

            @staticmethod
            def __new__(cls, like: Any) -> Any:
                return torch.Tensor._make_wrapper_subclass(
                    cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device
                )

            @classmethod
            def __torch_dispatch__(  # type: ignore[override]
                cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                if func is torch.ops.aten.detach.default:
                    return cls(args[0])
                raise OSError(f"reading the weight's data failed ({func})")

            def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
                return f"Unreadable(shape={tuple(self.shape)}, dtype={self.dtype})"

        _UNREADABLE = Unreadable
    return _UNREADABLE(tensor)


def _bucket_count(sizes: list[int], limit: int) -> int:
    """Buckets of at most ``limit`` bytes over tensors of ``sizes``, in order (a larger tensor alone): fewest."""
    buckets = size = 0
    for n in sizes:
        if buckets and size + n <= limit:
            size += n
        else:
            buckets, size = buckets + 1, n
    return buckets


class WeightsTests(ConformanceBase):
    """Weight loads that succeed, fail half-way, or carry odd trainer tensors; the flush they owe."""

    # ---- load_weights ----------------------------------------------------------------------------------
    def test_load_weights_equals_a_fresh_engine(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        other_record: dict[str, Any],
    ) -> None:
        """Also the stale-cache check: the same prompts just ran, so a cache that survived would show."""
        reference = other_record["results"]
        assert token_ids_of(reference) != token_ids_of(baseline), "the two random models should not agree"
        with self.restoring(engine, original_weights):
            self.assert_baseline(engine, baseline)
            report = engine.load_weights(other_weights.items())
            assert report.num_tensors == len(other_weights)
            assert report.num_bytes == sum(t.numel() * t.element_size() for t in other_weights.values())
            assert report.num_buckets >= 1 and report.seconds >= 0
            self.assert_same_outputs(engine.generate(PROMPTS, GREEDY), reference)
        self.assert_baseline(engine, baseline)

    def test_load_weights_in_small_buckets(
        self, engine: GenerationEngine, baseline: list[GenerationResult], original_weights: dict[str, Any]
    ) -> None:
        largest = max(t.numel() * t.element_size() for t in original_weights.values())
        with self.restoring(engine, original_weights):
            report = engine.load_weights(original_weights.items(), bucket_bytes=largest)
            assert report.num_buckets > 1 and report.num_tensors == len(original_weights)
            self.assert_baseline(engine, baseline)

    @pytest.mark.parametrize("bad", ["unknown-name", "wrong-shape", "wrong-dtype", "not-a-tensor", "name-twice"])
    def test_failed_load_weights_changes_nothing(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        hf_model: Any,
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        bad: str,
    ) -> None:
        """The good tensors come first (other weights), the bad entry last: nothing may be written."""
        import torch

        name, tensor = next(iter(other_weights.items()))
        entry: tuple[str, Any] = {
            "unknown-name": ("model.layers.99.not_a_weight", tensor),
            "wrong-shape": (name, tensor.flatten()[:-1].clone()),
            "wrong-dtype": (name, torch.zeros(tensor.shape, dtype=torch.int64)),
            "not-a-tensor": (name, tensor.tolist()),
            "name-twice": (name, tensor),
        }[bad]
        stream = [(n, t) for n, t in other_weights.items() if bad == "name-twice" or n != name] + [entry]
        with self.restoring(engine, original_weights):
            error = expect_raises(WeightLoadError, lambda: engine.load_weights(stream))
            assert entry[0] in str(error), f"the error should name {entry[0]!r}: {error}"
            assert engine.state.weights_loaded and not engine.is_sleeping
            results = engine.generate(PROMPTS, GREEDY)
            assert token_ids_of(results) == token_ids_of(baseline)
            # The weights serving these outputs are the original checkpoint's, by transformers' own forward
            # (held to the same bound as the baseline's parity test: bf16 engines have bf16's floor).
            diffs = []
            for result in results:
                out = result.outputs[0]
                ref = reference_logprobs(hf_model, result.prompt_token_ids, out.token_ids, GREEDY)
                diffs += [abs(a - b) for a, b in zip(out.logprobs or [], ref, strict=True)]
            mean, bound = sum(diffs) / len(diffs), self.logprob_bound(hf_model, results, GREEDY)
            assert mean <= bound, f"{bad}: mean |Δlogprob| {mean:.4f} vs the checkpoint > {bound:.4f}"

    def test_load_weights_bad_arguments(self, engine: GenerationEngine, baseline: list[GenerationResult]) -> None:
        bad_streams: list[Any] = [5, "model.norm.weight", None, [("x", 1, 2)], [object()]]
        for value in bad_streams:
            with pytest.raises(InvalidArgumentError):
                engine.load_weights(value)
        for bucket in (0, -1, 1.5, True):
            with pytest.raises(InvalidArgumentError):
                engine.load_weights([], bucket_bytes=bucket)  # type: ignore[arg-type]
        self.assert_baseline(engine, baseline)

    def test_stream_failing_midway_never_serves_mixed_weights(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
    ) -> None:
        items = list(other_weights.items())
        stream = breaking_stream(items, len(items) // 2, RuntimeError("trainer died half-way through the weights"))
        with self.restoring(engine, original_weights):
            expect_raises(
                RuntimeError, lambda: engine.load_weights(stream, bucket_bytes=smallest_bucket(other_weights))
            )
            self.assert_old_weights_or_refused(engine, baseline)
        self.assert_baseline(engine, baseline)

    # ---- load_weights that fails half-way (docs/failure-modes.md) ------------------------------------------
    def assert_old_weights_or_refused(self, engine: GenerationEngine, baseline: list[GenerationResult]) -> None:
        """After a failed load: the old weights serve unchanged, or every generate is refused. Never a mix."""
        if engine.state.weights_loaded:  # all-or-nothing engines: nothing was written
            self.assert_baseline(engine, baseline)
            return
        for call in (
            lambda: engine.generate(PROMPTS, GREEDY),
            lambda: engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 1}),
        ):
            error = expect_raises(WeightsNotLoadedError, call)
            assert "incomplete weights" in str(error) and "failed" in str(error), error
        engine.sleep(1)  # a sleep/wake cycle does not make half-written weights servable
        engine.wake()
        expect_raises(WeightsNotLoadedError, lambda: engine.generate(PROMPTS, GREEDY))

    def _streams_buckets(self, engine: GenerationEngine) -> bool:
        """True for engines that write each bucket as it comes (so a late failure leaves some written)."""
        return isinstance(engine, EngineBase) and not engine.validate_all_weights_first

    @pytest.mark.parametrize("bad", ["unknown-name", "wrong-shape", "not-a-tensor", "not-a-pair"])
    def test_bad_entry_after_buckets_were_written_never_serves_mixed_weights(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        bad: str,
    ) -> None:
        """Small buckets, the bad entry two thirds in: a streaming engine has written buckets when it sees it."""
        items = list(other_weights.items())
        cut = max(2, 2 * len(items) // 3)
        name, tensor = items[cut]
        entry: Any = {
            "unknown-name": ("model.layers.0.mlp.not_a_weight", tensor),
            "wrong-shape": (name, tensor.flatten()[:-1].clone()),
            "not-a-tensor": (name, "not a tensor"),
            "not-a-pair": (name,),
        }[bad]
        smallest = smallest_bucket(other_weights)
        pulled: list[str] = []

        def stream() -> Iterator[Any]:
            for item in [*items[:cut], entry, *items[cut + 1 :]]:
                pulled.append(str(item[0]))
                yield item

        with self.restoring(engine, original_weights):
            error = expect_raises(WeightLoadError, lambda: engine.load_weights(stream(), bucket_bytes=smallest))
            assert (entry[0] if bad != "not-a-pair" else f"entry {cut}") in str(error), error
            assert len(pulled) > cut, "the stream was not read up to the bad entry"
            if self._streams_buckets(engine):
                assert not engine.state.weights_loaded, "buckets before the bad entry should have been written"
            self.assert_old_weights_or_refused(engine, baseline)
        self.assert_baseline(engine, baseline)

    def test_failed_load_during_staged_wake_never_serves_mixed_weights(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
    ) -> None:
        """The RL step's order: sleep, wake weights, load (fails half-way), wake KV cache, generate."""
        items = list(other_weights.items())
        stream = breaking_stream(items, 3 * len(items) // 4, ConnectionError("the trainer's weight stream broke"))
        with self.restoring(engine, original_weights):
            engine.sleep(1)
            engine.wake([TAG_WEIGHTS])
            expect_raises(
                ConnectionError, lambda: engine.load_weights(stream, bucket_bytes=smallest_bucket(other_weights))
            )
            engine.wake([TAG_KV_CACHE])
            assert not engine.is_sleeping
            if self._streams_buckets(engine):
                assert not engine.state.weights_loaded
            self.assert_old_weights_or_refused(engine, baseline)
        self.assert_baseline(engine, baseline)

    def test_full_load_after_a_failed_one_equals_a_fresh_engine(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        other_record: dict[str, Any],
    ) -> None:
        """Recovery: once a load covers every weight again, outputs are exactly the new weights' own."""
        items = list(other_weights.items())
        half = len(items) // 2
        failing = breaking_stream(items, half, RuntimeError("trainer died half-way through the weights"))
        smallest = smallest_bucket(other_weights)
        reference = other_record["results"]
        with self.restoring(engine, original_weights):
            expect_raises(RuntimeError, lambda: engine.load_weights(failing, bucket_bytes=smallest))
            if not engine.state.weights_loaded:
                # The weights the failed call had written do not count: a load of the rest is not enough.
                engine.load_weights(items[half:], bucket_bytes=smallest)
                expect_raises(WeightsNotLoadedError, lambda: engine.generate(PROMPTS, GREEDY))
            report = engine.load_weights(iter(items), bucket_bytes=smallest)
            assert report.num_tensors == len(items) and report.num_buckets > 1
            assert engine.state.weights_loaded
            self.assert_same_outputs(engine.generate(PROMPTS, GREEDY), reference)
        self.assert_baseline(engine, baseline)

    def test_flush_cache(self, engine: GenerationEngine, baseline: list[GenerationResult]) -> None:
        """Outputs unchanged by flushes; where the engine counts cache hits, a flushed cache is really empty."""
        engine.flush_cache()
        self.assert_baseline(engine, baseline)
        hits = engine_prefix_hits(engine)
        if hits is not None:
            self.assert_baseline(engine, baseline)
            assert (engine_prefix_hits(engine) or 0) > hits, "the repeated prompts should hit the prefix cache"
            engine.flush_cache()
            hits = engine_prefix_hits(engine)
            self.assert_baseline(engine, baseline)
            assert engine_prefix_hits(engine) == hits, "a prefix cached before flush_cache was reused"
        engine.flush_cache()
        engine.flush_cache()
        self.assert_baseline(engine, baseline)

    def test_load_while_the_kv_cache_sleeps_flushes_the_cache_at_wake(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        other_record: dict[str, Any],
    ) -> None:
        """The RL step after a generate filled the cache: the flush the load owes is done at wake(kv_cache).

        With ``prefix_cache_survives_sleep`` the same steps without a load are seen to hit the cache, so a
        missing flush would show as a hit (and as the old weights' outputs).
        """
        counted = self.prefix_cache_survives_sleep
        if counted:
            assert engine_prefix_hits(engine) is not None, "prefix_cache_survives_sleep needs prefix_cache_hits"
            engine.generate(PROMPTS, GREEDY)
            engine.sleep(1)
            engine.wake([TAG_WEIGHTS])
            engine.wake([TAG_KV_CACHE])
            before = engine_prefix_hits(engine) or 0
            self.assert_baseline(engine, baseline)
            assert (engine_prefix_hits(engine) or 0) > before, "without a load the kept cache should be hit"
        with self.restoring(engine, original_weights):
            engine.generate(PROMPTS, GREEDY)  # the cache now holds the original weights' prefixes
            engine.sleep(1)
            engine.wake([TAG_WEIGHTS])
            engine.load_weights(other_weights.items())
            engine.wake([TAG_KV_CACHE])
            hits = engine_prefix_hits(engine)
            results = engine.generate(PROMPTS, GREEDY)
            if counted:
                assert engine_prefix_hits(engine) == hits, "the cache of the old weights was reused after the load"
            self.assert_same_outputs(results, other_record["results"])
        self.assert_baseline(engine, baseline)

    # ---- trainer tensors: kinds, values, buckets, failures inside a bucket (issues 15 and 20) ---------------
    def _record_applied(self, engine: GenerationEngine, monkeypatch: pytest.MonkeyPatch) -> list[list[Any]] | None:
        """Wrap the real engine's ``_apply_weights`` to note each bucket it receives (then it writes as always):
        per tensor its name, bytes, whether it is a plain ``torch.Tensor`` and contiguous. None if not EngineBase."""
        if not isinstance(engine, EngineBase):
            return None
        import torch

        received: list[list[Any]] = []
        apply = engine._apply_weights

        def recording(bucket: list[tuple[str, Any]], session: Any) -> None:
            received.append(
                [(n, t.numel() * t.element_size(), type(t) is torch.Tensor, t.is_contiguous()) for n, t in bucket]
            )
            apply(bucket, session)

        monkeypatch.setattr(engine, "_apply_weights", recording)
        return received

    @pytest.mark.parametrize("where", ["first", "middle", "last"])
    def test_failure_inside_a_bucket_refuses_until_a_full_load(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        where: str,
    ) -> None:
        """One bucket holds the whole call, and one of its tensors fails while the engine copies it.

        The tensor passes every check and fails on read (``_unreadable_like``), so the error comes from inside
        the write of the first bucket, with the tensors before it (none when first) already written: the engine
        must refuse, whatever part of the bucket landed, and a full load must bring the old model back exactly.
        """
        items = list(other_weights.items())
        at = {"first": 0, "middle": len(items) // 2, "last": len(items) - 1}[where]
        name, tensor = items[at]
        items[at] = (name, _unreadable_like(tensor))
        whole = sum(t.numel() * t.element_size() for t in other_weights.values())
        with self.restoring(engine, original_weights):
            expect_raises(Exception, lambda: engine.load_weights(items, bucket_bytes=whole))
            if self.reads_tensors_before_writing:  # it failed on read, before any write: nothing changed
                assert engine.state.weights_loaded, "the call failed before writing anything"
                self.assert_same_outputs(engine.generate(PROMPTS, GREEDY), baseline)
                return
            assert not engine.state.weights_loaded, "a bucket was being written: its old weights are not whole"
            error = expect_raises(WeightsNotLoadedError, lambda: engine.generate(PROMPTS, GREEDY))
            assert "incomplete weights" in str(error) and "failed" in str(error), error
            engine.sleep(1)  # a sleep/wake cycle does not make the half-written bucket servable
            engine.wake()
            expect_raises(WeightsNotLoadedError, lambda: engine.generate(PROMPTS, GREEDY))
            report = engine.load_weights(original_weights.items())
            assert report.num_tensors == len(original_weights) and engine.state.weights_loaded
            self.assert_same_outputs(engine.generate(PROMPTS, GREEDY), baseline)

    @pytest.mark.parametrize("kind", ["meta", "sparse", "freed"])
    def test_tensors_without_usable_data_are_rejected_before_any_write(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        kind: str,
    ) -> None:
        """Meta, sparse, and freed (storage resized to 0, as FSDP frees unsharded parameters) tensors, last in a
        list sent in one bucket per tensor: the whole list is checked before the first bucket is written."""
        import torch

        items = list(other_weights.items())
        name, tensor = items[-1]
        if kind == "meta":
            bad = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        elif kind == "sparse":
            bad = tensor.to_sparse()
        else:
            bad = tensor.clone()
            bad.untyped_storage().resize_(0)
        stream = [*items[:-1], (name, bad)]
        with self.restoring(engine, original_weights):
            error = expect_raises(
                WeightLoadError, lambda: engine.load_weights(stream, bucket_bytes=smallest_bucket(other_weights))
            )
            assert name in str(error) and "allowed are" in str(error), error
            assert engine.state.weights_loaded, "nothing may have been written"
            self.assert_baseline(engine, baseline)

    @pytest.mark.parametrize("value", [math.nan, math.inf])
    def test_check_finite_refuses_nan_and_inf_before_any_write(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        value: float,
    ) -> None:
        items = list(other_weights.items())
        name, tensor = items[-1]
        bad = tensor.clone()
        bad.view(-1)[bad.numel() // 2] = value
        stream = [*items[:-1], (name, bad)]
        smallest = smallest_bucket(other_weights)
        with self.restoring(engine, original_weights):
            error = expect_raises(
                WeightLoadError, lambda: engine.load_weights(stream, bucket_bytes=smallest, check_finite=True)
            )
            assert name in str(error) and "NaN or infinite" in str(error), error
            assert engine.state.weights_loaded, "nothing may have been written"
            self.assert_baseline(engine, baseline)
            assert engine.load_weights(items, check_finite=True).num_tensors == len(items)  # finite ones pass

    def test_buckets_are_at_most_bucket_bytes(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """The fewest buckets of at most ``bucket_bytes`` (the engine's default for None), seen in the report
        and, on an ``EngineBase``, in the buckets ``_apply_weights`` really receives."""
        items = list(original_weights.items())
        sizes = [t.numel() * t.element_size() for _, t in items]
        total, largest, smallest = sum(sizes), max(sizes), min(sizes)
        received = self._record_applied(engine, monkeypatch)
        limits: list[int | None] = [smallest, largest, largest + smallest, total // 3, total // 2, total, None]
        for limit in limits:
            applied = len(received) if received is not None else 0
            report = engine.load_weights(items, bucket_bytes=limit)
            assert report.num_tensors == len(items) and report.num_bytes == total
            if limit is None:
                if not isinstance(engine, EngineBase):
                    continue
                limit = engine.default_bucket_bytes
            want = _bucket_count(sizes, limit)
            assert report.num_buckets == want, f"bucket_bytes={limit}: {report.num_buckets} buckets, want {want}"
            if received is not None:
                buckets = received[applied:]
                assert [n for b in buckets for n, *_ in b] == [n for n, _ in items], "every tensor once, in order"
                for bucket in buckets:
                    size = sum(nbytes for _, nbytes, *_ in bucket)
                    assert size <= limit or len(bucket) == 1, f"a bucket of {size} bytes > bucket_bytes={limit}"
                assert len(buckets) == want
        self.assert_baseline(engine, baseline)

    def test_views_and_bf16_copies_load_like_plain_tensors(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        other_record: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Non-contiguous views (as ``named_parameters`` of a transposed or strided layout give) load as the
        same values, reaching the backend contiguous; a bf16 copy loads as its values in float32 do."""
        import torch

        def strided(t: Any) -> Any:  # the same values, not contiguous
            return t.t().contiguous().t() if t.dim() == 2 else torch.stack([t, t], dim=-1)[..., 0]

        views = [(n, strided(t)) for n, t in other_weights.items()]
        assert not any(v.is_contiguous() for _, v in views if v.numel() > 1)
        received = self._record_applied(engine, monkeypatch)
        with self.restoring(engine, original_weights):
            engine.load_weights(views)
            self.assert_same_outputs(engine.generate(PROMPTS, GREEDY), other_record["results"])
            if received is not None:
                odd = [n for b in received for n, _, plain, contiguous in b if not (plain and contiguous)]
                assert not odd, f"_apply_weights received non-contiguous or non-plain tensors: {odd[:3]}"
            halves = [(n, t.to(torch.bfloat16)) for n, t in other_weights.items()]
            engine.load_weights(halves)
            from_bf16 = engine.generate(PROMPTS, GREEDY)
            engine.load_weights([(n, t.float()) for n, t in halves])  # the same values, in float32
            self.assert_same_outputs(from_bf16, engine.generate(PROMPTS, GREEDY))
        self.assert_baseline(engine, baseline)

    # ---- load sessions (begin_load: a write per bucket, one commit), as transport receivers load ------------------
    def _sessions(self, engine: GenerationEngine) -> SupportsLoadSessions:
        if not isinstance(engine, SupportsLoadSessions):
            pytest.skip("the engine has no begin_load (transports load it with one load_weights a bucket)")
        return engine

    def _version(self, engine: GenerationEngine) -> int:
        """The version label the engine's outputs carry now."""
        return engine.generate(PROMPTS[:1], GREEDY)[0].outputs[0].weight_versions[-1][1]

    def _assert_refused_while_open(self, engine: GenerationEngine, sessions: SupportsLoadSessions) -> None:
        for call in (
            lambda: engine.generate(PROMPTS, GREEDY),
            lambda: engine.sleep(1),
            lambda: engine.wake(),
            lambda: engine.load_weights([]),
            lambda: sessions.begin_load(),
        ):
            error = expect_raises(EngineStateError, call)
            assert "load session" in str(error) and "commit() or abort()" in str(error), error

    def test_load_session_labels_and_flushes_only_at_commit(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        other_record: dict[str, Any],
    ) -> None:
        """Two writes, then the commit: the same report and outputs as ``load_weights`` of the same buckets, the
        new version label only from the commit on, and every other call refused while the session is open."""
        sessions = self._sessions(engine)
        items = list(other_weights.items())
        half = len(items) // 2
        old = self._version(engine)
        with self.restoring(engine, original_weights):
            session = sessions.begin_load(version=old + 7)
            session.write(items[:half])
            session.write(items[half:])
            self._assert_refused_while_open(engine, sessions)
            report = session.commit()
            assert (report.num_tensors, report.num_buckets) == (len(items), 2)
            assert report.num_bytes == sum(t.numel() * t.element_size() for _, t in items) and report.seconds >= 0
            results = engine.generate(PROMPTS, GREEDY)
            self.assert_same_outputs(results, other_record["results"])  # the commit flushed the old cache
            assert {o.weight_versions for r in results for o in r.outputs} == {((0, old + 7),)}
            expect_raises(EngineStateError, lambda: session.write(items[:1]))  # a committed session takes no more
            again = engine.load_weights(items, bucket_bytes=sum(t.numel() * t.element_size() for _, t in items[:half]))
            assert (again.num_tensors, again.num_bytes) == (report.num_tensors, report.num_bytes)
        engine.load_weights([], version=old)
        self.assert_baseline(engine, baseline)

    def test_load_session_failing_after_a_write_refuses_until_a_full_load(
        self,
        engine: GenerationEngine,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
    ) -> None:
        """A bucket refused after one was written (here a name written twice in the session): the session ends,
        the version stays, and the engine refuses to generate until a load covers every weight."""
        sessions = self._sessions(engine)
        items = list(other_weights.items())
        old = self._version(engine)
        with self.restoring(engine, original_weights):
            session = sessions.begin_load(version=old + 3)
            session.write(items[:2])
            error = expect_raises(WeightLoadError, lambda: session.write([items[1], *items[2:4]]))
            assert items[1][0] in str(error) and "twice" in str(error), error
            assert not engine.state.weights_loaded
            refused = expect_raises(WeightsNotLoadedError, lambda: engine.generate(PROMPTS, GREEDY))
            assert "load session failed after writing 2 weight(s)" in str(refused), refused
            expect_raises(EngineStateError, session.commit)  # the failure ended it
        assert self._version(engine) == old
        self.assert_baseline(engine, baseline)

    def test_load_session_failing_before_any_write_leaves_the_engine_whole(
        self, engine: GenerationEngine, baseline: list[GenerationResult], other_weights: dict[str, Any]
    ) -> None:
        """A refused first bucket, an error in a ``with`` block and a session left uncommitted: nothing was
        written, so the old weights serve on under the old version."""
        sessions = self._sessions(engine)
        name, tensor = next(iter(other_weights.items()))
        old = self._version(engine)
        session = sessions.begin_load(version=old + 1)
        expect_raises(WeightLoadError, lambda: session.write([(name, tensor.flatten()[:-1].clone())]))
        assert engine.state.weights_loaded

        def failing_block() -> None:
            with sessions.begin_load(version=old + 1):
                raise ConnectionError("the sender went away before the first bucket")

        expect_raises(ConnectionError, failing_block)
        with sessions.begin_load(version=old + 1):
            pass  # left without commit(): aborted
        assert engine.state.weights_loaded and self._version(engine) == old
        self.assert_baseline(engine, baseline)

    def test_a_second_begin_load_while_one_is_open_is_refused(
        self, engine: GenerationEngine, baseline: list[GenerationResult]
    ) -> None:
        sessions = self._sessions(engine)
        old = self._version(engine)
        session = sessions.begin_load(version=old + 2)
        error = expect_raises(EngineStateError, lambda: sessions.begin_load())
        assert f"version {old + 2}" in str(error), error
        self._assert_refused_while_open(engine, sessions)
        session.abort()
        assert engine.state.weights_loaded and self._version(engine) == old
        self.assert_baseline(engine, baseline)
