"""``EngineBase``: the contract's state machine and checks, written once for every backend.

A backend subclasses it and fills in a handful of ``_methods`` that talk to its engine; argument
checks, the sleep/wake/load state machine, bucketing and the errors trainers see all live here, so
every backend behaves the same way (and the conformance suite tests this one implementation through
each of them).
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from genengine.engine.adapters import AdapterHost
from genengine.engine.hooks import check_hook_signatures, generate_check_value
from genengine.errors import (
    EngineClosedError,
    EngineSleepingError,
    EngineStateError,
    InvalidArgumentError,
    WeightsNotLoadedError,
)
from genengine.protocol import (
    TAG_KV_CACHE,
    TAG_WEIGHTS,
    EngineState,
    GenerationResult,
    LoadReport,
)
from genengine.requests import Request, normalize_requests
from genengine.weights import (
    DEFAULT_BUCKET_BYTES,
    WeightInfo,
    WeightValidator,
    check_load_options,
    check_named_tensors,
    iter_buckets,
    tensor_nbytes,
)

if TYPE_CHECKING:
    from types import TracebackType

    import torch

    from genengine.engine.ipc import PassOn

__all__ = ["EngineBase", "LoadSession"]


class EngineBase(AdapterHost, abc.ABC):
    """Shared implementation of :class:`genengine.protocol.GenerationEngine` (and, for a backend that declares
    ``supports_adapters``, of :class:`genengine.adapters.SupportsAdapters`: see ``AdapterHost``)."""

    supported_tags: tuple[str, ...] = (TAG_WEIGHTS, TAG_KV_CACHE)
    supports_images: ClassVar[bool] = False
    validate_all_weights_first: ClassVar[bool] = False
    """True makes each ``load_weights`` call all-or-nothing by checking the whole stream before writing."""
    wake_before_shutdown: ClassVar[bool] = False
    """True wakes every released tag before ``_shutdown``: for engines that cannot free memory they unmapped
    for sleep (vLLM's allocator would hit a CUDA error that poisons later allocations). ``_shutdown`` runs
    even when that wake fails, with ``released_tags`` still set, so that it can skip freeing what is unmapped."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_hook_signatures(cls)

    def __init__(self, *, sleep_enabled: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise InvalidArgumentError(f"bucket_bytes={bucket_bytes!r} must be a positive integer")
        self.__sleep_enabled = sleep_enabled
        self.__bucket_bytes = bucket_bytes
        self.__released: set[str] = set()
        self.__level: int | None = None
        self.__missing: set[str] = set()
        self.__broken_reason: str | None = None
        self.__flush_pending = False
        self.__closed = False
        self.__weight_version = 0
        self.__session: LoadSession | None = None

    # ---- what a backend implements --------------------------------------------------------------------
    @abc.abstractmethod
    def _generate(self, requests: list[Request]) -> list[GenerationResult]:
        """Run validated requests; the engine is awake with valid weights."""

    @abc.abstractmethod
    def _release(self, level: int) -> None:
        """Free every tag's memory (level 1 backs weights up to host memory first); return once it is free."""

    @abc.abstractmethod
    def _resume(self, tags: tuple[str, ...]) -> None:
        """Take back memory for ``tags`` (already filtered to released ones, in ``supported_tags`` order)."""

    @abc.abstractmethod
    def _weight_spec(self) -> Mapping[str, WeightInfo]:
        """Every HF weight name the engine takes, with shape and dtype."""

    @abc.abstractmethod
    def _apply_weights(self, bucket: list[tuple[str, torch.Tensor]], session: LoadSession) -> None:
        """Write one validated bucket into the engine: plain contiguous tensors (DTensors already gathered).
        ``session`` is the load it belongs to: its ``mode`` (the backend's own way of loading, given by the
        backend's own load call; None: its default) and ``pass_on`` (set by a transport receiver whose tensors
        lie in another process's memory)."""

    @abc.abstractmethod
    def _flush_cache(self) -> None: ...

    @abc.abstractmethod
    def _shutdown(self) -> None: ...

    def _vocab_size(self) -> int | None:
        return None

    def _bucket_cost(self, tensor: torch.Tensor, session: LoadSession) -> int:
        """Bytes ``_apply_weights`` must copy to write ``tensor`` in ``session``: what ``bucket_bytes`` bounds.
        All of them here; a backend that reads some tensors in place counts those as 0, so they travel in one
        call. Every rank of a TP group must count alike (it depends only on the tensor's kind and device)."""
        return tensor_nbytes(tensor)

    def _finish_weights(self, session: LoadSession) -> None:
        """After ``session`` committed what it wrote: make sure no cache computed with the old weights survives."""
        self._flush_cache()

    def _load_ended(self, session: LoadSession, exc: BaseException | None) -> None:
        """Every load's very end, after the state machine settled it: its commit (``exc`` None) or its failure
        or abort (``exc``, which is raised afterwards). What a backend must do once a load is over, whatever its
        outcome (SGLang waits for its scheduler's last copies), goes here; an error raised with ``exc`` None
        fails the commit."""
        return

    def _check_consistent(self, what: str, value: Callable[[], object]) -> None:
        """Raise ``InconsistentInputsError`` unless ``value()`` is equal on every rank of this engine's TP group;
        ``what`` names it in the error. Called at each ``generate`` (``generate_check_value``) and at each load's
        start, before anything else runs, so that a rank called differently never waits in a collective the
        others do not join. Nothing to compare here (one process: ``value`` is never built); a TP backend
        compares it over its group (``EngineGroup.check_consistent``)."""
        return

    @property
    def passes_tensors_on(self) -> bool:
        """Whether this engine's load sessions (``begin_load``) hand the tensors written to them on to another
        process, pickled with the session's ``pass_on`` (``genengine.engine.ipc.PassOn.dumps``). A ``cuda_ipc``
        receiver announces it at each sync, and the sender then shares each tensor a second time for that
        process. False here: ``_apply_weights`` reads the tensors in this process."""
        return False

    # ---- state (read-only for subclasses: the transitions belong to this class) ------------------------------
    @property
    def closed(self) -> bool:
        return self.__closed

    @property
    def released_tags(self) -> frozenset[str]:
        return frozenset(self.__released)

    @property
    def sleep_level(self) -> int | None:
        """The level of the sleep that released the tags still released; None when fully awake."""
        return self.__level

    @property
    def state(self) -> EngineState:
        return EngineState(
            released_tags=frozenset(self.__released),
            sleep_level=self.__level,
            weights_loaded=not self.__missing,
            closed=self.__closed,
        )

    @property
    def weight_version(self) -> int:
        """The version of the weights in force: the last ``load_weights(version=...)``, 0 at start."""
        return self.__weight_version

    @property
    def is_sleeping(self) -> bool:
        return bool(self.__released)

    def _check_open(self) -> None:
        if self.__closed:
            raise EngineClosedError(f"{type(self).__name__} was shut down; create a new engine")

    def _check_can_generate(self) -> None:
        if self.__released:
            ordered = [t for t in self.supported_tags if t in self.__released]
            raise EngineSleepingError(
                f"the engine is asleep (released: {', '.join(ordered)}); call wake() before generate"
            )
        if self.__missing:
            reason = self.__broken_reason or "after a level-2 sleep the weights must be sent again"
            raise WeightsNotLoadedError(
                f"refusing to generate from incomplete weights: {reason}; "
                f"{len(self.__missing)} weight(s) not loaded yet, e.g. {sorted(self.__missing)[0]!r}"
            )

    # ---- the protocol ---------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: Any = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        image_data: Sequence[Any] | None = None,
    ) -> list[GenerationResult]:
        self._check_open()
        self._check_consistent(
            "generate inputs (prompts, sampling parameters, images) or engine state (asleep/awake)",
            lambda: generate_check_value(prompts, sampling_params, prompt_token_ids, image_data, self.state),
        )
        self._check_no_open_load("generate")
        requests = normalize_requests(
            prompts,
            sampling_params,
            prompt_token_ids=prompt_token_ids,
            image_data=image_data,
            vocab_size=self._vocab_size(),
            supports_images=self.supports_images,
        )
        requests = self._bind_adapters(requests)
        self._check_can_generate()
        results = self._generate(requests)
        return [
            dataclasses.replace(
                result,
                outputs=[
                    dataclasses.replace(out, weight_versions=((0, self._version_of(request, self.__weight_version)),))
                    for out in result.outputs
                ],
            )
            for request, result in zip(requests, results, strict=True)
        ]

    def _check_sleep(self, level: int) -> None:
        """``sleep``'s checks, apart from its work: a subclass that refuses more makes its check after these,
        so that a bad call gets the same error whatever else holds."""
        self._check_open()
        if isinstance(level, bool) or not isinstance(level, int) or level not in (1, 2):
            raise InvalidArgumentError(
                f"sleep level={level!r}: allowed are 1 (keep weights in host memory) and 2 (discard weights)"
            )
        if not self.__sleep_enabled:
            raise EngineStateError("sleep is disabled for this engine: create it with enable_sleep=True")
        self._check_no_open_load("sleep")

    def sleep(self, level: int = 1) -> None:
        self._check_sleep(level)
        if self.__released:
            return
        self._release(level)
        self.__released = set(self.supported_tags)
        self.__level = level
        if level == 2:
            self.__missing = {n for n, info in self._weight_spec().items() if info.required}
            self.__broken_reason = None

    def wake(self, tags: str | Sequence[str] | None = None) -> None:
        """Take back memory for ``tags`` (every tag when None), weights first; an empty list wakes nothing.

        ``wake([])`` is a no-op, like waking a tag that is awake, so that a trainer computing the tags to wake
        needs no special case; any tag not in ``supported_tags`` is refused before anything is woken.
        """
        self._check_open()
        if tags is None:
            wanted = set(self.supported_tags)
        else:
            allowed = f"allowed: a list of tags from {list(self.supported_tags)}, one tag, or None for all"
            if not isinstance(tags, str) and not isinstance(tags, Iterable):
                raise InvalidArgumentError(f"wake tags={tags!r}: {allowed}")
            items = [tags] if isinstance(tags, str) else list(tags)
            unknown = [t for t in items if not isinstance(t, str) or t not in self.supported_tags]
            if unknown:
                raise InvalidArgumentError(f"wake tags {unknown!r}: {allowed}")
            wanted = set(items)
        self._check_no_open_load("wake")
        todo = tuple(t for t in self.supported_tags if t in wanted and t in self.__released)
        if not todo:
            return
        self._resume(todo)
        self.__released.difference_update(todo)
        if self.__flush_pending and TAG_KV_CACHE not in self.__released:
            self.__flush_pending = False
            self._flush_cache()
        if not self.__released:
            self.__level = None

    @property
    def default_bucket_bytes(self) -> int:
        """The bucket size ``load_weights`` uses when its ``bucket_bytes`` is None."""
        return self.__bucket_bytes

    @default_bucket_bytes.setter
    def default_bucket_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"bucket_bytes={value!r} must be a positive integer")
        self.__bucket_bytes = value

    def _check_load(self, *, bucket_bytes: int | None, check_finite: bool, version: int | None) -> None:
        """``load_weights``'s checks before it reads any tensor: a subclass that refuses more makes its check
        after these, so that a bad call gets the same error whatever else holds."""
        self._check_open()
        check_load_options(bucket_bytes=bucket_bytes, check_finite=check_finite, version=version)
        self._check_no_open_load("start another load")
        if TAG_WEIGHTS in self.__released:
            raise EngineSleepingError("the weights are asleep: call wake(['weights']) before load_weights")

    def _check_no_open_load(self, what: str) -> None:
        """Refuse ``what`` while a load session is open: the weights are half-written until its commit."""
        session = self.__session
        if session is not None:
            raise EngineStateError(f"cannot {what} while {session!r} is open: commit() or abort() it first")

    def _check_weights_may_change(self) -> None:
        """Raise if the weights may not change now; every load (a session or ``load_weights``) asks once, before
        anything is read. ``AsyncEngineBase`` refuses while requests run."""
        return

    def _on_new_weight_version(self, version: int) -> None:
        """A load committed with a new ``version`` label (``AsyncEngineBase`` relabels the requests it holds)."""
        return

    def begin_load(self, *, check_finite: bool = False, version: int | None = None) -> LoadSession:
        """Open a load session: ``write`` buckets as they arrive, then ``commit`` once (one cache flush, and
        ``version`` set) or ``abort``. Until then generate, sleep, wake and other loads are refused."""
        return self._begin_load(bucket_bytes=None, check_finite=check_finite, version=version, what="a load session")

    def _begin_load(
        self, *, bucket_bytes: int | None, check_finite: bool, version: int | None, what: str, mode: object = None
    ) -> LoadSession:
        """Open ``what``'s session; ``mode`` (the backend's own way of loading, None: its default) rides on it to
        the hooks. Every rank of a TP group is checked to make the same call in the same state first."""
        self._check_open()
        self._check_consistent(
            f"{what}'s arguments or engine state",
            lambda: (what, bucket_bytes, check_finite, version, self.state),
        )
        self._check_load(bucket_bytes=bucket_bytes, check_finite=check_finite, version=version)
        self._check_weights_may_change()
        validator = WeightValidator(self._weight_spec(), check_finite=check_finite)
        session = LoadSession(self, validator, version, what, mode)
        self.__session = session
        return session

    def _end_load(self, session: LoadSession, exc: BaseException | None) -> None:
        """A session's end: its commit (``exc`` None; raises what the flush raised), or its failure or abort;
        then ``_load_ended``. Called by ``LoadSession`` only: a backend implements ``_load_ended``."""
        try:
            self.__settle(session, exc)
        except BaseException as failed:
            self._load_ended(session, failed)
            raise
        self._load_ended(session, exc)

    def __settle(self, session: LoadSession, exc: BaseException | None) -> None:
        if self.__session is not session:
            return  # the engine was shut down meanwhile
        try:
            if exc is not None:
                if session.touched:
                    self.__break(session, exc)
                return
            try:
                self.__missing.difference_update(session.written)
                if not self.__missing:
                    self.__broken_reason = None
                if session.written:
                    if TAG_KV_CACHE in self.__released:
                        self.__flush_pending = True  # flushed as soon as the KV cache is back
                    else:
                        self._finish_weights(session)
            except BaseException as failed:
                self.__break(session, failed)
                raise
        finally:
            self.__session = None
        if session.version is not None and session.version != self.__weight_version:
            self.__weight_version = session.version
            self._on_new_weight_version(session.version)

    def __break(self, session: LoadSession, exc: BaseException) -> None:
        # Only an error before the first write (a rejected entry, a stream or gather failing first) leaves the old
        # weights whole. Any later one, inside a bucket, further on or in the cache flush, leaves a mix of old and
        # new weights or a stale cache: refuse to generate until a load covers every weight.
        self.__missing = {n for n, info in self._weight_spec().items() if info.required}
        during = f" and while writing {session.writing} more" if session.writing else ""
        self.__broken_reason = (
            f"{session.what} failed after writing {len(session.written)} weight(s){during} "
            f"({type(exc).__name__}: {exc})"
        )

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int | None = None,
        check_finite: bool = False,
        version: int | None = None,
    ) -> LoadReport:
        """Write ``named_tensors`` into the engine; ``version`` (an int >= 0) labels the weights from here on
        (``weight_version`` and each later output's ``weight_versions``); None keeps the current label.

        One load session: a bucket written per bucket of ``named_tensors``, then one commit."""
        return self._load_weights(named_tensors, bucket_bytes=bucket_bytes, check_finite=check_finite, version=version)

    def _load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int | None,
        check_finite: bool,
        version: int | None,
        mode: object = None,
        what: str = "a load_weights call",
    ) -> LoadReport:
        """``load_weights`` in the backend's own ``mode`` (its other load calls: the ``mode`` reaches the hooks
        on the session, ``LoadSession.mode``)."""
        session = self._begin_load(
            bucket_bytes=bucket_bytes, check_finite=check_finite, version=version, what=what, mode=mode
        )
        with session:
            check_named_tensors(named_tensors)
            buckets = iter_buckets(
                named_tensors,
                session.validator,
                self.__bucket_bytes if bucket_bytes is None else bucket_bytes,
                validate_all_first=self.validate_all_weights_first,
                cost=lambda tensor: self._bucket_cost(tensor, session),
            )
            for bucket in buckets:
                session._write_checked(bucket)
            return session.commit()

    def flush_cache(self) -> None:
        self._check_open()
        if TAG_KV_CACHE in self.__released:
            return
        self._flush_cache()

    def shutdown(self) -> None:
        if self.__closed:
            return
        self.__session = None  # an open session's writes and commit now raise EngineClosedError
        try:
            try:
                if self.wake_before_shutdown and self.__released:
                    self._resume(tuple(t for t in self.supported_tags if t in self.__released))
                    self.__released.clear()
                    self.__level = None
            finally:
                self._shutdown()  # released_tags is still non-empty here when that wake failed
        finally:
            self.__closed = True

    def __enter__(self) -> EngineBase:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()


class LoadSession:
    """One weight load into an ``EngineBase``, bucket by bucket: ``write`` each bucket as it arrives, then
    ``commit`` once (the cache flush and the ``version`` label happen there, once per load, not per bucket).

    Each write checks its tensors against the engine's spec, once (a name written twice in one session is an
    error), and writes them. Any failure ends the session as ``load_weights``' failures do: before the first write the
    old weights stay whole; after it the engine refuses to generate until a load covers every weight. Used as
    a context manager, an error inside the block aborts the session, and leaving it uncommitted aborts it too.
    """

    def __init__(
        self, engine: EngineBase, validator: WeightValidator, version: int | None, what: str, mode: object = None
    ) -> None:
        self._engine = engine
        self.validator = validator
        self.version = version
        self.what = what
        self.mode = mode
        """The backend's own way of loading, as its own load call gave it (None: the backend's default)."""
        self.pass_on: PassOn | None = None
        """Set by a transport receiver whose tensors lie in another process's memory: an engine that passes them
        on to a third process (``EngineBase.passes_tensors_on``) pickles them with ``pass_on.dumps``."""
        self.written: list[str] = []
        self.writing = 0  # tensors of the bucket in _apply_weights: how much of it landed is unknown
        self.touched = False  # _apply_weights was called: from here on the old weights may no longer be whole
        self._entries = 0
        self._num_bytes = 0
        self._num_buckets = 0
        self._start = time.perf_counter()
        self._state: Literal["open", "committed", "aborted"] = "open"

    def __repr__(self) -> str:
        label = "" if self.version is None else f" of version {self.version}"
        return (
            f"the load session{label} ({len(self.written)} weight(s) in {self._num_buckets} bucket(s) written, "
            f"{self._state})"
        )

    @property
    def state(self) -> str:
        """``"open"``, ``"committed"`` or ``"aborted"``."""
        return self._state

    def _check_open(self) -> None:
        self._engine._check_open()
        if self._state != "open":
            raise EngineStateError(f"{self!r}: it takes no more writes or commits; begin_load() a new one")

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Check and write one bucket of (name, tensor) pairs; a failure aborts the session and raises.

        The session's one check of each tensor (a weight transport's receiver has no other): the bucket is
        pulled whole, then checked, then written, with no caller code in between to free a tensor."""
        self._check_open()
        try:
            check_named_tensors(named_tensors)
            source = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
            bucket = []
            for item in list(source):
                bucket.append(self.validator.check(self._entries, item))
                self._entries += 1
        except BaseException as exc:
            self._fail(exc)
            raise
        self._write_checked(bucket)

    def _write_checked(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Write a bucket ``validator`` already checked (``write``; ``load_weights`` checks as it buckets): no
        check here, only the DTensor gathers and contiguous copies of ``WeightValidator.prepare``."""
        if not bucket:
            return
        try:
            ready = self.validator.prepare(bucket)
            self.writing = len(ready)
            self.touched = True
            self._engine._apply_weights(ready, self)
        except BaseException as exc:
            self._fail(exc)
            raise
        self.writing = 0
        self._num_buckets += 1
        for name, tensor in ready:
            self.written.append(name)
            self._num_bytes += tensor_nbytes(tensor)

    def commit(self) -> LoadReport:
        """End the load: one cache flush (or the flush owed at ``wake(["kv_cache"])``), then ``version``."""
        self._check_open()
        self._state = "committed"
        try:
            self._engine._end_load(self, None)
        except BaseException:
            self._state = "aborted"
            raise
        return LoadReport(
            num_tensors=len(self.written),
            num_bytes=self._num_bytes,
            num_buckets=self._num_buckets,
            seconds=time.perf_counter() - self._start,
        )

    def abort(self, exc: BaseException | None = None) -> None:
        """End the load without committing: the version stays; once anything was written the engine refuses
        to generate until a full load. A no-op on a session already ended."""
        if self._state != "open":
            return
        self._fail(exc or EngineStateError("the load session was aborted before its commit"))

    def _fail(self, exc: BaseException) -> None:
        if self._state == "open":
            self._state = "aborted"
            self._engine._end_load(self, exc)

    def __enter__(self) -> LoadSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.abort(exc)
        elif self._state == "open":
            self.abort(EngineStateError("the load session ended without commit()"))
