"""The messages docs/failure-modes.md shows are the ones the code raises, on the embedded engine.

The page once gave ``generate``'s asleep message for ``load_weights`` while asleep (issue 15): each row of its
wrong-state table and each line of its bad-input example is produced here and compared with the page.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from genengine import errors
from genengine.backends.transformers.engine import TransformersEngine
from genengine.models.tiny_model import tiny_model_dir
from genengine.testing.conformance import load_checkpoint

PAGE = Path(__file__).resolve().parents[2] / "docs" / "failure-modes.md"
GREEDY = {"temperature": 0.0, "max_new_tokens": 1}


def _section(heading: str) -> str:
    text = PAGE.read_text(encoding="utf-8")
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _state_rows() -> dict[str, tuple[str, str]]:
    """Situation -> (exception, message) of the wrong-state table, code marks stripped."""
    rows = {}
    for line in _section("Generating in the wrong state").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("Situation", "---"):
            rows[cells[0]] = (cells[1].strip("`"), cells[2].strip("`"))
    return rows


def _bad_input_lines() -> list[tuple[str, str]]:
    block = _section("Bad input").split("**What you see.**", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    return [tuple(line.split(": ", 1)) for line in block.splitlines() if line]  # type: ignore[misc]


@pytest.fixture(scope="module")
def engine() -> Iterator[TransformersEngine]:
    with TransformersEngine(str(tiny_model_dir()), dtype="float32") as eng:
        yield eng


def _asleep_generate(e: TransformersEngine) -> Any:
    e.sleep(1)
    try:
        return e.generate(["Hello"], GREEDY)
    finally:
        e.wake()


def _asleep_load(e: TransformersEngine) -> Any:
    e.sleep(1)
    try:
        return e.load_weights(load_checkpoint(tiny_model_dir()).items())
    finally:
        e.wake()


def _after_level_2(e: TransformersEngine) -> Any:
    e.sleep(2)
    e.wake()
    try:
        return e.generate(["Hello"], GREEDY)
    finally:
        e.load_weights(load_checkpoint(tiny_model_dir()).items())


def _after_shutdown(e: TransformersEngine) -> Any:
    other = TransformersEngine(str(tiny_model_dir()), dtype="float32")
    other.shutdown()
    return other.generate(["Hello"], GREEDY)


def _shutdown_twice(e: TransformersEngine) -> Any:
    other = TransformersEngine(str(tiny_model_dir()), dtype="float32")
    other.shutdown()
    other.shutdown()


SITUATIONS: dict[str, Callable[[TransformersEngine], Any]] = {
    "`generate` while asleep": _asleep_generate,
    "`load_weights` while the weights are asleep": _asleep_load,
    "`generate` after a level-2 sleep, before the weights came back": _after_level_2,
    "any call after `shutdown()`": _after_shutdown,
    "`shutdown()` twice": _shutdown_twice,
}


def test_every_wrong_state_row_is_checked() -> None:
    assert set(_state_rows()) == set(SITUATIONS)


@pytest.mark.parametrize("situation", list(SITUATIONS))
def test_wrong_state_message_is_the_code_s(engine: TransformersEngine, situation: str) -> None:
    exception, message = _state_rows()[situation]
    if exception.startswith("none"):
        SITUATIONS[situation](engine)
        return
    with pytest.raises(getattr(errors, exception)) as info:
        SITUATIONS[situation](engine)
    pattern = ".*".join(re.escape(part) for part in message.split("…"))
    assert re.match(pattern, str(info.value)), f"docs say {message!r}, the code says {str(info.value)!r}"
    assert not engine.is_sleeping and engine.state.weights_loaded


BAD_INPUTS: list[Callable[[TransformersEngine], Any]] = [  # in the page's order
    lambda e: e.generate(["", "b"]),
    lambda e: e.generate(["ok", "a\ud800"]),
    lambda e: e.generate(prompt_token_ids=[[1, e.model.config.vocab_size]]),
    lambda e: e.generate(prompt_token_ids=[[7] * 5000], sampling_params={"max_new_tokens": 1}),
    lambda e: e.generate(["hi"], {"top_p": 0.0}),
]


def test_bad_input_examples_are_the_code_s(engine: TransformersEngine) -> None:
    lines = _bad_input_lines()
    assert len(lines) == len(BAD_INPUTS)
    for (exception, message), call in zip(lines, BAD_INPUTS, strict=True):
        with pytest.raises(getattr(errors, exception)) as info:
            call(engine)
        assert str(info.value) == message
