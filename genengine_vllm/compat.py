"""The vLLM releases this plugin was verified against: the one place for that fact.

pyproject's ``vllm`` extra declares exactly this range (tests/test_engine_versions.py holds them equal);
widen it only after both ends have passed the GPU suite and ``verify.sh`` (docs/deployment.md's matrix).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from genengine.backend import VerifiedRange, VersionStatus, check_engine_version

__all__ = ["VERIFIED", "check_installed"]

VERIFIED = VerifiedRange("vllm", minimum="0.26.0", maximum="0.26.0")
"""Verified 2026-12-03 on the H200 with torch 2.11 (docs/deployment.md, "Supported engine versions")."""


def check_installed(options: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> VersionStatus:
    """Refuse an installed vLLM outside ``VERIFIED`` unless the user allows it (see ``check_engine_version``)."""
    return check_engine_version(VERIFIED, options, backend="vllm", environ=environ)
