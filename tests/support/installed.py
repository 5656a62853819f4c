"""Whether a module is installed, found without importing it or its parent packages.

``pytest.importorskip("verl.workers.rollout.llm_server")`` at a test module's top imports verl (its ``__init__``
imports torch, tensordict, and every plugin's entry point) while pytest collects: both xdist workers paid that,
~1.5-2.5 s of CPU each, for a file that one of them runs (and a GPU file that none runs on the CPU machine)."""

from __future__ import annotations

from importlib.machinery import PathFinder
from importlib.util import find_spec


def installed(name: str) -> bool:
    """Whether ``name`` (dotted) is on the path: each part looked for in its parent's folders, nothing imported."""
    top, *rest = name.split(".")
    spec = find_spec(top)
    found = top
    for part in rest:
        if spec is None or spec.submodule_search_locations is None:
            return False
        found = f"{found}.{part}"
        spec = PathFinder.find_spec(found, list(spec.submodule_search_locations))
    return spec is not None
