"""Turn a trainer's ``torch.distributed`` world into generation engines.

The reference (LightRFT's ``lightrft.strategy.sglang_utils``) splits the world into tensor-parallel (TP)
groups of contiguous ranks; the first rank of each group (its *leader*) owns the engine, drives the
GPUs ``local_rank .. local_rank + tp_size - 1`` of its node and listens on ``base_port + local_rank``.
This package is that mapping, engine-neutral, in two layers:

* :func:`compute_topology` is a pure function (no torch, no processes), so every layout can be checked
  exhaustively and printed by ``genengine topology``; :func:`topology_from_env` feeds it from the
  environment and the initialised default group.
* :func:`engine_group` builds (once per ``tp_size``) the TP process groups and returns an
  :class:`EngineGroup` whose helpers move data inside a group: outputs broadcast from the leader, weight
  handles gathered to it, inputs checked for equality, all with a deadline so that a dead or diverged
  rank raises :class:`~genengine.errors.CollectiveTimeoutError` instead of hanging the job.

Every check that can fail is a function of values all ranks share, so all ranks raise together rather
than some raising and the rest hanging in the next collective.
"""

from genengine.distributed.digests import input_digest
from genengine.distributed.groups import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    TIMEOUT_ENV,
    EngineGroup,
    clear_group_cache,
    default_collective_timeout_s,
    engine_group,
)
from genengine.distributed.topology import (
    DEFAULT_BASE_PORT,
    Topology,
    check_port_free,
    check_tp_group_ranks,
    compute_topology,
    group_seed,
    parse_cuda_visible_devices,
    topology_from_env,
)

__all__ = [
    "DEFAULT_BASE_PORT",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "TIMEOUT_ENV",
    "EngineGroup",
    "Topology",
    "check_port_free",
    "check_tp_group_ranks",
    "clear_group_cache",
    "compute_topology",
    "default_collective_timeout_s",
    "engine_group",
    "group_seed",
    "input_digest",
    "parse_cuda_visible_devices",
    "topology_from_env",
]
