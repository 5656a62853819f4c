"""The old name of :mod:`genengine_sglang.settings`, kept only because ``tests/test_examples.py`` (outside this
plugin) still imports ``settings_from_config`` from here; delete this module once it imports
``genengine_sglang.settings.resolve_settings``."""

from __future__ import annotations

from genengine_sglang.settings import resolve_settings as settings_from_config

__all__ = ["settings_from_config"]
