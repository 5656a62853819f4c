"""Shared test setup: offline, quiet, and the tiny model built once per session."""

from __future__ import annotations

import os

for _key, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)
