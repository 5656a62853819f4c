"""Optional dependencies, checked before any work: a missing one is found in a second, not after a run."""

from __future__ import annotations

__all__ = ["PLOT_INSTALL", "plot_unavailable"]

PLOT_INSTALL = "pip install 'genengine[plot]'"
"""How to get what the plots need (matplotlib)."""


def plot_unavailable() -> str | None:
    """None when matplotlib imports; else why it does not (the ImportError's text)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return str(exc) or "matplotlib cannot be imported"
    return None
