"""The router alone (no Ray): least-loaded choice, stickiness bounded by imbalance, replicas added/removed."""

from __future__ import annotations

import pytest

from genengine.errors import EngineStateError, InvalidArgumentError
from genengine.ray.router import Router, prefix_key


def test_unkeyed_requests_go_to_the_least_loaded_replica() -> None:
    router = Router([0, 1, 2])
    assert [router.pick() for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    router.done(1, 2)  # loads 2, 0, 2
    assert router.pick() == 1 and router.pick(cost=4) == 1  # loads 2, 5, 2
    assert [router.pick(), router.load(1)] == [0, 5]


def test_a_key_sticks_until_its_replica_is_too_busy() -> None:
    router = Router([0, 1], max_imbalance=2)
    first = router.pick("session")
    assert [router.pick("session") for _ in range(2)] == [first, first]  # loads 1 and 2 vs 0: within 2
    assert router.load(first) == 3
    moved = router.pick("session")  # 3 > 0 + 2: balance wins and the key moves
    assert moved != first and router.stats.moved == 1 and router.stats.hits == 2
    assert router.pick("session") == moved


def test_prefix_keys_group_prompts_that_share_a_prefix() -> None:
    assert prefix_key("a" * 300 + "x", length=64) == prefix_key("a" * 300 + "y", length=64)
    assert prefix_key("abc") != prefix_key("abd")
    assert prefix_key(prompt_token_ids=[1, 2, 3]) != prefix_key("1,2,3")
    assert prefix_key(prompt_token_ids=list(range(80)), length=64) == prefix_key(
        prompt_token_ids=[*range(64), 999], length=64
    )
    with pytest.raises(InvalidArgumentError, match="needs a prompt"):
        prefix_key()


def test_replicas_added_and_removed_at_run_time() -> None:
    router = Router([0])
    assert router.pick("k") == 0
    router.add(1)
    assert router.pick() == 1  # the new, idle replica
    router.remove(0)
    assert router.pick("k") == 1 and router.stats.new == 2  # its keys went with it
    with pytest.raises(InvalidArgumentError, match="already routed"):
        router.add(1)
    with pytest.raises(InvalidArgumentError, match=r"replica 7 is not routed to; known: \[1\]"):
        router.remove(7)
    router.remove(1)
    with pytest.raises(EngineStateError, match="the pool has none"):
        router.pick()


def test_excluded_replicas_are_skipped_and_keys_are_bounded() -> None:
    router = Router([0, 1], max_keys=2)
    assert router.pick("a", exclude={0}) == 1
    for key in "bcd":
        router.pick(key)
    assert "a" not in router._keys and len(router._keys) == 2
    with pytest.raises(EngineStateError, match="excluded"):
        router.pick(exclude={0, 1})
    with pytest.raises(InvalidArgumentError, match="max_imbalance=-1"):
        Router(max_imbalance=-1)
