"""Fakes for the sglang plugin's loop driver tests (tests/sglang_plugin/test_sglang_loop*.py): a stand-in shaped
like SGLang's tokenizer manager, and the caller's loops (asyncio or uvloop). They test our driver, not SGLang."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import pytest


class FakeTokenizerManager:
    """Imitates how SGLang 0.5.17's ``TokenizerManager`` uses its loop, to test *our* driver (it stands in for
    no SGLang behaviour a test claims): a receive task started lazily on the loop of the first request
    (``auto_create_handle_loop``) reads outputs from a socket, fed by another thread (the scheduler and
    detokenizer processes), and hands them to per-request events; ``abort_request`` is a sync call;
    ``generate_sync`` runs the loop itself, as every sync ``sgl.Engine`` method does."""

    def __init__(self, loop: Any) -> None:
        import queue

        self.loop = loop
        self._recv, self._send = socket.socketpair()
        self._recv.setblocking(False)
        self.event_loop: Any = None
        self.handle_loops = 0
        self.states: dict[str, tuple[Any, list[str]]] = {}
        self._submitted: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self._aborted: set[str] = set()
        self._scheduler = threading.Thread(target=self._schedule, daemon=True)
        self._scheduler.start()

    def auto_create_handle_loop(self) -> None:
        if self.event_loop is not None:
            return
        loop = asyncio.get_running_loop()
        self.event_loop = loop
        self.handle_task = loop.create_task(self._handle_loop())
        self.handle_loops += 1

    async def _handle_loop(self) -> None:
        loop = asyncio.get_running_loop()
        buffer = b""
        while True:
            buffer += await loop.sock_recv(self._recv, 65536)
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                rid, _, item = line.decode().partition(" ")
                state = self.states.get(rid)
                if state is not None:  # a late output of a request that is gone is dropped
                    state[1].append(item)
                    state[0].set()

    def emit(self, rid: str, item: str) -> None:
        self._send.sendall(f"{rid} {item}\n".encode())

    def _schedule(self) -> None:
        """One output per live request per step, as a batch."""
        import queue

        active: dict[str, list[int]] = {}
        while True:
            try:
                while True:
                    job = self._submitted.get(block=not active)
                    if job is None:
                        return
                    active[job[0]] = [0, job[1]]
            except queue.Empty:
                pass
            for rid, pos in list(active.items()):
                if rid in self._aborted:
                    self.emit(rid, "abort")
                    del active[rid]
                    continue
                self.emit(rid, str(pos[0]))
                pos[0] += 1
                if pos[0] == pos[1]:
                    self.emit(rid, "end")
                    del active[rid]
            time.sleep(0.001)

    async def generate_request(self, rid: str, n: int) -> Any:
        self.auto_create_handle_loop()
        event, out = asyncio.Event(), []
        self.states[rid] = (event, out)
        self._submitted.put((rid, n))
        try:
            while True:
                await event.wait()
                event.clear()
                items, out[:] = list(out), []
                for item in items:
                    yield item
                    if item in ("end", "abort"):
                        return
        finally:
            self.states.pop(rid, None)

    def abort_request(self, rid: str) -> None:
        self._aborted.add(rid)

    async def collect(self, rid: str, n: int) -> list[str]:
        return [item async for item in self.generate_request(rid, n)]

    def generate_sync(self, rid: str, n: int) -> list[str]:
        return list(self.loop.run_until_complete(self.collect(rid, n)))

    def close(self) -> None:
        self._submitted.put(None)
        self._scheduler.join(5)
        self._recv.close()
        self._send.close()


def new_loop(kind: str) -> Any:
    if kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")  # SGLang's loop on the GPU machine (it sets uvloop's policy)
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run_caller(kind: str, coro: Any) -> Any:
    """Run ``coro`` as a trainer's coroutine: on a loop of its own (of the same kind) in this thread."""
    loop = new_loop(kind)
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def no_loop_thread(timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(t.name == "genengine-sglang-loop" and t.is_alive() for t in threading.enumerate()):
            return True
        time.sleep(0.005)
    return False
