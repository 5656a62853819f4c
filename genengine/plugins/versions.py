"""The engine versions a plugin was verified against, and the refusal of any other.

An engine (SGLang, vLLM) changes its internal API between releases; a plugin written against one release may
break silently on the next. Each plugin states the range it was verified in (a ``VerifiedRange`` in its
``compat`` module, the one place for that fact), and its settings layer calls ``check_engine_version``
before any process or GPU memory is taken: outside the range is a ``ConfigError`` unless the user opts in
(the engine option ``allow_unverified_version=True`` or ``GENENGINE_ALLOW_UNVERIFIED=1``), which logs a
WARNING instead. The installed version is read from the distribution's metadata; the engine is not imported.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from genengine.config import option_bool
from genengine.errors import ConfigError

__all__ = [
    "ALLOW_UNVERIFIED_ENV",
    "ALLOW_UNVERIFIED_OPTION",
    "VerifiedRange",
    "VersionStatus",
    "check_engine_version",
    "genengine_version",
    "installed_surface",
    "installed_version",
    "recorded_surface",
]

ALLOW_UNVERIFIED_OPTION = "allow_unverified_version"
"""The engine option that turns the refusal of an unverified engine version into a warning."""

ALLOW_UNVERIFIED_ENV = "GENENGINE_ALLOW_UNVERIFIED"
"""The same for every engine of the process (``1``): for faces without options, e.g. LightRFT's."""

_log = logging.getLogger(__name__)


def _version(text: str) -> Any:
    from packaging.version import Version  # light; imported when a version is compared, not with genengine

    return Version(text)


def _public(text: str) -> Any:
    """The version without its local label: ``0.26.0+cu130`` is the 0.26.0 release, built for CUDA 13."""
    return _version(_version(text).public)


@dataclass(frozen=True)
class VerifiedRange:
    """The releases of ``distribution`` a plugin was verified against: ``minimum`` to ``maximum``, both
    included (equal when one release is verified). Local labels (``+cu130``) are ignored; pre-releases of
    ``minimum`` are outside."""

    distribution: str
    minimum: str
    maximum: str

    def __post_init__(self) -> None:
        if _version(self.minimum) > _version(self.maximum):
            raise ValueError(f"VerifiedRange({self.distribution!r}): minimum {self.minimum} > maximum {self.maximum}")

    def contains(self, version: str) -> bool:
        """Whether ``version`` is in the range; a version that does not parse is not."""
        from packaging.version import InvalidVersion

        try:
            return bool(_version(self.minimum) <= _public(version) <= _version(self.maximum))
        except InvalidVersion:
            return False

    @property
    def requirement(self) -> str:
        """The pip requirement declaring exactly this range (what the package's extra must say)."""
        if self.minimum == self.maximum:
            return f"{self.distribution}=={self.minimum}"
        return f"{self.distribution}>={self.minimum},<={self.maximum}"

    def __str__(self) -> str:
        if self.minimum == self.maximum:
            return f"{self.distribution} {self.minimum}"
        return f"{self.distribution} {self.minimum} to {self.maximum}"


@dataclass(frozen=True)
class VersionStatus:
    """The installed engine version against a plugin's verified range (``installed`` None: not installed)."""

    verified: VerifiedRange
    installed: str | None

    @property
    def in_range(self) -> bool | None:
        """True/False, or None when the engine is not installed (nothing to judge)."""
        return None if self.installed is None else self.verified.contains(self.installed)


def genengine_version() -> str:
    """genengine's own version, from its metadata (one place for it: pyproject.toml)."""
    return installed_version("genengine") or "0+unknown"  # a source tree on sys.path that was never installed


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` from its metadata (no import), or None if not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def recorded_surface(package: str, version: str) -> dict[str, Any] | None:
    """The API surface of an engine release recorded in a plugin (``PACKAGE/surfaces/VERSION.json``, made by
    ``tools/engine_surface.py``), or None when none was recorded: one reader for every plugin's ``compat``."""
    path = resources.files(package).joinpath("surfaces", f"{version}.json")
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def installed_surface(package: str, verified: VerifiedRange) -> dict[str, Any]:
    """The recorded surface of the installed engine release (its version read from metadata, the engine not
    imported), else, when it is not installed or has none recorded, that of the newest verified release: what
    a plugin reads where the engine cannot be imported (its settings' field names)."""
    installed = installed_version(verified.distribution)
    data = (recorded_surface(package, installed) if installed else None) or recorded_surface(package, verified.maximum)
    if data is None:
        raise RuntimeError(f"{package}/surfaces/{verified.maximum}.json is missing from the install")
    return data


def check_engine_version(
    verified: VerifiedRange,
    options: Mapping[str, Any],
    *,
    backend: str,
    environ: Mapping[str, str] | None = None,
) -> VersionStatus:
    """Refuse an installed engine outside ``verified`` (a ``ConfigError`` naming the installed version, the
    range and the override), or, when ``options[ALLOW_UNVERIFIED_OPTION]`` or ``$GENENGINE_ALLOW_UNVERIFIED``
    is true, log a WARNING naming what is unverified. An engine that is not installed passes: starting it
    reports that. Call it before any process or GPU memory is taken."""
    by_option = option_bool(ALLOW_UNVERIFIED_OPTION, options.get(ALLOW_UNVERIFIED_OPTION, False))
    status = VersionStatus(verified, installed_version(verified.distribution))
    if status.in_range is not False:
        return status
    env = os.environ if environ is None else environ
    raw_env = env.get(ALLOW_UNVERIFIED_ENV, "").strip().lower()
    if raw_env not in ("", "0", "1", "true", "false", "yes", "no"):
        raise ConfigError(f"{ALLOW_UNVERIFIED_ENV}={raw_env!r}: allowed are 1/true/yes or 0/false/no")
    allowed = by_option or raw_env in ("1", "true", "yes")
    what = (
        f"the {backend} backend was verified with {verified}, but {verified.distribution} {status.installed} "
        "is installed"
    )
    if not allowed:
        raise ConfigError(
            f"{what}; install it with `pip install '{verified.requirement}'`, or, to run unverified at your own "
            f"risk, pass the engine option {ALLOW_UNVERIFIED_OPTION}=True or set {ALLOW_UNVERIFIED_ENV}=1"
        )
    why = f"{ALLOW_UNVERIFIED_OPTION}=True" if by_option else f"{ALLOW_UNVERIFIED_ENV}=1"
    _log.warning("genengine: %s: running it unverified, as %s asks", what, why)
    return status
