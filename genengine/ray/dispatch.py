"""``Dispatch``: which replica serves each request, and the pool's batched ``generate``.

Routing keys come from a request's session id, else its prompt prefix; the fleet's router picks the replica
(``Fleet.pick``) and its load is released when the request ends there (``Fleet.release``). Importing this module
imports neither Ray nor torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from genengine.errors import InvalidArgumentError, WeightsNotLoadedError
from genengine.protocol import GenerationResult
from genengine.ray.fleet import Fleet
from genengine.ray.lifecycle import Lifecycle
from genengine.ray.router import prefix_key
from genengine.requests import Request

__all__ = ["Dispatch"]

_log = logging.getLogger("genengine.ray.pool")  # one logger for the pool and its parts


class Dispatch:
    """Routes requests over ``fleet``'s replicas (restoring the ones back first, through ``lifecycle``)."""

    def __init__(self, fleet: Fleet, lifecycle: Lifecycle) -> None:
        self.fleet = fleet
        self.lifecycle = lifecycle

    def route(self, work: list[tuple[str | None, int]], ids: list[int]) -> dict[int, list[int]]:
        """``ids[j]`` (of key and cost ``work[j]``) grouped by the replica the router picks for each; restores
        the replicas that are back first, and waits for one when none is routed to."""
        fleet = self.fleet
        self.lifecycle.recover()
        if not fleet.routed:
            self.lifecycle.recover(wait=True)
        waiting = [r for r in fleet.active() if r.needs_weights]
        if not fleet.routed and waiting:
            raise WeightsNotLoadedError(
                f"no replica takes traffic: {', '.join(r.where for r in waiting)} wait(s) for the next "
                "load_weights (restored without a source of the current weights, or a failed sync left a mix)"
            )
        if not fleet.routed:
            fleet.check_dead()
        groups: dict[int, list[int]] = {}
        for (key, cost), i in zip(work, ids, strict=True):
            groups.setdefault(fleet.pick(key, cost), []).append(i)
        return groups

    def keys(self, requests: list[Request], session_id: str | Sequence[str | None] | None) -> list[str | None]:
        """Each request's routing key: its session id, else its prompt prefix (``prefix_tokens``)."""
        length = self.fleet.options.prefix_tokens
        if session_id is None:
            return [prefix_key(r.prompt, r.prompt_token_ids, length=length) for r in requests]
        if isinstance(session_id, str):
            return [session_id] * len(requests)
        ids = list(session_id)
        if len(ids) != len(requests) or not all(s is None or isinstance(s, str) for s in ids):
            raise InvalidArgumentError(
                f"session_id={session_id!r}: give one string for every prompt, or a list of {len(requests)} "
                "strings (or None)"
            )
        return [
            s if s is not None else prefix_key(r.prompt, r.prompt_token_ids, length=length)
            for s, r in zip(ids, requests, strict=True)
        ]

    def generate(self, requests: list[Request], keys: list[str | None]) -> list[GenerationResult]:
        """Each request on the replica the router picks for its key, batched per replica; a replica that refused
        as restarted (it did nothing) has its requests sent elsewhere, one that died too while the options'
        ``request_retries`` allow."""
        fleet = self.fleet
        results: list[GenerationResult | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        retries = 0
        while todo:
            groups = self.route([(keys[i], requests[i].params.n) for i in todo], todo)
            calls, charges = [], {}
            for index, members in groups.items():
                replica = fleet.replicas[index]
                charges[index] = (replica.incarnation, sum(requests[i].params.n for i in members))
                calls.append((replica, replica.generate([requests[i] for i in members])))
            todo, died = [], False
            errors: list[BaseException] = []
            for o in fleet.wait("generate", calls, fleet.options.request_timeout_s):
                members = groups[o.replica.index]
                incarnation, cost = charges[o.replica.index]
                fleet.release(o.replica, incarnation, cost)
                if o.stale:
                    todo += members  # it did nothing: send its prompts elsewhere
                elif o.died and retries < fleet.options.request_retries:
                    _log.warning("%s; sending its %d prompt(s) to another replica", o.error, len(members))
                    todo, died = todo + members, True
                elif o.error is not None:
                    errors.append(o.error)
                else:
                    for i, result in zip(members, o.value, strict=True):
                        results[i] = result
            if errors:
                raise errors[0]
            retries += died
        return [r for r in results if r is not None]
