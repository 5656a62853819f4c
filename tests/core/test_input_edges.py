"""Edges of the input contract on the embedded engine (issues 15 and 20): each refused with an
``InvalidArgumentError`` naming the value before any work, the engine usable afterwards; or accepted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from genengine.backends.transformers.engine import TransformersEngine
from genengine.errors import InvalidArgumentError
from genengine.models.tiny_model import tiny_model_dir
from genengine.protocol import TAG_KV_CACHE, TAG_WEIGHTS, GenerationResult

GREEDY = {"temperature": 0.0, "max_new_tokens": 3}


@pytest.fixture(scope="module")
def engine() -> Iterator[TransformersEngine]:
    with TransformersEngine(str(tiny_model_dir()), dtype="float32") as eng:
        yield eng


def _tokens(results: list[GenerationResult]) -> list[list[int]]:
    return [o.token_ids for r in results for o in r.outputs]


def test_token_id_at_the_vocabulary_size_is_refused(engine: TransformersEngine) -> None:
    vocab = engine.model.config.vocab_size
    assert engine.model.get_input_embeddings().weight.shape[0] == vocab  # vocab_size - 1 is the last real row
    last = engine.generate(prompt_token_ids=[[1, vocab - 1]], sampling_params=GREEDY)
    assert len(last[0].outputs[0].token_ids) == 3
    for bad in (vocab, vocab + 1, 2**63):
        with pytest.raises(InvalidArgumentError) as info:
            engine.generate(prompt_token_ids=[[1, 2], [3, bad]], sampling_params=GREEDY)
        assert str(info.value) == f"prompt_token_ids[1] holds {bad}, outside the vocabulary [0, {vocab})"
    assert _tokens(engine.generate(prompt_token_ids=[[1, vocab - 1]], sampling_params=GREEDY)) == _tokens(last)


def test_numpy_and_torch_prompts_generate_as_lists_do(engine: TransformersEngine) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    ids = [[5, 6, 7], [8, 9, 10]]
    want = _tokens(engine.generate(prompt_token_ids=ids, sampling_params=GREEDY))
    params = {"temperature": np.float32(0.0), "max_new_tokens": np.int64(3), "top_p": np.float32(0.5)}
    for given in (np.array(ids), torch.tensor(ids), [torch.tensor(row) for row in ids]):
        results = engine.generate(prompt_token_ids=given, sampling_params=params)
        assert _tokens(results) == want
        assert [r.prompt_token_ids for r in results] == ids


def test_wake_with_an_empty_list_is_a_no_op(engine: TransformersEngine) -> None:
    """Issue 15: ``wake([])`` raised; like waking an awake tag, it now wakes nothing."""
    before = _tokens(engine.generate(["Hello"], GREEDY))
    engine.wake([])  # awake: nothing to do
    assert not engine.is_sleeping
    engine.sleep(1)
    try:
        engine.wake([])
        engine.wake(())
        assert engine.state.released_tags == {TAG_WEIGHTS, TAG_KV_CACHE}
    finally:
        engine.wake()
    assert _tokens(engine.generate(["Hello"], GREEDY)) == before


@pytest.mark.parametrize(("tags", "fragment"), [(5, "tags=5"), ([["weights"]], "[['weights']]"), ([1], "[1]")])
def test_wake_refuses_non_tags_by_name(engine: TransformersEngine, tags: object, fragment: str) -> None:
    """Was a TypeError (``set(5)``, an unhashable list) or an unclear message."""
    engine.sleep(1)
    try:
        with pytest.raises(InvalidArgumentError) as info:
            engine.wake(tags)  # type: ignore[arg-type]
        assert fragment in str(info.value) and "['weights', 'kv_cache']" in str(info.value)
        assert engine.state.released_tags == {TAG_WEIGHTS, TAG_KV_CACHE}, "nothing was woken"
    finally:
        engine.wake()


def test_abort_ids_are_none_an_id_or_a_list_of_ids() -> None:
    """``abort``'s argument, read once for an engine and a pool (the conformance suite calls both)."""
    from genengine.engine.aio import normalize_request_ids

    assert normalize_request_ids(None) is None
    assert normalize_request_ids("r-1") == ["r-1"]  # one id, not its characters
    assert normalize_request_ids(["a", 7]) == ["a", "7"] and normalize_request_ids(()) == []
    for bad in (7, {"a"}, 2.5):
        with pytest.raises(InvalidArgumentError, match=r"^request_ids=.*: allowed are None, an id, or a list of ids$"):
            normalize_request_ids(bad)  # type: ignore[arg-type]
