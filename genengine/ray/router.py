"""Which replica serves a request: the least-loaded one, unless the request's session or prompt prefix was
served by a replica that is not much busier (then that one, whose prefix cache holds the prompt).

Pure Python and no Ray, so it is tested and benchmarked on its own (benchmarks/ray_router.py).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from genengine.errors import EngineStateError, InvalidArgumentError

__all__ = ["Router", "RouterStats", "prefix_key"]


def prefix_key(prompt: str | None = None, prompt_token_ids: Sequence[int] | None = None, *, length: int = 64) -> str:
    """A stickiness key for a prompt: its first ``length`` tokens (or ``4 * length`` characters of text).

    Prompts that share that prefix (a GRPO group, a multi-turn conversation growing turn by turn) map to
    the same key, so they reach the replica whose prefix cache already holds it.
    """
    if prompt_token_ids is not None:
        data = b"t" + ",".join(str(int(t)) for t in list(prompt_token_ids)[:length]).encode()
    elif prompt is not None:
        data = b"s" + prompt[: 4 * length].encode("utf-8", "surrogatepass")
    else:
        raise InvalidArgumentError("prefix_key needs a prompt or prompt_token_ids")
    return hashlib.blake2b(data, digest_size=12).hexdigest()


@dataclass
class RouterStats:
    """Counts since the router was made: ``hits`` went to the replica their key was stuck to, ``moved`` had a
    key whose replica was too busy (or excluded), ``new`` a key not known (first seen, or its replica was
    removed), ``unkeyed`` none."""

    hits: int = 0
    moved: int = 0
    new: int = 0
    unkeyed: int = 0
    work: dict[int, int] = field(default_factory=dict)
    """Units of work (``cost``) sent to each replica."""

    @property
    def hit_rate(self) -> float:
        """Hits among the keyed requests that had been seen before."""
        seen = self.hits + self.moved
        return self.hits / seen if seen else 0.0


class Router:
    """Least-loaded routing with session/prefix stickiness over a changing set of replica ids.

    ``load`` is the work assigned and not yet finished (``pick`` adds ``cost``, ``done`` takes it off). A key
    sticks to its replica while that replica's load stays within ``max_imbalance`` of the least-loaded one;
    past that, balance wins and the key moves. Thread-safe.
    """

    def __init__(self, replicas: Iterable[int] = (), *, max_imbalance: int = 8, max_keys: int = 100_000) -> None:
        if isinstance(max_imbalance, bool) or not isinstance(max_imbalance, int) or max_imbalance < 0:
            raise InvalidArgumentError(f"max_imbalance={max_imbalance!r} must be an integer >= 0")
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
            raise InvalidArgumentError(f"max_keys={max_keys!r} must be an integer >= 1")
        self.max_imbalance = max_imbalance
        self.max_keys = max_keys
        self.stats = RouterStats()
        self._lock = threading.Lock()
        self._load: dict[int, int] = {}
        self._keys: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._owned: dict[int, int] = {}  # replica -> number of keys stuck to it
        for replica in replicas:
            self.add(replica)

    @property
    def replicas(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._load))

    def load(self, replica: int) -> int:
        with self._lock:
            return self._load[replica]

    def add(self, replica: int) -> None:
        """Route to ``replica`` from now on."""
        with self._lock:
            if replica in self._load:
                raise InvalidArgumentError(f"replica {replica} is already routed to")
            self._load[replica] = 0
            self._owned[replica] = 0

    def remove(self, replica: int) -> None:
        """Stop routing to ``replica``; its keys go to other replicas next time they come."""
        with self._lock:
            if replica not in self._load:
                raise InvalidArgumentError(f"replica {replica} is not routed to; known: {sorted(self._load)}")
            del self._load[replica], self._owned[replica]
            for key in [k for k, r in self._keys.items() if r == replica]:
                del self._keys[key]

    def pick(self, key: str | None = None, *, cost: int = 1, exclude: Collection[int] = ()) -> int:
        """The replica for one request of ``cost`` units of work (its ``n``), counted in its load until ``done``."""
        with self._lock:
            candidates = [r for r in self._load if r not in exclude]
            if not candidates:
                raise EngineStateError(
                    f"no replica to route to (replicas {sorted(self._load)}, excluded {sorted(set(exclude))})"
                    if self._load
                    else "no replica to route to: the pool has none"
                )
            least = min(candidates, key=lambda r: (self._load[r], self._owned[r], r))
            chosen = least
            if key is None:
                self.stats.unkeyed += 1
            else:
                stuck = self._keys.get(key)
                if stuck is not None and stuck in candidates:
                    if self._load[stuck] <= self._load[least] + self.max_imbalance:
                        chosen = stuck
                        self.stats.hits += 1
                    else:
                        self.stats.moved += 1
                elif key in self._keys:
                    self.stats.moved += 1
                else:
                    self.stats.new += 1
                self._stick(key, chosen)
            self._load[chosen] += cost
            self.stats.work[chosen] = self.stats.work.get(chosen, 0) + cost
            return chosen

    def done(self, replica: int, cost: int = 1) -> None:
        """``cost`` units of work on ``replica`` finished (or failed); a removed replica is ignored."""
        with self._lock:
            if replica in self._load:
                self._load[replica] = max(0, self._load[replica] - cost)

    def _stick(self, key: str, replica: int) -> None:
        old = self._keys.pop(key, None)
        if old is not None and old in self._owned:
            self._owned[old] -= 1
        self._keys[key] = replica
        self._owned[replica] += 1
        while len(self._keys) > self.max_keys:
            _, evicted = self._keys.popitem(last=False)
            if evicted in self._owned:
                self._owned[evicted] -= 1
