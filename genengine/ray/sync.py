"""``WeightSync``: the pool's ``load_weights`` — through Ray's object store, or through a weight-sync group
of ``genengine.transport`` (rank 0 in the trainer's process, one rank per replica) — and the refill of a
restored replica.

A failed sync raises one error naming every replica that did not load it; a replica left holding part of
it (a mix under the old label) takes no traffic until a whole sync reaches it. Importing this module imports
neither Ray nor torch.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from genengine.errors import EngineStateError, GenEngineError, InvalidArgumentError, WeightLoadError
from genengine.protocol import LoadReport
from genengine.ray.errors import ReplicaDiedError, ReplicaError, ReplicaTimeoutError, StaleReplicaError
from genengine.ray.fanout import Outcome, raise_first
from genengine.ray.fleet import Fleet
from genengine.ray.handle import Replica
from genengine.ray.lifecycle import Lifecycle
from genengine.ray.options import ray_module
from genengine.weights import check_load_options, check_named_tensors, check_storage

_log = logging.getLogger("genengine.ray.pool")  # the pool's one logger (as fleet.py's)

__all__ = ["WeightSync"]

WeightsSource = Callable[[], Iterable[tuple[str, Any]]]


def renamed(exc: BaseException, message: str) -> BaseException:
    """``exc``'s type (a genengine error) with ``message``, else a ReplicaError; chained to ``exc``."""
    kind = type(exc) if isinstance(exc, GenEngineError) else ReplicaError
    try:
        error = kind(message)
    except Exception:
        error = ReplicaError(message)
    error.__cause__ = exc
    return error


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _host_tensor(tensor: Any) -> Any:
    """A tensor as the object store should carry it: gathered (DTensor), detached, in host memory. Anything
    else goes as is, for the replica's validation to name."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    device = getattr(tensor, "device", None)
    if device is not None and device.type not in ("cpu", "meta"):
        return tensor.detach().cpu()
    return tensor.detach() if hasattr(tensor, "detach") else tensor


def _refuse_non_finite(pairs: list[Any], what: str, version: int) -> None:
    """``check_finite`` in the trainer's process, before anything is sent: a replica checks a bucket only once
    the buckets before it were written, so a NaN in a later bucket would leave every replica refusing (a mix
    under the old label) instead of unchanged. DTensors are left to the replicas (reading one here would be a
    collective the other trainer ranks do not join); what is not a tensor, to the sender's own checks."""
    import torch

    from genengine.weights import check_tensor_finite

    for item in pairs:
        if not isinstance(item, tuple) or len(item) != 2:
            continue
        name, tensor = item
        if (
            not isinstance(name, str)
            or type(tensor) not in (torch.Tensor, torch.nn.Parameter)
            or tensor.layout != torch.strided
            or tensor.is_meta
            or not tensor.is_floating_point()
        ):
            continue
        check_storage(name, tensor)  # a freed tensor's "values" are whatever memory follows it
        try:
            check_tensor_finite(name, tensor)
        except WeightLoadError as exc:
            raise WeightLoadError(
                f"{what}: {exc}; refused in the trainer's process before anything was sent: every replica keeps "
                f"its weights and the pool's weight version stays {version}"
            ) from None


def _drop_frames(exc: BaseException) -> None:
    """Free what the finished frames of a failed send hold (its process groups' pending work): gloo closes a
    group's connections only once nothing holds it, and until then a replica waiting to report to rank 0 waits
    out the group's timeout (60 s in a test, with a replica that died mid-sync) instead of failing at once."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    gc.collect()


def _partial(outcome: Outcome) -> bool:
    """Whether a failed transport receive had loaded some buckets (the receiver says how many)."""
    error = outcome.error
    cause = error.__cause__ if error is not None and error.__cause__ is not None else error
    return int(getattr(cause, "buckets_loaded", 0) or 0) > 0


class _SyncFailed(Exception):
    """A transport sync that failed: the error for the caller, and whether a replica died or restarted under
    it (then the others can be synced again at once)."""

    def __init__(self, error: BaseException, lost_replica: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.lost_replica = lost_replica


class WeightSync:
    """Weight syncs to the fleet's replicas, and the weights a restored replica is refilled with."""

    def __init__(self, fleet: Fleet, lifecycle: Lifecycle) -> None:
        self.fleet = fleet
        self.lifecycle = lifecycle
        opts = fleet.options
        self.transport = opts.transport
        self.transport_options = dict(opts.transport_options)
        self.keep_weights = opts.keep_weights
        self.source: WeightsSource | None = opts.weights_source
        self.kept: dict[str, Any] = {}  # name -> object ref of the last synced tensor (keep_weights)
        self._sender: Any = None
        self._group: tuple[tuple[int, str], ...] = ()
        self._group_name = ""
        self._group_count = 0

    @property
    def group(self) -> str | None:
        return self._group_name if self._sender is not None else None

    def forget_group(self) -> None:
        """The members changed: the group is formed again at the next sync."""
        self._group = ()

    # ---- load_weights -----------------------------------------------------------------------------------------
    def load(
        self, named_tensors: Any, *, bucket_bytes: int | None, check_finite: bool, version: int | None
    ) -> LoadReport:
        fleet = self.fleet
        fleet.check_open()
        check_named_tensors(named_tensors)
        check_load_options(bucket_bytes=bucket_bytes, check_finite=check_finite, version=version)
        start = time.perf_counter()
        self.lifecycle.recover()
        with fleet.lock:
            if self.transport is not None:
                self._confirm_members()
            replicas = self.lifecycle.ready("load_weights")
            if self.transport is not None:
                if bucket_bytes is not None:
                    raise InvalidArgumentError(
                        f"bucket_bytes={bucket_bytes!r}: with transport={self.transport!r} the buckets are the "
                        "weight-sync group's: pass EnginePool(transport_options={'bucket_bytes': N}) instead"
                    )
                try:
                    report = self._load_transport(replicas, named_tensors, version, check_finite)
                except _SyncFailed as failed:
                    # A stream read once (a generator) cannot be sent again: the trainer syncs again itself.
                    if not failed.lost_replica or iter(named_tensors) is named_tensors:
                        raise failed.error from failed.error.__cause__
                    _log.warning("%s; syncing the replicas that are up again", failed.error)
                    self._confirm_members()
                    fleet.check_dead()
                    replicas = fleet.active()
                    if not replicas:
                        raise failed.error from failed.error.__cause__
                    try:
                        report = self._load_transport(replicas, named_tensors, version, check_finite)
                    except _SyncFailed as again:
                        raise again.error from again.error.__cause__
            else:
                report = self._load(replicas, named_tensors, version, bucket_bytes, check_finite)
            fleet.mark_loaded(replicas, version)
        return LoadReport(report.num_tensors, report.num_bytes, report.num_buckets, time.perf_counter() - start)

    def refill(self, replica: Replica) -> bool:
        """Load the current weights into one restored replica: from the registered source, else from what
        ``keep_weights`` kept; False when there is neither."""
        version = self.fleet.version
        if self.source is not None:
            self._load([replica], self.source(), version, None, False)
        elif self.kept:
            names = list(self.kept)
            self._load_refs([replica], names, [self.kept[n] for n in names], version, None, False)
        else:
            return False
        return True

    # ---- the object store ---------------------------------------------------------------------------------------
    def _load(
        self,
        replicas: list[Replica],
        named_tensors: Iterable[tuple[str, Any]],
        version: int | None,
        bucket_bytes: int | None,
        check_finite: bool,
    ) -> Any:
        ray = ray_module()
        pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        names: list[str] = []
        refs: list[Any] = []
        for index, item in enumerate(pairs):
            if not isinstance(item, tuple) or len(item) != 2:  # as the engine's validator says it, before any load
                raise WeightLoadError(f"entry {index} is {type(item).__name__}, expected a (name, tensor) pair")
            name, tensor = item
            if isinstance(name, str):
                check_storage(name, tensor)  # pickling a freed tensor would send whatever memory follows it
            names.append(name)
            refs.append(ray.put(_host_tensor(tensor)))
        report = self._load_refs(replicas, names, refs, version, bucket_bytes, check_finite)
        if self.keep_weights:
            self.kept.update(zip(names, refs, strict=True))
        return report

    def _load_refs(
        self,
        replicas: list[Replica],
        names: list[str],
        refs: list[Any],
        version: int | None,
        bucket_bytes: int | None,
        check_finite: bool,
    ) -> Any:
        """Every replica loads from the object store. A replica whose load failed after its engine wrote some
        weights refuses to generate from the mix (``state.weights_loaded`` is False): it takes no traffic until a
        whole load reaches it. One error names every replica that failed."""
        fleet = self.fleet
        fleet.check_open()
        outcomes = fleet.call(
            "load_weights",
            lambda r: r.load_weights(names, refs, version, bucket_bytes, check_finite),
            replicas,
            errors="return",
        )
        done = [o for o in outcomes if o.error is None]
        # One that had restarted before the call did nothing: restored later with these weights.
        failed = [o for o in outcomes if o.error is not None and not o.stale]
        if not failed:
            if not done:
                raise EngineStateError(f"load_weights: no replica is up ({fleet.describe()})")
            return done[0].value
        probed = [o.replica for o in failed if not o.died]
        mixed = []
        for probe in fleet.call("load_weights", Replica.ask_info, probed, errors="return"):
            info = probe.value
            if isinstance(info, Mapping) and info.get("state") is not None:
                if info["state"].weights_loaded:
                    fleet.record(probe.replica, info["state"])
                else:
                    fleet.mark_needs_weights(probe.replica, info["state"])
                    mixed.append(probe.replica)
        lines = [f"load_weights failed on {len(failed)} of {len(replicas)} replica(s)"]
        lines += [f"{type(o.error).__name__}: {o.error}" for o in failed]  # each names its replica
        lines.append(
            f"the pool's weight version stays {fleet.version}"
            + (
                f"; replica(s) {', '.join(str(r.index) for r in mixed)} wrote part of the weights and take no "
                "traffic until a whole load_weights reaches them"
                if mixed
                else ""
            )
        )
        first = failed[0].error
        assert first is not None
        message = "; ".join(lines)
        error = renamed(first, message) if len({type(o.error) for o in failed}) == 1 else ReplicaError(message)
        raise error from first

    # ---- a transport's weight-sync group --------------------------------------------------------------------------
    def _confirm_members(self) -> None:
        """Before a transport sync: ping every healthy replica so that one that restarted unnoticed is
        restored, or left out, before the group is formed or used. A member that is not what the group was
        formed with would make the sync wait for it until the group's timeout."""
        self.lifecycle.ping("load_weights")
        self.lifecycle.recover()

    def _load_transport(
        self, replicas: list[Replica], named_tensors: Any, version: int | None, check_finite: bool
    ) -> Any:
        """One sync through the weight-sync group (formed again when its members changed): every receiver is
        started, then the trainer's process sends, then every receiver is waited for. Any failure raises
        ``_SyncFailed`` with one error naming each replica that did not load the sync (and its rank)."""
        from genengine.transport import TransportError, TransportTimeoutError

        fleet = self.fleet
        pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        label = fleet.version if version is None else version
        if check_finite:  # the sender pulls every pair before it sends anything anyway (references only)
            pairs = list(pairs)
            _refuse_non_finite(
                pairs, f"load_weights of version {label} over transport {self.transport!r}", fleet.version
            )
        self._ensure_group(replicas)
        group = self._group_name
        ranks = {r.index: rank for rank, r in enumerate(replicas, 1)}
        calls = [(r, r.transport_receive(check_finite)) for r in replicas]
        sent: BaseException | None = None
        try:
            self._sender.send(pairs, version=label)
        except Exception as exc:
            sent = exc
            if isinstance(exc, TransportTimeoutError) or not isinstance(exc, GenEngineError):
                # The group is out of step: close rank 0's end now, so that the receivers still waiting for it
                # fail at once (their connections drop) instead of at the group's timeout.
                with contextlib.suppress(Exception):
                    self._sender.close()
                _drop_frames(exc)
        # A receiver raises within the group's timeout of the sender's last word; the margin covers Ray.
        outcomes = fleet.wait("load_weights", calls, self.transport_options["timeout_s"] + fleet.timeout_s)
        failed = [o for o in outcomes if o.error is not None]
        if sent is None and not failed:
            return outcomes[0].value
        # A timeout, a dead or silent replica, or a failure outside the protocol leave the group out of step.
        broken = isinstance(sent, TransportTimeoutError) or (sent is not None and not isinstance(sent, GenEngineError))
        lost = (ReplicaDiedError, ReplicaTimeoutError, StaleReplicaError, TransportTimeoutError)
        for o in failed:
            cause = o.error.__cause__ if o.error is not None and o.error.__cause__ is not None else o.error
            broken = broken or isinstance(o.error, lost) or not isinstance(cause, GenEngineError)
            if _partial(o):
                # Some buckets landed: its weights are a mix under the old label. No traffic until a full sync.
                fleet.mark_needs_weights(o.replica)
        if broken:
            with contextlib.suppress(Exception):
                self.close_group()
        what = f"load_weights of version {label} over transport {self.transport!r} (group {group!r})"
        if failed:
            named = ", ".join(f"{o.replica.where} (rank {ranks[o.replica.index]})" for o in failed)
            lines = [f"{what} failed on {len(failed)} of {len(replicas)} replica(s): {named}"]
            lines += [f"rank {ranks[o.replica.index]}: {type(o.error).__name__}: {o.error}" for o in failed]
        else:
            lines = [f"{what} failed in the trainer's process; every replica answered"]
        if sent is not None:
            lines.append(f"the sender: {type(sent).__name__}: {sent}")
        mixed = [o.replica for o in failed if o.replica.needs_weights]
        lines.append(
            f"the pool's weight version stays {fleet.version}"
            + (
                f"; replica(s) {', '.join(str(r.index) for r in mixed)} loaded part of the sync and take no traffic "
                "until the next load_weights reaches them"
                if mixed
                else ""
            )
            + ("; the group is closed and formed again at the next sync" if broken else "")
        )
        message = "; ".join(lines)
        kinds = {type(o.error) for o in failed}
        first = failed[0].error if failed else None
        if first is None:
            assert sent is not None
            error = renamed(sent, message)
        elif len(kinds) == 1:
            error = renamed(first, message)
        else:
            error = TransportError(message)
        error.__cause__ = sent if sent is not None else first
        # A replica died or restarted under the sync: load_weights syncs the others again once (docs/deployment.md).
        raise _SyncFailed(error, any(o.died or o.stale for o in failed))

    def _ensure_group(self, replicas: list[Replica]) -> None:
        ray = ray_module()
        from genengine.transport import TransportSpec

        name = self.transport
        assert name is not None, "a weight-sync group needs the pool's transport"
        members = tuple((r.index, r.incarnation) for r in replicas)
        if self._sender is not None and members == self._group:
            return
        self.close_group()
        self._group_count += 1
        spec = TransportSpec(
            transport=name,
            address=f"{ray.util.get_node_ip_address()}:{_free_port()}",
            world_size=1 + len(replicas),
            group_name=f"genengine-pool-{self.fleet.pool_id}-{self._group_count}",
            device="cpu" if name == "gloo" else "cuda",
            **self.transport_options,
        )
        calls = [(r, r.transport_join(spec, rank)) for rank, r in enumerate(replicas, 1)]
        sender = self._open_sender(spec, calls)
        self._sender, self._group, self._group_name = sender, members, spec.group_name
        _log.info("weight-sync group %r formed: %s", spec.group_name, ", ".join(r.where for r in replicas))

    def _open_sender(self, spec: Any, calls: list[tuple[Replica, Any]]) -> Any:
        """Rank 0's end, opened in a thread while the replicas join: a replica whose join fails (it raises at
        once, e.g. a transport its node lacks) is named at once instead of after the group's timeout."""
        ray = ray_module()
        from genengine.transport import get_transport

        fleet = self.fleet
        box: dict[str, Any] = {}

        def open_it() -> None:
            try:
                box["sender"] = get_transport(spec.transport).sender(spec)
            except BaseException as exc:
                box["error"] = exc

        thread = threading.Thread(target=open_it, name=f"{spec.group_name}-sender", daemon=True)
        thread.start()
        waiting = {r.index: (r, ref) for r, ref in calls}
        while thread.is_alive() and waiting:
            thread.join(0.05)
            done, _ = ray.wait([ref for _, ref in waiting.values()], num_returns=len(waiting), timeout=0)
            early = [(r, ref) for r, ref in waiting.values() if ref in done]
            for o in fleet.wait("transport_join", early, 0):
                del waiting[o.replica.index]
                if o.error is not None and thread.is_alive():
                    # The sender gives up at its timeout; the replicas that joined are told so and raise
                    # then. Nothing to close now: the next sync forms a new group.
                    raise o.error
        thread.join()
        timeout = spec.timeout_s + fleet.timeout_s
        if "error" in box:
            exc = box["error"]
            joined = fleet.wait("transport_join", calls, timeout)
            notes = [f"rank {rank}: {o.error}" for rank, o in enumerate(joined, 1) if o.error is not None]
            raise renamed(exc, "; ".join([str(exc), *notes])) from exc
        sender = box["sender"]
        try:
            outcomes = fleet.wait("transport_join", calls, timeout)
            raise_first("transport_join", outcomes)
        except BaseException:
            sender.close()
            raise
        return sender

    def close_group(self) -> None:
        sender, self._sender, self._group = self._sender, None, ()
        if sender is not None:
            sender.close()
            live = self.fleet.active()
            self.fleet.call("transport_close", Replica.transport_close, live, errors="return")
