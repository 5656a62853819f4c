"""Tests never reach a model hub: every model is a tiny random one built locally."""

from __future__ import annotations

import os

for _key, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)
