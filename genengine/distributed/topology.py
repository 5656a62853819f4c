"""Where each rank sits: the trainer's world split into TP groups, their leaders, GPUs and ports.

:func:`compute_topology` is pure (no torch, no processes), so every layout can be checked exhaustively
and printed by ``genengine topology`` without a GPU; :func:`topology_from_env` feeds it from torchrun's
variables and the initialised default group, importing torch only when called.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Sequence
from typing import Any

from genengine.errors import DistributedSetupError, InvalidArgumentError

__all__ = [
    "DEFAULT_BASE_PORT",
    "Topology",
    "check_port_free",
    "check_tp_group_ranks",
    "compute_topology",
    "group_seed",
    "parse_cuda_visible_devices",
    "topology_from_env",
]

#: The reference's engine port base (``40000 + local_rank``).
DEFAULT_BASE_PORT = 40000

_MAX_PORT = 65535


def group_seed(seed: int, topology: Topology | None) -> int:
    """``seed`` plus the index of this rank's TP group (0 without a trainer world).

    Data-parallel engines built from one config would otherwise draw one random stream, and a GRPO group whose
    samples are spread over ranks would repeat its completions; the ranks of one TP group keep the same seed,
    as they must sample alike. The Ray pool gives its replicas ``seed + index`` for the same reason.
    """
    return seed if topology is None else seed + topology.dp_rank


# --- topology (pure) ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Topology:
    """Where one rank sits: its TP group, the group's engine, and the GPUs and port that engine uses.

    GPU numbers come in two kinds. ``gpu_id``/``base_gpu_id``/``gpu_ids`` are CUDA ordinals as this
    process sees them (what ``torch.cuda.set_device`` and SGLang's ``base_gpu_id`` take);
    ``physical_gpu_ids`` are the same GPUs as ``CUDA_VISIBLE_DEVICES`` names them (what CUDA-IPC handles
    and ``nvidia-smi`` need when processes see different device lists).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    tp_size: int
    dp_size: int
    #: This rank's index inside its TP group.
    tp_rank: int
    #: Index of this rank's TP group (= of its engine) in the world.
    dp_rank: int
    tp_group_ranks: tuple[int, ...]
    #: The group's first rank; the only one that creates an engine.
    leader_rank: int
    node_rank: int
    num_nodes: int
    #: Nodes one engine spans: 1 unless the backend allows multi-node engines.
    engine_num_nodes: int
    #: This rank's own CUDA ordinal (one GPU per rank, as torchrun lays them out).
    gpu_id: int
    #: First CUDA ordinal of the engine on this rank's node.
    base_gpu_id: int
    #: CUDA ordinals of the engine's GPUs on this rank's node.
    gpu_ids: tuple[int, ...]
    #: ``gpu_ids`` remapped through ``CUDA_VISIBLE_DEVICES`` (indices, UUIDs or MIG ids, as written there).
    physical_gpu_ids: tuple[str, ...]
    #: The engine's port on its leader's node: ``base_port + leader's local_rank``, unique per node.
    port: int

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader_rank

    @property
    def leader_local_rank(self) -> int:
        return self.leader_rank % self.local_world_size

    def all_tp_group_ranks(self) -> list[list[int]]:
        """Every TP group of the world, in the order ``new_subgroups_by_enumeration`` must see them."""
        return [list(range(s, s + self.tp_size)) for s in range(0, self.world_size, self.tp_size)]


def parse_cuda_visible_devices(value: str | None) -> tuple[str, ...] | None:
    """``CUDA_VISIBLE_DEVICES`` as a tuple; None when unset (every GPU visible, ordinal = id).

    Like CUDA, an empty string hides every GPU and a negative entry ends the list.
    """
    if value is None:
        return None
    ids: list[str] = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        if item.startswith("-"):
            break
        ids.append(item)
    return tuple(ids)


def _check_int(name: str, value: object, minimum: int, allowed: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an int ({allowed}); got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be {allowed}; got {value}")
    return value


def format_ranks(ranks: Sequence[int]) -> str:
    return "[" + ", ".join(str(r) for r in ranks) + "]"


def compute_topology(
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    tp_size: int,
    cuda_visible_devices: Sequence[str] | None = None,
    base_port: int = DEFAULT_BASE_PORT,
    *,
    allow_multi_node: bool = False,
) -> Topology:
    """The topology of ``rank``; raises if the layout cannot host engines of ``tp_size``.

    Ranks are assumed placed as torchrun places them: node ``n`` holds ranks
    ``n * local_world_size .. (n + 1) * local_world_size - 1`` and rank ``r`` drives CUDA ordinal
    ``r % local_world_size``. The errors depend only on values every rank shares, never on ``rank``,
    so a whole world fails together.

    Raises:
        InvalidArgumentError: ``tp_size`` or ``base_port`` is not an int in range.
        DistributedSetupError: the world cannot be split into such engines (an ``AssertionError``,
            as in the reference, raised explicitly so ``python -O`` keeps it).
    """
    tp_size = _check_int("tp_size", tp_size, 1, "an int >= 1 that divides the world size")
    for name, value in (("world_size", world_size), ("local_world_size", local_world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DistributedSetupError(f"{name} must be an int >= 1; got {value!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise DistributedSetupError(f"rank must be an int in [0, {world_size}); got {rank!r}")
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or not 0 <= local_rank < local_world_size:
        raise DistributedSetupError(f"local_rank must be an int in [0, {local_world_size}); got {local_rank!r}")
    if (
        isinstance(base_port, bool)
        or not isinstance(base_port, int)
        or not (base_port >= 1 and base_port + local_world_size - 1 <= _MAX_PORT)
    ):
        raise InvalidArgumentError(
            f"base_port must be an int with base_port + local_world_size - 1 <= {_MAX_PORT} "
            f"(one port per local rank); got base_port={base_port!r}, local_world_size={local_world_size}"
        )

    # The reference's check.
    if world_size % tp_size != 0:
        raise DistributedSetupError(
            f"world size {world_size} is not divisible by tp_size {tp_size}: every rank must belong to "
            f"exactly one tensor-parallel group (choose a tp_size that divides {world_size})"
        )
    if world_size % local_world_size != 0:
        raise DistributedSetupError(
            f"world size {world_size} is not a multiple of local world size {local_world_size}: "
            "every node must run the same number of ranks"
        )
    if rank % local_world_size != local_rank:
        raise DistributedSetupError(
            f"rank {rank} has local_rank {local_rank}, expected {rank % local_world_size} "
            f"(= rank % local_world_size {local_world_size}): ranks must be placed on nodes in contiguous "
            "blocks, as torchrun does, for a TP group of contiguous ranks to share a node"
        )

    visible = None if cuda_visible_devices is None else tuple(str(d) for d in cuda_visible_devices)
    gpus_per_node = local_world_size if visible is None else len(visible)
    where = "LOCAL_WORLD_SIZE" if visible is None else f"CUDA_VISIBLE_DEVICES={','.join(visible)!r}"
    if tp_size > local_world_size:
        if not allow_multi_node:
            raise DistributedSetupError(
                f"tp_size {tp_size} is larger than the {local_world_size} ranks (GPUs) of a node "
                f"(local world size {local_world_size}): the TP group would cross a node boundary and this "
                "backend cannot span nodes; use tp_size <= local world size"
            )
        if tp_size % local_world_size != 0:
            raise DistributedSetupError(
                f"tp_size {tp_size} is not a multiple of local world size {local_world_size}: a multi-node "
                "engine must take whole nodes"
            )
    elif local_world_size % tp_size != 0:
        first = next(
            s for s in range(0, world_size, tp_size) if s // local_world_size != (s + tp_size - 1) // local_world_size
        )
        raise DistributedSetupError(
            f"TP group {format_ranks(range(first, first + tp_size))} crosses the boundary between node "
            f"{first // local_world_size} and node {first // local_world_size + 1}: tp_size {tp_size} does "
            f"not divide local world size {local_world_size}"
            + ("" if allow_multi_node else " (and this backend cannot span nodes)")
        )
    engine_gpus_per_node = min(tp_size, local_world_size)
    if engine_gpus_per_node > gpus_per_node:
        raise DistributedSetupError(
            f"tp_size {tp_size} needs {engine_gpus_per_node} GPUs on a node but only {gpus_per_node} "
            f"are visible ({where})"
        )
    if local_world_size > gpus_per_node:
        raise DistributedSetupError(
            f"GPU ids {format_ranks(range(gpus_per_node, local_world_size))} (of local ranks "
            f"{gpus_per_node}..{local_world_size - 1}) are outside {where}: each of the "
            f"{local_world_size} ranks of a node needs its own visible GPU, and an engine's leader must "
            "see every GPU of its group"
        )

    dp_rank, tp_rank = divmod(rank, tp_size)
    leader = dp_rank * tp_size
    group = tuple(range(leader, leader + tp_size))
    node_rank = rank // local_world_size
    on_node = [r % local_world_size for r in group if r // local_world_size == node_rank]
    gpu_ids = tuple(on_node)
    physical = tuple(str(g) for g in gpu_ids) if visible is None else tuple(visible[g] for g in gpu_ids)
    return Topology(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        tp_size=tp_size,
        dp_size=world_size // tp_size,
        tp_rank=tp_rank,
        dp_rank=dp_rank,
        tp_group_ranks=group,
        leader_rank=leader,
        node_rank=node_rank,
        num_nodes=world_size // local_world_size,
        engine_num_nodes=max(1, tp_size // local_world_size),
        gpu_id=local_rank,
        base_gpu_id=gpu_ids[0],
        gpu_ids=gpu_ids,
        physical_gpu_ids=physical,
        port=base_port + leader % local_world_size,
    )


def check_tp_group_ranks(ranks: Sequence[int], topology: Topology, *, what: str = "the TP group") -> None:
    """Refuse a TP group handed in by the trainer (LightRFT's ``tp_group_cpu``) that is not ``topology``'s
    group of contiguous ranks, e.g. ``[0, 2]`` in a world of 4 with ``tp_size`` 2.

    Every member of such a group sees the same ranks, and none of them has that group as its own block (a
    block belongs to all its members or to none), so the whole group raises together, before any engine starts.

    Raises:
        DistributedSetupError: the ranks differ (an ``AssertionError``, as the reference's layout errors,
            raised explicitly so ``python -O`` keeps it).
    """
    got = tuple(int(r) for r in ranks)
    if got != topology.tp_group_ranks:
        groups = ", ".join(format_ranks(g) for g in topology.all_tp_group_ranks())
        raise DistributedSetupError(
            f"{what} holds ranks {format_ranks(got)}, but rank {topology.rank}'s TP group of {topology.tp_size} "
            f"contiguous ranks is {format_ranks(topology.tp_group_ranks)}: a world of {topology.world_size} splits "
            f"into the TP groups {groups} (torch.distributed.new_subgroups_by_enumeration builds them)"
        )


# --- topology (from the environment) ---------------------------------------------------------------------
def torch_dist() -> Any:
    import torch.distributed as dist

    return dist


def _require_initialized() -> Any:
    dist = torch_dist()
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedSetupError(
            "torch.distributed is not initialised: the trainer owns the process group and must call "
            "torch.distributed.init_process_group() before an engine is created"
        )
    return dist


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedSetupError(f"environment variable {name}={raw!r} is not an integer") from None


def topology_from_env(
    tp_size: int,
    *,
    allow_multi_node: bool = False,
    base_port: int = DEFAULT_BASE_PORT,
) -> Topology:
    """This rank's topology from the initialised default group and torchrun's variables.

    ``RANK``/``WORLD_SIZE``, when set, must agree with the group. ``LOCAL_WORLD_SIZE`` defaults to the
    world size (one node) and ``LOCAL_RANK`` to ``rank % LOCAL_WORLD_SIZE``: set both on several nodes.
    """
    dist = _require_initialized()
    rank, world_size = int(dist.get_rank()), int(dist.get_world_size())
    for name, actual in (("RANK", rank), ("WORLD_SIZE", world_size)):
        env = _env_int(name)
        if env is not None and env != actual:
            raise DistributedSetupError(
                f"environment variable {name}={env} disagrees with the initialised default group ({actual})"
            )
    local_world_size = _env_int("LOCAL_WORLD_SIZE") or world_size
    local_rank = _env_int("LOCAL_RANK")
    if local_rank is None:
        local_rank = rank % local_world_size
    return compute_topology(
        rank,
        world_size,
        local_rank,
        local_world_size,
        tp_size,
        parse_cuda_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES")),
        base_port,
        allow_multi_node=allow_multi_node,
    )


def check_port_free(port: int, host: str = "") -> None:
    """Raise if nothing can listen on ``port`` here (an engine or the rendezvous already does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As servers do, so that a port in TIME_WAIT counts as free; a listening socket still blocks.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise DistributedSetupError(
                f"engine port {port} is already in use on this node ({exc.strerror}); pass another "
                "base_port (ports base_port .. base_port + local world size - 1 must be free)"
            ) from None


def port_problem(topo: Topology) -> str | None:
    """Why the leader cannot use its port, or None. Only meaningful on the leader."""
    master_port = _env_int("MASTER_PORT")
    if master_port is not None and topo.node_rank == 0 and topo.port == master_port:
        return (
            f"engine port {topo.port} (base_port {topo.port - topo.leader_local_rank} + local_rank "
            f"{topo.leader_local_rank}) is MASTER_PORT, the rendezvous of torch.distributed; pass another "
            "base_port"
        )
    try:
        check_port_free(topo.port)
    except DistributedSetupError as exc:
        return str(exc)
    return None
