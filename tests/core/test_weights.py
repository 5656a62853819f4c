"""load_weights with what trainers really hand over, and failures once writing began, on the embedded engine.

1. The conformance suite's trainer-tensor tests on the embedded engine in streaming mode (``validate_all_weights_first
   = False``, as SGLang and vLLM write each bucket as it comes); test_conformance_transformers runs them in its
   all-first mode.
2. Trainer behaviour the suite cannot stage on every backend: a tensor freed or re-pointed after it was handed over
   (FSDP frees unsharded parameters on reshard), a real FakeTensor failing inside the write, check_finite on a
   one-pass stream, and the backend's own default bucket.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from genengine.backends.transformers.engine import TransformersEngine
from genengine.errors import WeightLoadError, WeightsNotLoadedError
from genengine.models.tiny_model import tiny_model_dir
from genengine.protocol import GenerationEngine
from genengine.testing.conformance import GREEDY, PROMPTS, EngineConformance, load_checkpoint

pytestmark = pytest.mark.timeout(300)


class StreamingTransformersEngine(TransformersEngine):
    """The embedded engine writing each bucket as it is checked, as SGLang and vLLM do."""

    validate_all_weights_first = False


# ---- 1. the suite's trainer-tensor tests on a streaming engine ---------------------------------------------------
_TRAINER_TENSOR_TESTS = {
    "test_failure_inside_a_bucket_refuses_until_a_full_load",
    "test_tensors_without_usable_data_are_rejected_before_any_write",
    "test_check_finite_refuses_nan_and_inf_before_any_write",
    "test_buckets_are_at_most_bucket_bytes",
    "test_views_and_bf16_copies_load_like_plain_tensors",
}


class TestTrainerTensorsOnAStreamingEngine(EngineConformance):
    def make_engine(self, model_dir: str, **options: Any) -> GenerationEngine:
        return StreamingTransformersEngine(model_dir, dtype="float32", **options)


for _name in dir(EngineConformance):
    if _name.startswith("test_") and _name not in _TRAINER_TENSOR_TESTS:
        setattr(TestTrainerTensorsOnAStreamingEngine, _name, None)  # pytest collects only callables


# ---- 2. trainer behaviour on the embedded engine ------------------------------------------------------------------
ENGINES = [TransformersEngine, StreamingTransformersEngine]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(tiny_model_dir())


@pytest.fixture(scope="module")
def weights(model_dir: str) -> dict[str, dict[str, Any]]:
    return {"A": load_checkpoint(model_dir), "B": load_checkpoint(tiny_model_dir(seed=1))}


@pytest.fixture(scope="module")
def outputs(model_dir: str, weights: dict[str, dict[str, Any]]) -> dict[str, list[Any]]:
    """Greedy tokens of each model, from engines that loaded nothing else."""
    with TransformersEngine(model_dir, dtype="float32") as engine:
        a = _tokens(engine)
        engine.load_weights(weights["B"])
        return {"A": a, "B": _tokens(engine)}


def _tokens(engine: GenerationEngine) -> list[Any]:
    return [[o.token_ids for o in r.outputs] for r in engine.generate(PROMPTS, GREEDY)]


def _assert_refused_until_a_full_load(engine: GenerationEngine, weights: dict[str, Any], expected: list[Any]) -> None:
    assert not engine.state.weights_loaded
    with pytest.raises(WeightsNotLoadedError, match="failed"):
        engine.generate(PROMPTS, GREEDY)
    engine.load_weights(weights)
    assert _tokens(engine) == expected


def _handing_over(items: list[tuple[str, Any]], at: int, how: str) -> Iterator[tuple[str, Any]]:
    """A trainer streaming its weights that releases tensor ``at`` as soon as it moves on to the next one, while
    the engine still holds it in the bucket being filled (FSDP2's reshard resizes the unsharded storage to 0;
    FSDP1 leaving ``summon_full_params`` points ``.data`` back at the local shard, empty here)."""
    import torch

    for i, (name, tensor) in enumerate(items):
        if i != at:
            yield name, tensor
            continue
        mine = tensor.clone()
        yield name, mine
        if how == "freed":
            mine.untyped_storage().resize_(0)
        else:
            mine.data = torch.empty(0, dtype=mine.dtype)


@pytest.mark.parametrize("how", ["freed", "repointed"])
@pytest.mark.parametrize("engine_type", ENGINES, ids=["all-first", "streaming"])
def test_tensor_released_after_handover_is_rejected_before_its_bucket(
    model_dir: str, weights: dict[str, dict[str, Any]], outputs: dict[str, list[Any]], engine_type: type, how: str
) -> None:
    """Checked again right before its bucket is written: a clean WeightLoadError, not a read of freed memory
    (which can crash the process) or a failed copy half-way through the bucket."""
    items = list(weights["B"].items())
    at = len(items) // 2
    with engine_type(model_dir, dtype="float32") as engine:
        with pytest.raises(WeightLoadError, match=rf"weight '{items[at][0]}' has (no data|shape \(0,\))"):
            engine.load_weights(_handing_over(items, at, how), bucket_bytes=1)
        if engine_type is TransformersEngine:  # all checked first, nothing written
            assert engine.state.weights_loaded and _tokens(engine) == outputs["A"]
        else:  # the buckets before it were written
            _assert_refused_until_a_full_load(engine, weights["B"], outputs["B"])


def _column_major_view(tensor: Any, offset: int, *, short: bool) -> Any:
    """``tensor``'s values as a column-major view at element ``offset`` of a storage that ends exactly at the
    view's last element, or (``short``) one element before it: strides and offset both count in the bytes needed."""
    import torch

    rows, cols = tensor.shape
    base = torch.empty(offset + tensor.numel(), dtype=tensor.dtype)
    view = base[offset:].view(cols, rows).t()  # strides (1, rows): the last element is at offset + numel - 1
    view.copy_(tensor)
    assert not view.is_contiguous() and view.storage_offset() == offset
    if short:
        base.untyped_storage().resize_((offset + tensor.numel() - 1) * tensor.element_size())
    return view


def test_a_storage_one_element_short_of_its_view_is_refused_before_any_read(
    model_dir: str, weights: dict[str, dict[str, Any]], outputs: dict[str, list[Any]]
) -> None:
    """A view whose storage ends one element before the last element its shape, strides and offset reach (a
    storage shrunk under the trainer's tensor): refused by name before anything is read or written, where a
    read would go past the storage. The same view over a storage exactly long enough loads."""
    items = list(weights["B"].items())
    at = next(i for i, (_, t) in enumerate(items) if t.dim() == 2 and t.shape[0] != t.shape[1])
    name, tensor = items[at]
    need = (3 + tensor.numel()) * tensor.element_size()
    with TransformersEngine(model_dir, dtype="float32") as engine:
        short = [*items[:at], (name, _column_major_view(tensor, 3, short=True)), *items[at + 1 :]]
        with pytest.raises(
            WeightLoadError,
            match=rf"weight '{name}' has no data: its storage holds {need - tensor.element_size()} bytes, "
            rf"its shape needs {need} ",
        ):
            engine.load_weights(iter(short))
        assert engine.state.weights_loaded and _tokens(engine) == outputs["A"]  # nothing was written
        engine.load_weights(iter([*items[:at], (name, _column_major_view(tensor, 3, short=False)), *items[at + 1 :]]))
        assert _tokens(engine) == outputs["B"]


@pytest.mark.parametrize("engine_type", ENGINES, ids=["all-first", "streaming"])
def test_real_fake_tensor_fails_inside_the_bucket_and_the_engine_refuses(
    model_dir: str, weights: dict[str, dict[str, Any]], outputs: dict[str, list[Any]], engine_type: type
) -> None:
    """A FakeTensor (a model built under FakeTensorMode) passes every metadata check and fails on copy, in the
    middle of the one bucket: the tensors before it are written, the engine must refuse."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    items = list(weights["B"].items())
    at = len(items) // 2
    name, tensor = items[at]
    with FakeTensorMode():
        fake = torch.empty(tensor.shape, dtype=tensor.dtype)
    items[at] = (name, fake)
    with engine_type(model_dir, dtype="float32") as engine:
        with pytest.raises(AssertionError, match="FakeTensor"):
            engine.load_weights(items)
        _assert_refused_until_a_full_load(engine, weights["A"], outputs["A"])


@pytest.mark.parametrize("engine_type", ENGINES, ids=["all-first", "streaming"])
def test_check_finite_on_a_one_pass_stream(
    model_dir: str, weights: dict[str, dict[str, Any]], outputs: dict[str, list[Any]], engine_type: type
) -> None:
    """NaN in the last tensor of a generator, one tensor per bucket: refused before any write where the whole
    stream is checked first, before its own bucket (so after the others: refused to generate) where it streams."""
    items = list(weights["B"].items())
    name, tensor = items[-1]
    bad = tensor.clone()
    bad.view(-1)[0] = float("nan")
    with engine_type(model_dir, dtype="float32") as engine:
        with pytest.raises(WeightLoadError, match=rf"weight '{name}' holds NaN"):
            engine.load_weights(iter([*items[:-1], (name, bad)]), bucket_bytes=1, check_finite=True)
        if engine_type is TransformersEngine:
            assert engine.state.weights_loaded and _tokens(engine) == outputs["A"]
        else:
            _assert_refused_until_a_full_load(engine, weights["B"], outputs["B"])


def test_none_uses_the_engines_own_default_bucket(model_dir: str, weights: dict[str, dict[str, Any]]) -> None:
    from genengine.testing.conformance.weights import _bucket_count

    sizes = [t.numel() * t.element_size() for t in weights["A"].values()]
    largest = max(sizes)
    with TransformersEngine(model_dir, dtype="float32", bucket_bytes=largest) as engine:
        assert engine.default_bucket_bytes == largest
        report = engine.load_weights(weights["A"])
        assert report.num_buckets == _bucket_count(sizes, largest) > 1
        assert engine.load_weights(weights["A"], bucket_bytes=sum(sizes)).num_buckets == 1


class _InPlaceEmbedded(TransformersEngine):
    """The real embedded engine, told that it reads 1-D tensors in place (as SGLang reads CUDA tensors
    through their IPC handles): those must cost nothing in a bucket."""

    def _bucket_cost(self, tensor: Any, session: Any) -> int:
        return 0 if tensor.dim() == 1 else super()._bucket_cost(tensor, session)


def test_tensors_read_in_place_do_not_count_towards_a_bucket(
    model_dir: str, weights: dict[str, dict[str, Any]]
) -> None:
    from genengine.testing.conformance.weights import _bucket_count

    items = list(weights["A"].items())
    largest = max(t.numel() * t.element_size() for _, t in items)
    copied = [t.numel() * t.element_size() for _, t in items if t.dim() != 1]
    assert len(copied) < len(items)  # the tiny model has norms (1-D) and matrices
    with _InPlaceEmbedded(model_dir, dtype="float32") as engine:
        report = engine.load_weights(items, bucket_bytes=largest)
        assert report.num_tensors == len(items)
        assert report.num_buckets == _bucket_count(copied, largest)
        assert engine.load_weights([(n, t) for n, t in items if t.dim() == 1], bucket_bytes=1).num_buckets == 1
        assert engine.generate(PROMPTS, GREEDY)  # what was loaded in shared buckets is the model


def test_each_tensor_is_checked_once_when_the_whole_source_was_checked_just_before(
    model_dir: str, weights: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list is checked whole right before its buckets are written (no trainer code runs in between), so the
    metadata is read once per tensor; a one-pass stream's tensors are checked again before their bucket (the
    trainer may have released them meanwhile: test_tensor_released_after_handover_is_rejected_before_its_bucket)."""
    from genengine import weights as weights_module

    checked: list[str] = []
    real = weights_module._check_data
    monkeypatch.setattr(weights_module, "_check_data", lambda name, *a: (checked.append(name), real(name, *a))[1])
    items = list(weights["A"].items())
    with StreamingTransformersEngine(model_dir, dtype="float32") as engine:
        engine.load_weights(items, bucket_bytes=1)
        assert sorted(checked) == sorted(n for n, _ in items)
        checked.clear()
        engine.load_weights(iter(items), bucket_bytes=1)
        assert sorted(checked) == sorted(n for n, _ in items for _ in range(2))


def test_a_contiguous_tensor_past_the_end_of_its_storage_is_refused() -> None:
    """The storage bound of a contiguous tensor (computed without a walk over its strides) counts its offset."""
    import torch

    from genengine.weights import check_storage

    base = torch.ones(10)
    view = base[2:]  # contiguous, 8 elements from element 2: needs 40 bytes of storage
    check_storage("w", view)
    base.untyped_storage().resize_(36)
    with pytest.raises(WeightLoadError, match="weight 'w' has no data: its storage holds 36 bytes, its shape needs 40"):
        check_storage("w", view)
