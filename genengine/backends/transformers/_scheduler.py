"""The embedded backend's decode loop as steps: a batch of rows decoded together, and the scheduler thread that
steps every batch of the async requests in turn, admitting new rows between steps.

``generate`` steps one batch to its end, so the synchronous and async paths sample with the same code.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from genengine.backends.transformers._sampling import buffer_layer_class

if TYPE_CHECKING:
    import torch

    from genengine.backends.transformers._sampling import Row
    from genengine.backends.transformers.engine import TransformersEngine, _Prefix

__all__ = ["DecodeBatch", "Scheduler"]


class DecodeBatch:
    """Rows decoded together, one token per ``step``: left-padded context KV in buffers sized for the whole
    run, written in place.

    Between steps the rows' newest tokens are sampled but not yet fed to the model, so the first step after a
    weight load computes its token from the new weights (the KV of the earlier tokens is what it was, unless
    the scheduler rebuilds the batch from a new prefill).
    """

    def __init__(self, engine: TransformersEngine, rows: list[Row], prefixes: dict[tuple[int, ...], _Prefix]) -> None:
        import torch

        self.engine, self.rows = engine, rows
        contexts = [row.context for row in rows]
        width = max(len(c) for c in contexts)
        capacity = width + max(row.params.max_new_tokens - len(row.out.tokens) for row in rows)
        batch = len(rows)
        first = prefixes[contexts[0]]
        self.cache = engine._new_cache()
        layers = []
        for layer in range(len(first.keys)):
            kv_heads, _, head_dim = first.keys[layer].shape
            keys = first.keys[layer].new_zeros((batch, kv_heads, capacity, head_dim))
            values = torch.zeros_like(keys)
            for b, ctx in enumerate(contexts):
                entry = prefixes[ctx]
                keys[b, :, width - len(ctx) : width] = entry.keys[layer]
                values[b, :, width - len(ctx) : width] = entry.values[layer]
            layers.append(buffer_layer_class()(keys, values, width))
        self.cache.layers = layers
        # The attention mask as the attention kernel takes it ([batch, 1, 1, keys]), extended in place.
        allowed = torch.zeros((batch, 1, 1, capacity), dtype=torch.bool)
        for b, ctx in enumerate(contexts):
            allowed[b, :, :, width - len(ctx) : width] = True
        self.allowed = allowed.to(engine.device)
        self.positions = torch.tensor([len(c) for c in contexts], device=engine.device)
        self.logits: torch.Tensor | None = torch.stack([prefixes[c].logits for c in contexts])
        self.unfed: torch.Tensor | None = None
        self.active = list(range(batch))
        self.length = width

    def step(self) -> bool:
        """Sample one token for every live row (feeding the previous ones first); False once none is left."""
        engine = self.engine
        gone = {j for j, i in enumerate(self.active) if self.rows[i].out.finish_reason is not None}  # aborted
        if gone:
            self._select([j for j in range(len(self.active)) if j not in gone])
            if not self.active:
                return False
        if self.unfed is not None:
            self.allowed[:, :, :, self.length] = True
            self.length += 1
            out = engine._model(
                input_ids=self.unfed[:, None],
                attention_mask=engine._decode_mask(self.allowed[:, :, :, : self.length]),
                position_ids=self.positions[:, None],
                use_cache=True,
                **{engine._cache_kwarg: self.cache},
            )
            self.logits = out.logits[:, -1].float()
            self.positions = self.positions + 1
        assert self.logits is not None
        live = [self.rows[i] for i in self.active]
        self.unfed, keep = engine._sample(self.logits, live)
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
        index = torch.tensor(keep, device=self.engine.device)
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

    def __init__(self, engine: TransformersEngine) -> None:
        self.engine = engine
        self.wakeup = threading.Condition(engine._lock.lock)
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
            self.engine._lock.let_callers_in()
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
        engine = self.engine
        if self.rebuild:
            self.pending[:0] = [row for b in self.batches for row in b.live_rows()]
            self.batches, self.rebuild = [], False
        if self.pending:
            rows, self.pending = self.pending, []
            prefixes = engine._prefill(list(dict.fromkeys(row.context for row in rows)))
            rows.sort(key=lambda row: len(row.context))
            size = engine.max_batch_size
            self.batches.extend(DecodeBatch(engine, rows[i : i + size], prefixes) for i in range(0, len(rows), size))
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
