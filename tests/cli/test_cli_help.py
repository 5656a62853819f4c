"""The CLI's first-hour behaviour (issue 40, A1 and A7): every option's default in ``--help``, bad input refused
before the tiny model is built, and the plot's optional dependency checked before any work."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from genengine.cli import build_parser, main
from genengine.errors import InvalidArgumentError
from genengine.plugins.registry import available_backends


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    return dict(action.choices)  # type: ignore[arg-type]


def _help_blocks(text: str) -> dict[str, str]:
    """Each option's entry in a ``--help`` text, keyed by its first option string, whitespace collapsed."""
    blocks: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        m = re.match(r"^  (-[-\w]+)", line)
        if m:
            key = m.group(1)
            blocks[key] = line
        elif key is not None and line.startswith("    "):
            blocks[key] += " " + line
        else:
            key = None
    return {k: " ".join(v.split()) for k, v in blocks.items()}


def test_every_subcommand_lists_and_every_option_shows_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    parsers = _subparsers()
    assert {"backends", "generate", "demo", "bench", "topology"} <= set(parsers)
    checked = 0
    for command, parser in parsers.items():
        with pytest.raises(SystemExit):
            main([command, "--help"])
        blocks = _help_blocks(capsys.readouterr().out)
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.required:
                continue  # flags (off unless given), --help, and required options have no default to show
            block = blocks[action.option_strings[0]]
            assert "default" in block, f"genengine {command} --help: {block!r}"
            if isinstance(action.default, (int, float, str)) and not isinstance(action.default, bool):
                assert str(action.default) in block, f"genengine {command} --help: {block!r}"
            checked += 1
    assert checked > 40  # the options of generate, demo, bench and topology


def test_bench_and_demo_have_threads() -> None:
    parsers = _subparsers()
    assert parsers["bench"].parse_args([]).threads is None  # 1 on a machine without CUDA: see below
    assert parsers["bench"].parse_args(["--threads", "3"]).threads == 3
    assert parsers["demo"].parse_args([]).threads == 1


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record calls that are the work a refusal must come before: building the tiny model, starting an engine."""
    import genengine.models.tiny_model
    import genengine.plugins.registry

    calls: list[str] = []

    def recording(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        return recorded

    for module, name in (
        (genengine.models.tiny_model, "tiny_model_dir"),
        (genengine.models.tiny_model, "build_tiny_model"),
        (genengine.plugins.registry, "create_engine"),
    ):
        monkeypatch.setattr(module, name, recording(name, getattr(module, name)))
    return calls


_SGLANG_MISSING = not {b.name: b for b in available_backends()}["sglang"].loadable
BAD_ENGINE_ARGS = [
    (["--backend", "nope"], "unknown backend 'nope'"),
    (["--option", "devcie=cpu"], "did you mean 'device'"),
    (["--option", "device=tpu"], "device='tpu'"),
    (["--dtype", "fp8"], "dtype='fp8'"),
    pytest.param(
        ["--backend", "sglang"],
        "backend 'sglang' is not installed (missing module(s): sglang)",
        marks=pytest.mark.skipif(not _SGLANG_MISSING, reason="sglang is installed here"),
    ),
]


@pytest.mark.parametrize(
    ("argv", "message"), [*BAD_ENGINE_ARGS, (["--tp-size", "2"], "tp_size=2: the transformers backend runs on one")]
)
def test_generate_refuses_before_building_the_model(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40 (A7): these were refused only after the tiny model was built (8-15 s)."""
    work = _spy(monkeypatch)
    assert main(["generate", "hi", *argv]) == 2
    assert message in capsys.readouterr().err
    assert work == []


@pytest.mark.parametrize(
    ("argv", "message"), [*BAD_ENGINE_ARGS, (["--model", "/nonexistent"], "'/nonexistent' is not a model directory")]
)
def test_demo_refuses_before_building_the_model(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    work = _spy(monkeypatch)
    assert main(["demo", "--no-progress", "--no-plot", *argv]) == 2
    assert message in capsys.readouterr().err
    assert work == []


@pytest.mark.parametrize("mode", [[], ["--async"], ["--pool"]])
def test_bench_refuses_an_option_typo_before_building_the_model(
    mode: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    work = _spy(monkeypatch)
    assert main(["bench", "--quiet", *mode, "--option", "devcie=cpu"]) == 2
    assert "did you mean 'device'" in capsys.readouterr().err
    assert work == []


def test_async_demo_refuses_before_building_the_model(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    work = _spy(monkeypatch)
    assert main(["demo", "--async", "--no-plot", "--option", "devcie=cpu"]) == 2
    assert "did you mean 'device'" in capsys.readouterr().err
    assert work == []


# ---- matplotlib missing (issue 40, A1) --------------------------------------------------------------------
@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import matplotlib`` raises ImportError, as where the [plot] extra is not installed."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


TINY_DEMO = ["demo", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "2"]


@pytest.mark.usefixtures("no_matplotlib")
def test_demo_without_matplotlib_runs_and_says_how_to_get_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plot was on by default: the demo ran every step, then died with ModuleNotFoundError."""
    monkeypatch.chdir(tmp_path)
    assert main([*TINY_DEMO, "--no-progress"]) == 0
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if "no reward plot" in line]
    assert len(notes) == 1 and "pip install 'genengine[plot]'" in notes[0], captured.err
    assert "reward: first quarter mean" in captured.out and "plot:" not in captured.out
    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("no_matplotlib")
@pytest.mark.parametrize("command", [[*TINY_DEMO, "--plot"], [*TINY_DEMO, "--async", "--plot"], ["bench", "--plot"]])
def test_an_explicit_plot_without_matplotlib_is_refused_before_any_work(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    work = _spy(monkeypatch)
    assert main([*command, str(tmp_path / "p.png"), "--no-progress" if command[0] == "demo" else "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "pip install 'genengine[plot]'" in err, err
    assert work == []


def test_demo_config_with_a_plot_and_no_matplotlib_is_refused(no_matplotlib: None) -> None:
    from genengine.cli.demos.sync import DemoConfig

    with pytest.raises(InvalidArgumentError, match=r"plot='out/demo_reward.png' needs matplotlib"):
        DemoConfig().check()
    DemoConfig(plot=None).check()


# ---- bench --threads (issue 40, A7) ----------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "want"), [([], 1), (["--threads", "3"], 3)])
def test_bench_measures_with_its_threads(
    argv: list[str], want: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a busy 2-core machine bench took 69 s instead of ~10 s with torch's default threads."""
    import torch

    import genengine.cli.bench

    if torch.cuda.is_available() and not argv:
        pytest.skip("with CUDA the default leaves torch's threads alone")
    seen: list[int] = []

    def fake_run_bench(settings: Any) -> Any:
        seen.append(torch.get_num_threads())
        raise InvalidArgumentError("stopped by the test")

    monkeypatch.setattr(genengine.cli.bench, "run_bench", fake_run_bench)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["bench", "--quiet", *argv]) == 2
        assert seen == [want] and torch.get_num_threads() == 2  # set while measuring, then put back
    finally:
        torch.set_num_threads(before)
    assert "stopped by the test" in capsys.readouterr().err


def test_bench_threads_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--threads", "0"])
    assert info.value.code == 2 and "--threads" in capsys.readouterr().err


def test_int_at_least_takes_whole_numbers_from_the_minimum_up() -> None:
    """The one integer argument type of the CLI and the benchmark scripts: the minimum and above pass; below
    it, or not a whole number, the usage error names the text (and the minimum, or the caller's words)."""
    from genengine.cli.args import int_at_least

    assert int_at_least(0)("0") == 0 and int_at_least(2)("7") == 7
    for bad in ("-1", "1.5", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=f"^{re.escape(repr(bad))}: expected an integer >= 0$"):
            int_at_least(0)(bad)
    with pytest.raises(argparse.ArgumentTypeError, match=r"^--rounds '1': 2 at least \(a median\)$"):
        int_at_least(2, "--rounds {text!r}: {minimum} at least (a median)")("1")
