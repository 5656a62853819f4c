"""A check both TRL async sync tests make (over an engine, and over the Ray pool)."""

from __future__ import annotations

from typing import Any


def assert_groups_tagged_with_their_oldest_weights(samples: list[Any], streams: dict[str, Any]) -> None:
    """Versions 0 and 1 both sampled, some completion spans the sync, and each group carries the oldest weight
    version that sampled any of its tokens (its stalest token's)."""
    assert {s.model_version for s in samples} == {0, 1}
    spans = {
        s.group_id: [o.weight_versions for o in streams[f"trl-async-{s.group_id}"].result().outputs] for s in samples
    }
    assert any(len(v) > 1 for group in spans.values() for v in group), "no queued sample spans the sync"
    for s in samples:
        assert s.model_version == min(version for v in spans[s.group_id] for _, version in v)
