"""Long-lived spawned processes that play replicas (or a trainer) of weight-sync groups, and what they share
with the test process (which plays the trainer and the reference).

Spawning a process and importing torch and transformers costs seconds on a 2-core machine, so the
workers start once per test module; each job joins a fresh group (a new port and group name), runs one
scenario, closes the group. Every process holds a real embedded engine (``create_engine(backend=
"transformers")`` on the project's tiny model, built once by the test process).
Results (or the exception's type, message and base classes) come back through
a queue; a worker that died is reported as such and restarted on the next job. ``__main__``-safe: nothing
runs at import.
"""

from __future__ import annotations

import hashlib
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from .outcomes import Result
from .ports import free_port
from .start import worker_context

__all__ = [
    "PackFault",
    "Pool",
    "Result",
    "awkward_weights",
    "configure",
    "engine",
    "free_port",
    "observe",
    "send_one",
    "trainer_stream",
]


# ---- shared by the workers and the test process ------------------------------------------------------------
_STATE: dict[str, Any] = {}


def configure(model_dir: str, device: str = "cpu", trainer_device: str | None = None) -> None:
    """Where the tiny model is (built once, by the test process) and where this process's engine and
    trainer tensors live (``cuda:N`` becomes the current CUDA device: NCCL needs a GPU per rank; the trainer's
    tensors on ``trainer_device`` when given: host tensors make ``cuda_ipc`` pack every one)."""
    _STATE["model"] = model_dir
    _STATE["device"] = device
    _STATE["trainer_device"] = trainer_device or device
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))


def engine() -> Any:
    """This process's embedded engine on the tiny model (created once), fp32 so that bf16 and fp32 arrive
    bit for bit."""
    import genengine

    if "engine" not in _STATE:
        _STATE["engine"] = genengine.create_engine(
            backend="transformers", model=_STATE["model"], dtype="float32", device=_STATE["device"]
        )
    return _STATE["engine"]


def checkpoint(which: str) -> dict[str, Any]:
    """Weights "A" (the tiny model's own) or "B" (A plus seeded noise per tensor: other outputs, no second build)."""
    import zlib

    import torch

    from genengine.testing.conformance import load_checkpoint

    key = f"ckpt_{which}"
    if key not in _STATE:
        a = load_checkpoint(_STATE["model"])
        if which == "A":
            _STATE[key] = a
        else:
            b = {}
            for name, t in sorted(a.items()):
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                b[name] = (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype)
            _STATE[key] = b
    return _STATE[key]  # type: ignore[no-any-return]


def trainer_stream(which: str) -> list[tuple[str, Any]]:
    """What a trainer hands over, built from checkpoint ``which`` on this process's device: bf16 tensors as
    stored, fp32 copies, transposed (non-contiguous) views and views at an odd offset into a larger storage."""
    import torch

    device = torch.device(_STATE.get("trainer_device", _STATE["device"]))
    out: list[tuple[str, Any]] = []
    for i, (name, stored) in enumerate(sorted(checkpoint(which).items())):
        tensor = stored.to(device)
        kind = i % 5  # 5: the tiny model has 12 tensors a layer, so every kind meets 2-D ones
        if kind == 1:
            tensor = tensor.float()
        elif kind == 2 and tensor.dim() == 2:
            tensor = tensor.t().contiguous().t()  # same values, column-major: not contiguous
            assert not tensor.is_contiguous()
        elif kind == 3:
            big = torch.empty(tensor.numel() + 7, dtype=tensor.dtype, device=device)
            big[7:].copy_(tensor.reshape(-1))
            tensor = big[7:].view(tensor.shape)  # a view at an odd element offset of a larger storage
        out.append((name, tensor))
    return out


def awkward_weights(model_dir: str, version: int, device: str) -> list[tuple[str, Any]]:
    """``genengine.cli.bench.pool.random_weights`` laid out as a trainer may hold them, with the same values: every
    third 2-D tensor transposed in memory (not contiguous: ``cuda_ipc`` packs it into a bucket), every third + 1
    a view at an odd element offset of a larger allocation (dense: ``cuda_ipc`` shares it in place, at that
    offset). The pool benchmark's ``weights`` in tests/gpu/test_ray_gpu.py, so each engine's replica reads
    both kinds, by both ways of sharing, and must serve what the in-process engine loaded from them."""
    import torch

    from genengine.cli.bench.pool import random_weights

    out: list[tuple[str, Any]] = []
    for i, (name, tensor) in enumerate(random_weights(model_dir, version, device)):
        if i % 3 == 0 and tensor.dim() == 2 and min(tensor.shape) > 1:
            tensor = tensor.t().contiguous().t()
        elif i % 3 == 1:
            big = torch.empty(tensor.numel() + 7, dtype=tensor.dtype, device=tensor.device)
            big[7:].copy_(tensor.reshape(-1))
            tensor = big[7:].view(tensor.shape)
        out.append((name, tensor))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out


def observe(engine: Any) -> dict[str, Any]:
    """What a replica's engine now holds: greedy outputs (tokens and logprobs; or ``refused``, the message of a
    generate it refuses), weight version, weight digests."""
    from genengine.errors import WeightsNotLoadedError
    from genengine.testing.conformance import GREEDY, PROMPTS

    try:
        results = engine.generate(PROMPTS, GREEDY)
    except WeightsNotLoadedError as exc:  # a failed sync wrote part of its buckets: the engine refuses
        seen: dict[str, Any] = {"refused": str(exc)}
    else:
        seen = {"outputs": [[o.token_ids, o.logprobs, o.weight_versions] for r in results for o in r.outputs]}
    # The embedded engine's own parameters (test-only access): bit-exact evidence, beyond equal outputs.
    digests = {
        n: hashlib.sha256(p.detach().cpu().contiguous().view(-1).numpy().tobytes()).hexdigest()[:16]
        for n, p in engine._params.items()
    }
    return {**seen, "version": engine.weight_version, "digests": digests}


class PackFault(RuntimeError):
    """What a tensor from :func:`_bomb` raises when packed with ``fatal=False`` (a DTensor gather failing)."""


def _bomb(tensor: Any, *, fatal: bool = True) -> Any:
    """``tensor`` as a subclass whose gather (the ``detach`` right before it is packed) kills the trainer's
    process (a trainer dying mid-sync), or with ``fatal=False`` raises :class:`PackFault` there."""
    import torch

    class Bomb(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.Tensor.detach:
                if fatal:
                    os._exit(17)  # packing this tensor: the sender dies with buckets still to send
                raise PackFault("injected: gathering this tensor failed while its bucket was packed")
            return super().__torch_function__(func, types, args, kwargs or {})

    return tensor.as_subclass(Bomb)


def _error_row(exc: BaseException) -> dict[str, Any]:
    return {
        "error": type(exc).__name__,
        "message": str(exc),
        "mro": [c.__name__ for c in type(exc).__mro__],
        "buckets_loaded": getattr(exc, "buckets_loaded", None),  # a receiver's: how many reached its engine
        "trace": "".join(traceback.format_exception(exc))[-4000:],
    }


def warm() -> float:
    """Import, build the engine and make both checkpoints now, so that later timings are the transport's."""
    start = time.monotonic()
    trainer_stream("A"), trainer_stream("B")
    observe(engine())
    import genengine.transport.broadcast  # noqa: F401

    return time.monotonic() - start


def reference(which: str) -> dict[str, Any]:
    """This process's engine loaded directly (``load_weights``) with the trainer's stream ``which``."""
    engine().load_weights(trainer_stream(which), version=0)
    return observe(engine())


class _DiesInLoad:
    """A real engine whose process dies writing the ``n``-th bucket it is given (a replica dying mid-sync)."""

    def __init__(self, inner: Any, n: int) -> None:
        self._inner, self._n = inner, n

    def begin_load(self, **kwargs: Any) -> Any:
        session = self._inner.begin_load(**kwargs)
        write = session.write

        def dying_write(named_tensors: Any) -> None:
            self._n -= 1
            if self._n <= 0:
                os._exit(18)
            write(named_tensors)

        session.write = dying_write
        return session

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _OnlyLoadWeights:
    """A real engine seen through ``load_weights`` alone, no ``begin_load``: a third-party engine without load
    sessions, which the transports load with one ``load_weights`` a bucket."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def load_weights(self, named_tensors: Any, **kwargs: Any) -> Any:
        return self._inner.load_weights(named_tensors, **kwargs)


def plan(stream: list[tuple[str, Any]], spec: Any, version: int = 0) -> Any:
    """The layout ``spec``'s sender gives ``stream`` (``cuda_ipc`` reads dense tensors on its GPU in place)."""
    import torch

    from genengine.transport import _layout
    from genengine.transport.cuda_ipc import shareable

    share = None
    if spec.transport == "cuda_ipc":
        share = shareable(torch.device("cuda", torch.cuda.current_device()))
    return _layout.plan(stream, version=version, bucket_bytes=spec.bucket_bytes, checksum=spec.checksum, share=share)


def send_one(sender: Any, sync: dict[str, Any]) -> dict[str, Any]:
    """One sync on rank 0: ``weights`` ("A"/"B", or None: an empty sync), ``version``, and optionally ``corrupt``
    (flip a byte of that bucket after its checksum), ``nan_bucket`` (a NaN in that bucket's first tensor: a
    receiver's ``check_finite`` refuses it), ``bad`` (a stream the checks refuse), ``bomb`` (die packing
    that tensor index), ``fail_pack`` (raise :class:`PackFault` packing that tensor index), ``host_every``
    (every n-th tensor handed over from host memory)."""
    import torch

    stream = trainer_stream(sync["weights"]) if sync["weights"] is not None else []
    if sync.get("host_every"):
        stream = [(n, t.cpu() if i % sync["host_every"] == 0 else t) for i, (n, t) in enumerate(stream)]
    if sync.get("bad"):
        stream[3] = (stream[3][0], torch.zeros(stream[3][1].shape, dtype=torch.int32))
    for key, fatal in (("bomb", True), ("fail_pack", False)):
        if sync.get(key) is not None:
            name, tensor = stream[sync[key]]
            stream[sync[key]] = (name, _bomb(tensor, fatal=fatal))
    if sync.get("nan_bucket") is not None:
        layout = plan(stream, sender.group.spec)
        at = [name for name, _ in stream].index(layout.buckets[sync["nan_bucket"]].entries[0].name)
        name, tensor = stream[at]
        poisoned = tensor.clone()  # the same strides: the same layout
        index = torch.unravel_index(torch.tensor(poisoned.numel() // 2), poisoned.shape)
        poisoned[tuple(int(i) for i in index)] = float("nan")
        stream[at] = (name, poisoned)
    from genengine.transport import faults

    try:
        with faults.injected(corrupt_bucket=sync.get("corrupt")):
            r = sender.send(stream, version=sync["version"])
        return {"report": [r.version, r.num_tensors, r.num_bytes, r.num_buckets]}
    except Exception as exc:
        return _error_row(exc)


def scenario_send(spec: dict[str, Any], syncs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0 in a worker: form the group, run ``syncs`` (see :func:`send_one`) in order, close."""
    from genengine.transport import TransportSpec, get_transport

    sender = get_transport(spec["transport"]).sender(TransportSpec(**spec))
    try:
        return [send_one(sender, sync) for sync in syncs]
    finally:
        sender.close()


def scenario_receive(
    spec: dict[str, Any],
    rank: int,
    syncs: int,
    die_in_load: int | None = None,
    check_finite: bool = False,
    sessions: bool = True,
) -> dict[str, Any]:
    """A replica: start from checkpoint A at version 0, join, receive ``syncs`` syncs (observing the engine
    after each, and what its :class:`LoadProbe` counted), close. ``seconds`` of each receive is measured so a
    timeout's promptness can be asserted. ``die_in_load``: the process dies writing that (1-based) bucket.
    ``sessions=False``: the engine is offered with ``load_weights`` alone (:class:`_OnlyLoadWeights`)."""
    from genengine.testing.conformance.transport import LoadProbe
    from genengine.transport import TransportSpec, get_transport

    real = engine()
    if "probe" not in _STATE:
        _STATE["probe"] = LoadProbe(real)
    probe: LoadProbe = _STATE["probe"]
    real.load_weights(trainer_stream("A"), version=0)
    before = observe(real)
    target = real if die_in_load is None else _DiesInLoad(real, die_in_load)
    if not sessions:
        target = _OnlyLoadWeights(target)
    try:
        receiver = get_transport(spec["transport"]).receiver(TransportSpec(**spec), rank)
    except Exception as exc:
        return {"before": before, "join": _error_row(exc), "syncs": []}
    rows: list[dict[str, Any]] = []
    try:
        for _ in range(syncs):
            probe.take()
            start = time.monotonic()
            try:
                r = receiver.receive(target, check_finite=check_finite)
                row: dict[str, Any] = {"report": [r.version, r.num_tensors, r.num_bytes, r.num_buckets]}
            except Exception as exc:
                row = _error_row(exc)
            row["seconds"] = time.monotonic() - start
            row["probe"] = probe.take()
            row["after"] = observe(real)
            rows.append(row)
            if "error" in row and "TransportTimeoutError" in row["mro"]:
                break  # the group is broken
    finally:
        receiver.close()
    return {"before": before, "join": None, "syncs": rows}


def scenario_join_only(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """Form the group on ``rank`` (0: sender) and report how long the join took; nothing is sent."""
    from genengine.transport import TransportSpec, get_transport

    transport = get_transport(spec["transport"])
    start = time.monotonic()
    try:
        end = transport.sender(TransportSpec(**spec)) if rank == 0 else transport.receiver(TransportSpec(**spec), rank)
        end.close()
        return {"seconds": time.monotonic() - start}
    except Exception as exc:
        return {**_error_row(exc), "seconds": time.monotonic() - start}


SCENARIOS: dict[str, Callable[..., Any]] = {
    "warm": warm,
    "send": scenario_send,
    "receive": scenario_receive,
    "join_only": scenario_join_only,
}


def _worker(index: int, jobs: Any, results: Any, model_dir: str, device: str) -> None:
    import torch

    torch.set_num_threads(1)  # the same arithmetic in every process (the test process too), polite on 2 cores
    configure(model_dir, device)
    while True:
        job = jobs.get()
        if job is None:
            return
        name, kwargs = job
        start = time.monotonic()
        try:
            value = SCENARIOS[name](**kwargs)
            results.put(Result(index, "ok", value, elapsed=time.monotonic() - start))
        except BaseException as exc:
            results.put(
                Result(
                    index,
                    "err",
                    None,
                    type(exc).__name__,
                    f"{exc}\n{traceback.format_exc()}",
                    [c.__name__ for c in type(exc).__mro__],
                    time.monotonic() - start,
                )
            )


# ---- in the test process -------------------------------------------------------------------------------------
class Pool:
    """Spawned workers under the given indices (the ranks they play); ``run`` gives each a job and collects
    every result (or notes its death)."""

    def __init__(self, indices: list[int], model_dir: str, devices: dict[int, str] | None = None) -> None:
        self._ctx = worker_context()  # forked from a server that imported torch once (support/start.py)
        self._model_dir = model_dir
        self._devices = devices or {}
        self._results: Any = self._ctx.Queue()
        self._workers: dict[int, tuple[Any, Any]] = {i: self._start(i) for i in indices}

    def _start(self, index: int) -> tuple[Any, Any]:
        jobs = self._ctx.Queue()
        proc = self._ctx.Process(
            target=_worker,
            args=(index, jobs, self._results, self._model_dir, self._devices.get(index, "cpu")),
            daemon=True,
        )
        proc.start()
        return proc, jobs

    def submit(self, jobs: dict[int, tuple[str, dict[str, Any]]]) -> None:
        """Hand each worker its job (a dead worker is restarted first); collect the results with :meth:`collect`."""
        for index in jobs:
            proc, _ = self._workers[index]
            if not proc.is_alive():
                self._workers[index] = self._start(index)
        for index, job in jobs.items():
            self._workers[index][1].put(job)

    def collect(self, indices: list[int], *, timeout_s: float = 120.0) -> dict[int, Result]:
        got: dict[int, Result] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(indices):
            try:
                result = self._results.get(timeout=0.2)
                got[result.rank] = result
                continue
            except queue.Empty:
                pass
            for index in indices:
                if index not in got and not self._workers[index][0].is_alive():
                    got[index] = Result(index, "died", message=f"exit code {self._workers[index][0].exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {sorted(set(indices) - set(got))} gave no result in {timeout_s} s")
        return got

    def run(self, jobs: dict[int, tuple[str, dict[str, Any]]], *, timeout_s: float = 120.0) -> dict[int, Result]:
        self.submit(jobs)
        return self.collect(list(jobs), timeout_s=timeout_s)

    def close(self) -> None:
        for proc, jobs in self._workers.values():
            if proc.is_alive():
                jobs.put(None)
        for proc, _ in self._workers.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
