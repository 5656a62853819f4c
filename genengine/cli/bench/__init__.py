"""``genengine bench``: what one backend costs an RL step, measured through the protocol only.

Four numbers decide whether a rollout engine fits colocated RL: generation throughput (beside the raw
engine, so the protocol's overhead is visible), the time to take the trainer's weights (bucketed, and one
call per parameter as LightRFT and OpenRLHF do), how much memory ``sleep`` really gives back, and how
long each ``wake`` stage takes. Every number comes from ``GenerationEngine`` calls, so any registered
backend (or an engine class given as ``module:Class``) is measured the same way.

The measuring (and how memory is read) is in :mod:`genengine.cli.bench.measure`, the table and plot in
:mod:`genengine.cli.bench.report`.
"""

from genengine.cli.bench.measure import BenchSettings, run_bench
from genengine.cli.bench.report import format_report, plot_report

__all__ = ["BenchSettings", "format_report", "plot_report", "run_bench"]
