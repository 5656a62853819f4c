"""The RL demo: the reward rises through generate → sleep → train → wake → load_weights, and a plot is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from genengine.cli import main
from genengine.cli.demos.sync import DemoConfig, run_demo
from genengine.errors import InvalidArgumentError


def test_reward_rises_and_the_plot_is_written(tmp_path: Path) -> None:
    plot = tmp_path / "reward.png"
    lines: list[str] = []
    result = run_demo(DemoConfig(steps=12, lr=3e-3, plot=str(plot), progress=False), echo=lines.append)
    assert len(result.steps) == 12
    assert result.last_quarter > result.first_quarter + 0.3, [s.reward for s in result.steps]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and result.plot == str(plot)
    first = result.steps[0]
    assert first.logprob_gap < 1e-4, "float32 engine and trainer agree on the rollout logprobs"
    assert all(s.sync_ms > 0 and s.tokens_per_s > 0 for s in result.steps)
    freed = [s.freed_bytes for s in result.steps]
    assert sorted(freed)[len(freed) // 2] > 4 << 20, f"a level-2 sleep gives the weights' 5.8 MB back: {freed}"
    assert lines[1].split() == ["step", "reward", "tokens/s", "sync", "ms", "sleep", "freed", "|Δlogp|"]
    assert lines[-1].startswith("reward: first quarter mean")
    assert len(lines) == 12 + 3


@pytest.mark.parametrize(
    "changes", [{"steps": 0}, {"group_size": 1}, {"lr": -1.0}, {"sleep_level": 3}, {"max_new_tokens": 1.5}]
)
def test_bad_settings_are_rejected_before_anything_runs(changes: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        run_demo(DemoConfig(**changes))  # type: ignore[arg-type]


def test_cli_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "demo.png"
    argv = ["demo", "--steps", "3", "--prompts-per-step", "2", "--group-size", "2", "--plot", str(plot)]
    assert main([*argv, "--no-progress", "--sleep-level", "1"]) == 0
    out = capsys.readouterr().out
    assert "reward: first quarter mean" in out and plot.exists()


def test_async_demo_learns_with_rollouts_one_version_ahead(tmp_path: Path) -> None:
    from genengine.cli.demos.asynchronous import run_async_demo

    plot = tmp_path / "async.png"
    lines: list[str] = []
    both = run_async_demo(
        DemoConfig(steps=16, lr=3e-3, plot=str(plot), progress=False), with_sync=False, echo=lines.append
    )
    result = both.rollout
    assert both.sync is None and len(result.steps) == 16
    # Which groups finish first depends on timing, so the run is not reproducible; the rise was 0.95-1.0 at
    # 16 steps (on a busy 2-core machine too), where plain PPO against the stale logprobs reached 0.3-0.6.
    assert result.last_quarter > result.first_quarter + 0.5, [s.reward for s in result.steps]
    assert all(s.sync_ms > 0 and s.tokens_per_s > 0 for s in result.steps)
    assert result.steps[0].logprob_gap < 1e-4, "the first batch is on-policy: engine and trainer agree"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and both.plot == str(plot)
    assert lines[-1].startswith("async reward: first quarter mean")


def test_cli_demo_async(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "both.png"
    argv = ["demo", "--async", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--plot", str(plot)]
    assert main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "async reward: first quarter mean" in out and "sync run:" in out and plot.exists()
