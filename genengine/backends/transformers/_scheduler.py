"""The embedded backend's decode loop as steps: a batch of rows decoded together, and the scheduler thread that
steps every batch of the async requests in turn, admitting new rows between steps.

``generate`` steps one batch to its end, so the synchronous and async paths sample with the same code.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from genengine.backends.transformers._sampling import buffer_layer_class

if TYPE_CHECKING:
    import torch

    from genengine.backend import DriverLock
    from genengine.backends.transformers._lora import LoraWeights
    from genengine.backends.transformers._sampling import PrefixKey, Row

__all__ = ["DecodeBatch", "Decoder", "Prefix", "Scheduler"]


@dataclass
class Prefix:
    """A prompt's prefill: per-layer keys and values ``[kv_heads, len, head_dim]`` and the next-token logits."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor
    nbytes: int


@dataclass(frozen=True)
class Decoder:
    """What the decode loop needs of the engine, handed in by it: the loop never reaches into the engine."""

    device: torch.device
    max_batch_size: int
    lock: DriverLock
    """The engine's lock: each round runs under it, and lets waiting callers in between rounds."""
    new_cache: Callable[[], Any]
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any, list[LoraWeights | None]], torch.Tensor]
    """``(tokens [batch], allowed [batch, 1, 1, keys], positions [batch], cache, each row's adapter) ->
    next-token logits``."""
    sample: Callable[[torch.Tensor, list[Row]], tuple[torch.Tensor, list[int]]]
    """``(logits, rows) -> (tokens, indices of the rows that go on)``; records each row's token."""
    prefill: Callable[[list[PrefixKey]], dict[PrefixKey, Prefix]]


class DecodeBatch:
    """Rows decoded together, one token per ``step``: left-padded context KV in buffers sized for the whole
    run, written in place.

    Between steps the rows' newest tokens are sampled but not yet fed to the model, so the first step after a
    weight load computes its token from the new weights (the KV of the earlier tokens is what it was, unless
    the scheduler rebuilds the batch from a new prefill).
    """

    def __init__(self, decoder: Decoder, rows: list[Row], prefixes: dict[PrefixKey, Prefix]) -> None:
        import torch

        self.decoder, self.rows = decoder, rows
        contexts = [row.context for row in rows]
        width = max(len(c) for c in contexts)
        capacity = width + max(row.params.max_new_tokens - len(row.out.tokens) for row in rows)
        batch = len(rows)
        keys_of = [row.key for row in rows]
        first = prefixes[keys_of[0]]
        self.cache = decoder.new_cache()
        layers = []
        for layer in range(len(first.keys)):
            kv_heads, _, head_dim = first.keys[layer].shape
            keys = first.keys[layer].new_zeros((batch, kv_heads, capacity, head_dim))
            values = torch.zeros_like(keys)
            for b, (ctx, key) in enumerate(zip(contexts, keys_of, strict=True)):
                entry = prefixes[key]
                keys[b, :, width - len(ctx) : width] = entry.keys[layer]
                values[b, :, width - len(ctx) : width] = entry.values[layer]
            layers.append(buffer_layer_class()(keys, values, width))
        self.cache.layers = layers
        # The attention mask as the attention kernel takes it ([batch, 1, 1, keys]), extended in place.
        allowed = torch.zeros((batch, 1, 1, capacity), dtype=torch.bool)
        for b, ctx in enumerate(contexts):
            allowed[b, :, :, width - len(ctx) : width] = True
        self.allowed = allowed.to(decoder.device)
        self.positions = torch.tensor([len(c) for c in contexts], device=decoder.device)
        self.logits: torch.Tensor | None = torch.stack([prefixes[k].logits for k in keys_of])
        self.unfed: torch.Tensor | None = None
        self.active = list(range(batch))
        self.length = width

    def step(self) -> bool:
        """Sample one token for every live row (feeding the previous ones first); False once none is left."""
        decoder = self.decoder
        gone = {j for j, i in enumerate(self.active) if self.rows[i].out.finish_reason is not None}  # aborted
        if gone:
            self._select([j for j in range(len(self.active)) if j not in gone])
            if not self.active:
                return False
        if self.unfed is not None:
            self.allowed[:, :, :, self.length] = True
            self.length += 1
            allowed, loras = self.allowed[:, :, :, : self.length], [self.rows[i].lora for i in self.active]
            self.logits = decoder.forward(self.unfed, allowed, self.positions, self.cache, loras)
            self.positions = self.positions + 1
        assert self.logits is not None
        live = [self.rows[i] for i in self.active]
        self.unfed, keep = decoder.sample(self.logits, live)
        self.logits = None
        for row in live:
            row.report()
        if len(keep) < len(self.active):
            self._select(keep)
        return bool(self.active)

    def _select(self, keep: list[int]) -> None:
        import torch

        self.active = [self.active[j] for j in keep]
        if not keep:
            return
        index = torch.tensor(keep, device=self.decoder.device)
        self.cache.batch_select_indices(index)
        self.allowed, self.positions = self.allowed[index], self.positions[index]
        if self.unfed is not None:
            self.unfed = self.unfed[index]
        if self.logits is not None:
            self.logits = self.logits[index]

    def live_rows(self) -> list[Row]:
        return [self.rows[i] for i in self.active if self.rows[i].out.finish_reason is None]


class Scheduler:
    """The async requests' decode loop, on its own thread: admits new rows between steps, steps every batch in
    turn, and stops stepping while generation is held. Each round runs under the engine's lock, so the
    synchronous calls (a ``generate``, a weight load, a sleep) land between rounds."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.wakeup = threading.Condition(decoder.lock.lock)
        self.pending: list[Row] = []
        self.batches: list[DecodeBatch] = []
        self.held = False
        self.rebuild = False
        """At the next round, prefill every live row's context again (the KV from the weights now in force)."""
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="genengine-transformers-scheduler")
        self.thread.start()

    def live_rows(self) -> list[Row]:
        return self.pending + [row for b in self.batches for row in b.live_rows()]

    def _run(self) -> None:
        import torch

        while True:
            self.decoder.lock.let_callers_in()
            with self.wakeup:
                while not self.stopping and (self.held or not (self.pending or self.batches)):
                    self.wakeup.wait()
                if self.stopping:
                    return
                try:
                    with torch.inference_mode():
                        self._round()
                except BaseException as exc:
                    self._fail_all(exc)

    def _round(self) -> None:
        decoder = self.decoder
        if self.rebuild:
            self.pending[:0] = [row for b in self.batches for row in b.live_rows()]
            self.batches, self.rebuild = [], False
        if self.pending:
            rows, self.pending = self.pending, []
            prefixes = decoder.prefill(list(dict.fromkeys(row.key for row in rows)))
            rows.sort(key=lambda row: len(row.context))
            size = decoder.max_batch_size
            self.batches.extend(DecodeBatch(decoder, rows[i : i + size], prefixes) for i in range(0, len(rows), size))
        self.batches = [b for b in self.batches if b.step()]

    def _fail_all(self, exc: BaseException) -> None:
        rows = self.live_rows()
        self.pending, self.batches = [], []
        for row in rows:
            if row.sink is not None:
                row.sink.fail(exc)

    def stop(self, exc: BaseException) -> None:
        """End the thread; requests still running fail with ``exc``."""
        with self.wakeup:
            self.stopping = True
            self._fail_all(exc)
            self.wakeup.notify_all()
        self.thread.join()
