"""Engine processes die with the trainer, however the trainer ends.

An engine that runs in other processes (SGLang's schedulers and detokenizer) must not outlive the trainer
that owns it: orphans keep their GPU memory and ports, and the next job on the machine fails. Two ways
a trainer ends need help:

* **It is killed** (SIGKILL, or SIGTERM with Python's default handler): no Python code runs. Each engine
  child must ask the kernel to kill it when its parent dies: :func:`set_parent_death_signal`, called
  first thing in the child (SGLang 0.5.17 does this itself in its scheduler and detokenizer).
* **It exits** (normal exit, an uncaught exception, Ctrl-C): ``atexit`` handlers run, and then
  ``multiprocessing`` *joins* every non-daemon child, so an engine whose processes serve forever hangs
  the exit unless they were stopped first. A backend that does not stop them through its engine's own
  atexit hook (SGLang's kills every child of the trainer, data-loader workers included) registers a
  local stop with :func:`at_exit` and cancels it in ``shutdown()``.

:func:`at_exit` runs before ``multiprocessing``'s join (atexit is last-in first-out and this module
imports ``multiprocessing.util`` before registering), bounds each stop by a timeout, then SIGKILLs the
registered processes that are still there, and never runs in a forked child of the registering process.
Imports nothing heavy.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import logging
import multiprocessing.util  # noqa: F401  registers its atexit join first, so ours runs before it
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = [
    "ExitHandle",
    "at_exit",
    "live_engines",
    "pending_exit_cleanups",
    "run_exit_cleanups",
    "set_parent_death_signal",
    "track_engine",
    "untrack_engine",
]

_log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux ``PR_SET_PDEATHSIG``).

    Call it first thing in an engine child process. If the parent already died before the call (the
    window between fork and here), the signal is sent at once. Returns False where the platform has
    no such call (nothing was set). The kernel's notion of "parent" is the *thread* that forked this
    process: start engine processes from a thread that lives as long as the trainer (the main thread).
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if parent == 1 or os.getppid() != parent:  # re-parented before the call: the parent is gone
        os.kill(os.getpid(), sig)
    return True


def _start_ticks(pid: int) -> int | None:
    """A process's start time (``/proc/PID/stat``), to tell it from a later process that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


class ExitHandle:
    """One registered stop; :meth:`cancel` it once the engine was shut down properly."""

    def __init__(self, cleanup: Callable[[], object], name: str, pids: Iterable[int], timeout_s: float) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._cleanup = cleanup
        self._owner_pid = os.getpid()
        self._pids = [(pid, _start_ticks(pid)) for pid in pids]
        self._done = False

    @property
    def active(self) -> bool:
        return not self._done

    def cancel(self) -> None:
        """Forget the stop (idempotent): the engine's own shutdown has run."""
        self._done = True
        with _LOCK:
            if self in _HANDLES:
                _HANDLES.remove(self)

    def run(self) -> None:
        """Run the stop now (bounded by ``timeout_s``), then SIGKILL registered processes still there."""
        if self._done or os.getpid() != self._owner_pid:
            return
        self._done = True
        failure: list[BaseException] = []

        def target() -> None:
            try:
                self._cleanup()
            except BaseException as exc:
                failure.append(exc)

        worker = threading.Thread(target=target, name=f"genengine-exit-{self.name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            _log.warning("genengine: stopping %s took more than %g s; killing its processes", self.name, self.timeout_s)
        elif failure:
            _log.warning("genengine: stopping %s at exit failed: %r; killing its processes", self.name, failure[0])
        self._kill_leftovers()
        with _LOCK:
            if self in _HANDLES:
                _HANDLES.remove(self)

    def _kill_leftovers(self) -> None:
        alive = [(pid, ticks) for pid, ticks in self._pids if ticks is not None and _start_ticks(pid) == ticks]
        for pid, _ in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while alive and time.monotonic() < deadline:
            alive = [(pid, ticks) for pid, ticks in alive if _start_ticks(pid) == ticks]
            if alive:
                time.sleep(0.02)

    def __repr__(self) -> str:
        return f"ExitHandle({self.name!r}, active={self.active}, pids={[p for p, _ in self._pids]})"


_LOCK = threading.Lock()
_HANDLES: list[ExitHandle] = []
_REGISTERED = False


def at_exit(
    cleanup: Callable[[], object], *, name: str, pids: Iterable[int] = (), timeout_s: float = 60.0
) -> ExitHandle:
    """Run ``cleanup`` when this process exits without having cancelled the returned handle.

    ``cleanup`` stops the engine locally (no collective: the other ranks may be gone); ``pids`` are the
    engine's processes, SIGKILLed if they are still there after ``cleanup`` returned, failed or ran past
    ``timeout_s``. Stops run newest first, before ``multiprocessing`` joins its children.
    """
    global _REGISTERED
    if not callable(cleanup):
        raise TypeError(f"cleanup must be callable, got {type(cleanup).__name__}")
    handle = ExitHandle(cleanup, name, list(pids), float(timeout_s))
    with _LOCK:
        _HANDLES.append(handle)
        if not _REGISTERED:
            atexit.register(run_exit_cleanups)
            _REGISTERED = True
    return handle


def pending_exit_cleanups() -> list[ExitHandle]:
    """The stops that would run at exit now (newest last)."""
    with _LOCK:
        return [h for h in _HANDLES if h.active]


def run_exit_cleanups() -> None:
    """Run every pending stop, newest first. The atexit hook; also callable from a trainer's signal handler."""
    while True:
        with _LOCK:
            if not _HANDLES:
                return
            handle = _HANDLES.pop()
        handle.run()


# ---- the engines of this process ------------------------------------------------------------------------------
_E = TypeVar("_E")
_LIVE_LOCK = threading.Lock()
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def track_engine(engine: object) -> None:
    """Count ``engine`` among this process's live engines, once it has started (weakly: it is not kept alive).

    Backends whose engine holds process-global state (vLLM's parallel state, LightRFT's module-level
    ``sgl_model_saver``) ask :func:`live_engines`; every backend tracks the same way, here.
    """
    with _LIVE_LOCK:
        _LIVE.add(engine)


def untrack_engine(engine: object, kind: type[_E] | None = None) -> list[_E]:
    """Forget ``engine`` (at its shutdown); returns the tracked engines of ``kind`` left (none without it).

    Forgetting and reading the rest is one step, so two engines shut down at once do not both find
    themselves the last one.
    """
    with _LIVE_LOCK:
        _LIVE.discard(engine)
        return [] if kind is None else [e for e in list(_LIVE) if isinstance(e, kind)]


def live_engines(kind: type[_E]) -> list[_E]:
    """The tracked engines of ``kind`` (subclasses included) that are not shut down."""
    with _LIVE_LOCK:
        found = [e for e in list(_LIVE) if isinstance(e, kind)]
    return [e for e in found if not getattr(e, "closed", False)]
