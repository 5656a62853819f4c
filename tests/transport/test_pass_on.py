"""The pass-on of a colocated replica's tensors as an explicit interface (issue 42 point 4), on CPU.

An engine declares that its loads hand their tensors on to another process (``passes_tensors_on``); a
``cuda_ipc`` receiver announces that at the start of each sync, and the sender shares each tensor a second time
only when some receiver announced it; the spares live in one ``ipc.PassOn`` per sync, which the receiver hands
to the load session (``LoadSession.pass_on``): no process-wide table, no count in the acknowledgement. The GPU
half (real handles, a third process) is ``tests/gpu/test_transport_gpu.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from genengine.engine import ipc
from genengine.transport import cuda_ipc
from genengine.transport.broadcast import STATUS_WIDTH, _Buffers
from genengine.transport.spec import TransportSpec


class _Stop(Exception):
    """Ends a sync where the test has seen what it looks at."""


class _Group:
    """The control group as one end sees it: records what it sends, answers gathers with ``rows``."""

    def __init__(self, rows: dict[int, list[int]] | None = None) -> None:
        self.spec = TransportSpec(
            transport="cuda_ipc", address="127.0.0.1:1", world_size=3, group_name="g", bucket_bytes=1 << 20
        )
        self.rank = 0
        self.rows = rows or {}
        self.sent: list[list[int]] = []
        self.gathers: list[tuple[int, str]] = []

    def check_usable(self) -> None:
        return

    def describe(self, op: str) -> str:
        return op

    def send_status(self, status: list[int], op: str) -> None:
        self.sent.append(list(status))

    def gather_status(self, width: int, op: str) -> dict[int, list[int]]:
        self.gathers.append((width, op))
        return {r: row[:width] for r, row in self.rows.items()}

    def broadcast_bytes(self, data: bytes | None, op: str) -> bytes:
        raise _Stop(op)


class _Engine:
    def __init__(self, passes: Any) -> None:
        if passes is not None:
            self.passes_tensors_on = passes


@pytest.mark.parametrize(("passes", "word"), [(True, 1), (False, 0), (None, 0), ("yes", 0)])
def test_a_receiver_announces_its_engines_pass_on_before_anything_else(passes: Any, word: int) -> None:
    group = _Group()
    receiver = cuda_ipc.CudaIpcReceiver.__new__(cuda_ipc.CudaIpcReceiver)
    receiver.group = group  # type: ignore[assignment]
    with pytest.raises(_Stop, match="waiting for the sync's metadata"):
        receiver.receive(_Engine(passes))  # type: ignore[arg-type]
    assert group.sent == [[word]]  # its first word of the sync: before the metadata


@pytest.mark.parametrize(("rows", "spares"), [({1: [0], 2: [1]}, True), ({1: [0], 2: [0]}, False)])
def test_the_sender_shares_spares_only_when_a_receiver_announced_a_pass_on(
    rows: dict[int, list[int]], spares: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []

    def share(bufs: Any, plan: Any, with_spares: bool, handles: str) -> Any:
        seen.append(with_spares)
        raise _Stop("shared")

    monkeypatch.setattr(cuda_ipc, "_share", share)
    group = _Group(rows)
    sender = cuda_ipc.CudaIpcSender.__new__(cuda_ipc.CudaIpcSender)
    sender.group, sender._seq = group, 0  # type: ignore[assignment]
    sender._device = torch.device("cpu")
    sender._buffers = _Buffers(sender._device)
    with pytest.raises(_Stop, match="shared"):
        sender.send([("w", torch.ones(4))], version=1)
    assert seen == [spares]
    assert group.gathers[0] == (cuda_ipc.ANNOUNCE_WIDTH, "waiting for every replica to announce itself for the sync")


def test_the_acknowledgement_is_the_broadcast_transports_own() -> None:
    """No pass-on count rides in ``cuda_ipc``'s acknowledgement any more: its status rows are the broadcast ones."""
    assert not hasattr(cuda_ipc, "IPC_STATUS_WIDTH")
    assert STATUS_WIDTH == 3


def test_ipc_keeps_no_process_wide_table() -> None:
    """What was ``_SPARE``/``_PASSES`` (module globals every sync in the process shared) is per ``PassOn``."""
    tables = [n for n, v in vars(ipc).items() if isinstance(v, (dict, list, set)) and not n.startswith("__")]
    assert tables == [] and not hasattr(ipc, "passes") and not hasattr(ipc, "settle")


def _spare(tag: int) -> tuple[Any, ...]:
    """A stand-in for ``ipc.share``'s arguments (torch's ``rebuild_cuda_tensor`` layout: 15 of them)."""
    return (
        torch.Tensor,
        (9,),
        (1,),
        0,
        f"storage-{tag}",
        torch.float32,
        5,
        f"handle-{tag}",
        36,
        0,
        False,
        f"ref-{tag}",
        0,
        f"event-{tag}",
        True,
    )


def test_a_pass_on_lends_per_sync_and_passes_each_spare_once(monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[Any] = []
    monkeypatch.setattr(ipc, "release", lambda shares: released.extend(shares))
    one, other = ipc.PassOn(), ipc.PassOn()
    base = torch.arange(12, dtype=torch.float32)
    view = base[3:]  # an opened tensor's view at an offset of its storage
    one.lend(base, _spare(1), device_index=0, shift=2)
    assert len(one) == 1 and len(other) == 0  # another sync's object sees nothing of it
    assert other._passed_on(view) is None
    rebuild, args = one._passed_on(view)
    assert rebuild.__name__ == "rebuild_cuda_tensor"
    assert args[1:4] == (torch.Size([9]), (1,), 2 + 3)  # the view's geometry, shifted into the spare's storage
    assert args[6] == 0 and args[7] == "handle-1" and args[14] is False  # this GPU, no event to wait on
    assert one.passed == 1 and other.passed == 0
    one.lend(base, _spare(2), device_index=0)
    one.settle([view])  # the spare not passed on goes back to its producer, once
    assert len(released) == 1 and released[0][7] == "handle-2" and len(one) == 0
    one.settle([view])
    assert len(released) == 1


def test_dumps_without_a_pass_on_is_torchs_pickle() -> None:
    from multiprocessing.reduction import ForkingPickler

    obj = [("w", 3), {"k": b"v"}]
    assert ipc.dumps(obj) == ipc.dumps(obj, ipc.PassOn()) == bytes(ForkingPickler.dumps(obj))
