"""Process-tree and resource probes for the reliability tests: who is still running, and what a process holds.

A trainer that dies must not leave engine processes (and the GPU memory they hold) behind. Checking that
needs more than ``Popen.wait``: the engine's processes are grandchildren, and once their parent is gone
they are re-parented and no longer show as anyone's descendants. So the helpers here work from
snapshots (``descendants`` while the tree is alive, identified by pid *and* start time, so a recycled
pid is never mistaken for a survivor) and from an environment marker that every descendant inherits
(``find_by_environ``), which finds orphans wherever they were re-parented.

Linux reads ``/proc`` directly; elsewhere ``psutil`` is used when it is installed. Imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MARK_ENV",
    "ProcessInfo",
    "TrainerOutcome",
    "TrainerRun",
    "children",
    "cpu_seconds",
    "descendants",
    "find_by_environ",
    "is_alive",
    "kill_all",
    "open_fd_count",
    "process_info",
    "rss_bytes",
    "thread_count",
    "wait_gone",
]

_PROC = Path("/proc")
_TESTS = str(Path(__file__).resolve().parents[1])  # tests/, where ``support`` is imported from


@dataclass(frozen=True)
class ProcessInfo:
    """One process as seen at one moment; ``(pid, start_ticks)`` identifies it across pid reuse."""

    pid: int
    ppid: int
    start_ticks: int
    """Start time in clock ticks since boot (``/proc/PID/stat`` field 22); with psutil, its create time in ms."""
    state: str
    """``R``, ``S``, ``D``, ``Z`` (zombie: exited, not reaped), ``X``, ...; ``?`` when unknown."""
    name: str

    def describe(self) -> str:
        return f"pid {self.pid} ({self.name}, parent {self.ppid}, state {self.state})"


def _have_proc() -> bool:
    return sys.platform.startswith("linux") and _PROC.is_dir()


def _psutil() -> Any:
    try:
        import psutil
    except ImportError as exc:  # pragma: no cover - only off Linux
        raise RuntimeError("support.processes (tests/support) needs /proc (Linux) or psutil") from exc
    return psutil


def _stat_fields(text: str) -> list[str]:
    """The fields after the name of a ``/proc/PID/stat`` line (state first); the name may hold spaces and ')'."""
    return text[text.rfind(")") + 2 :].split()


def _parse_stat(text: str) -> tuple[str, str, int, int]:
    """(name, state, ppid, start_ticks) from a ``/proc/PID/stat`` line."""
    name = text[text.find("(") + 1 : text.rfind(")")]
    fields = _stat_fields(text)
    return name, fields[0], int(fields[1]), int(fields[19])


def _read_stat(pid: int) -> str | None:
    """``/proc/PID/stat``, or None when the process is gone."""
    try:
        return (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def process_info(pid: int) -> ProcessInfo | None:
    """The process ``pid`` now, or None when there is none."""
    if _have_proc():
        text = _read_stat(pid)
        if text is None:
            return None
        name, state, ppid, start = _parse_stat(text)
        return ProcessInfo(pid, ppid, start, state, name)
    psutil = _psutil()  # pragma: no cover - only off Linux
    try:  # pragma: no cover
        p = psutil.Process(pid)
        with p.oneshot():
            status = p.status()
            state = "Z" if status == "zombie" else status[:1].upper()
            return ProcessInfo(pid, p.ppid(), int(p.create_time() * 1000), state, p.name())
    except Exception:  # pragma: no cover
        return None


def _all_processes() -> list[ProcessInfo]:
    if _have_proc():
        found = []
        for entry in _PROC.iterdir():
            if entry.name.isdigit():
                info = process_info(int(entry.name))
                if info is not None:
                    found.append(info)
        return found
    psutil = _psutil()  # pragma: no cover
    return [i for i in (process_info(p) for p in psutil.pids()) if i is not None]  # pragma: no cover


def children(pid: int) -> list[ProcessInfo]:
    """The direct children of ``pid`` (zombies included: they are still the parent's to reap)."""
    return [p for p in _all_processes() if p.ppid == pid and p.pid != pid]


def descendants(pid: int) -> list[ProcessInfo]:
    """Every process below ``pid`` in the tree right now, parents before their children."""
    by_parent: dict[int, list[ProcessInfo]] = {}
    for p in _all_processes():
        by_parent.setdefault(p.ppid, []).append(p)
    out: list[ProcessInfo] = []
    todo = [pid]
    seen = {pid}
    while todo:
        for child in sorted(by_parent.get(todo.pop(0), []), key=lambda p: p.pid):
            if child.pid not in seen:
                seen.add(child.pid)
                out.append(child)
                todo.append(child.pid)
    return out


def find_by_environ(key: str, value: str) -> list[ProcessInfo]:
    """Live processes (of this user) whose environment holds ``key=value``: a marker every descendant inherits.

    Finds a dead trainer's orphans wherever they were re-parented. Linux only (reads ``/proc/PID/environ``).
    """
    if not _have_proc():  # pragma: no cover
        raise RuntimeError("find_by_environ reads /proc/PID/environ (Linux only)")
    needle = f"{key}={value}".encode()
    found = []
    for info in _all_processes():
        if info.pid == os.getpid():
            continue
        try:
            env = (_PROC / str(info.pid) / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and is_alive(info):
            found.append(info)
    return found


def is_alive(info: ProcessInfo) -> bool:
    """True while the very process of ``info`` runs (not exited, not a zombie, pid not reused)."""
    now = process_info(info.pid)
    return now is not None and now.start_ticks == info.start_ticks and now.state not in ("Z", "X")


def wait_gone(procs: Iterable[ProcessInfo], timeout_s: float, *, poll_s: float = 0.1) -> list[ProcessInfo]:
    """Wait until every process of ``procs`` is gone; return those still alive after ``timeout_s``."""
    pending = list(procs)
    deadline = time.monotonic() + timeout_s
    while True:
        pending = [p for p in pending if is_alive(p)]
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(poll_s)


def kill_all(procs: Iterable[ProcessInfo], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each process of ``procs`` that is still the same process (cleanup after a failed test)."""
    for p in procs:
        if is_alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)


# ---- what one process holds -------------------------------------------------------------------------------
def open_fd_count(pid: int | None = None) -> int:
    """Open file descriptors of ``pid`` (default: this process)."""
    where = "self" if pid is None else str(pid)
    if _have_proc():
        return len(os.listdir(_PROC / where / "fd"))
    psutil = _psutil()  # pragma: no cover
    return int(psutil.Process(pid).num_fds())  # pragma: no cover


def thread_count(pid: int | None = None) -> int:
    """OS threads of ``pid`` (default: this process), native ones (torch, gloo, ZMQ) included."""
    if pid is None and not _have_proc():  # pragma: no cover
        return threading.active_count()
    if _have_proc():
        return len(os.listdir(_PROC / ("self" if pid is None else str(pid)) / "task"))
    psutil = _psutil()  # pragma: no cover
    return int(psutil.Process(pid).num_threads())  # pragma: no cover


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds ``pid`` has used (``/proc/PID/stat`` fields 14-15), or None when it is gone."""
    if _have_proc():
        text = _read_stat(pid)
        if text is None:
            return None
        fields = _stat_fields(text)
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    psutil = _psutil()  # pragma: no cover
    try:  # pragma: no cover
        times = psutil.Process(pid).cpu_times()
        return float(times.user + times.system)
    except Exception:  # pragma: no cover
        return None


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of ``pid`` (default: this process), from ``/proc/PID/statm``."""
    if _have_proc():
        fields = (_PROC / ("self" if pid is None else str(pid)) / "statm").read_text().split()
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
    psutil = _psutil()  # pragma: no cover
    return int(psutil.Process(pid).memory_info().rss)  # pragma: no cover


# ---- a trainer child, ended one way or another ------------------------------------------------------------
MARK_ENV = "GENENGINE_TEST_PROCESS_MARK"
"""Environment variable carrying a run's marker: every process the child starts inherits it."""


def _default_sigint() -> None:
    """In the child, before it runs: SIGINT's default disposition."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


SIGNAL_ENDINGS = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sigkill": signal.SIGKILL}


@dataclass
class TrainerOutcome:
    """How one ended trainer child went, and what it left behind."""

    ending: str
    returncode: int | None
    """None when the child had not exited ``exit_timeout_s`` after its ending (then it was killed)."""
    exit_seconds: float
    """From the ending (signal sent, or the child told to end) to the child's exit."""
    tree: list[ProcessInfo]
    """The child's descendants when it reported ready."""
    survivors: list[ProcessInfo]
    """Processes of the run (its tree, or anything carrying its marker) alive ``gone_timeout_s`` after the exit."""
    ready_line: str
    output: str

    def describe(self) -> str:
        alive = ", ".join(p.describe() for p in self.survivors) or "none"
        return (
            f"ending {self.ending!r}: returncode {self.returncode}, exited after {self.exit_seconds:.1f} s, "
            f"tree at ready {[p.pid for p in self.tree]}, survivors: {alive}\n--- output ---\n{self.output[-4000:]}"
        )


class TrainerRun:
    """A child process that prints a line starting with ``READY`` once its engine is up, then gets ended.

    ``ending`` ``sigterm``/``sigint``/``sigkill`` sends that signal after READY; any other ending is the
    child's own business (the caller passes it in ``argv``: e.g. exit normally or raise), done when the
    child reads a line from its stdin, which is written once the process tree has been recorded. Start
    several runs before finishing any: they proceed in parallel.
    """

    def __init__(
        self, argv: list[str], ending: str, *, env: dict[str, str] | None = None, log_path: str | None = None
    ) -> None:
        """``log_path``: also append the child's output there as it comes (a run killed from outside keeps it)."""
        import secrets
        import subprocess

        self.ending = ending
        self.log_path = log_path
        self.marker = secrets.token_hex(8)
        full_env = dict(os.environ if env is None else env)
        full_env[MARK_ENV] = self.marker
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        # A test file run as the child script sits in its topic's folder (tests/core/...): it imports ``support``
        # from tests/, which the script's own folder on ``sys.path`` does not give.
        full_env["PYTHONPATH"] = os.pathsep.join([_TESTS, *filter(None, [full_env.get("PYTHONPATH")])])
        self._lines: list[str] = []
        self._ready = threading.Event()
        self._ready_line = ""
        # A suite started in the background by a shell (``cmd &``) inherits SIGINT ignored, and so would the
        # child: Python then installs no KeyboardInterrupt handler and the SIGINT ending tests nothing. A trainer
        # run from a terminal has SIGINT's default; give the child that.
        inherited_ignore = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        self.proc = subprocess.Popen(
            argv,
            env=full_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            preexec_fn=_default_sigint if inherited_ignore else None,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        log = open(self.log_path, "a", encoding="utf-8") if self.log_path else None  # noqa: SIM115
        try:
            for line in self.proc.stdout:
                self._lines.append(line)
                if log is not None:
                    log.write(line)
                    log.flush()
                self._check_ready(line)
        finally:
            if log is not None:
                log.close()

    def _check_ready(self, line: str) -> None:
        if line.startswith("READY") and not self._ready.is_set():
            self._ready_line = line.strip()
            self._ready.set()

    @property
    def output(self) -> str:
        return "".join(self._lines)

    def finish(
        self, *, ready_timeout_s: float = 120.0, exit_timeout_s: float = 60.0, gone_timeout_s: float = 30.0
    ) -> TrainerOutcome:
        """Wait for READY, end the child, wait for its exit and for every process of the run to be gone."""
        import subprocess

        deadline = time.monotonic() + ready_timeout_s
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._reader.join(2)
                self._kill_run([])
                raise RuntimeError(
                    f"the trainer child ({self.ending}) never reported READY "
                    f"(returncode {self.proc.poll()}):\n{self.output[-4000:]}"
                )
        tree = descendants(self.proc.pid)
        start = time.monotonic()
        sig = SIGNAL_ENDINGS.get(self.ending)
        if sig is not None:
            self.proc.send_signal(sig)
        else:
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError):
                self.proc.stdin.write("END\n")
                self.proc.stdin.close()
        try:
            returncode: int | None = self.proc.wait(exit_timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
            tree = descendants(self.proc.pid) or tree
            self.proc.kill()
            self.proc.wait(10)
        exit_seconds = time.monotonic() - start
        self._reader.join(1)  # orphans that inherited stdout keep the pipe open: do not wait for EOF
        pending = {(p.pid, p.start_ticks): p for p in tree}
        pending.update({(p.pid, p.start_ticks): p for p in find_by_environ(MARK_ENV, self.marker)})
        survivors = wait_gone(pending.values(), gone_timeout_s)
        self._kill_run(survivors)
        self._reader.join(2)
        return TrainerOutcome(self.ending, returncode, exit_seconds, tree, survivors, self._ready_line, self.output)

    def _kill_run(self, known: list[ProcessInfo]) -> None:
        """Leave nothing of this run behind, whatever the test concludes."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        leftovers = {(p.pid, p.start_ticks): p for p in known}
        leftovers.update({(p.pid, p.start_ticks): p for p in find_by_environ(MARK_ENV, self.marker)})
        kill_all(leftovers.values())
        wait_gone(leftovers.values(), 10)
