"""genengine.distributed: the pure topology exhaustively, then real gloo process groups in worker processes.

No process group is mocked: the distributed tests run torch.distributed over TCP in a pool of spawned
workers (tests/support/dist_worker.py), with several simulated nodes where LOCAL_WORLD_SIZE < WORLD_SIZE.
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import dist_worker as dw

from genengine import distributed as gd
from genengine.cli.topology import add_parser
from genengine.errors import DistributedSetupError, InvalidArgumentError

pytestmark = pytest.mark.timeout(120)


# --- the pure topology -----------------------------------------------------------------------------------
def _oracle_error(ws: int, lws: int, tp: int, visible: tuple[str, ...] | None, multi: bool) -> tuple[str, str] | None:
    """Which check must fail, worked out from the groups themselves rather than from the formulas."""
    if ws % tp:
        return "DistributedSetupError", "not divisible by tp_size"
    if ws % lws:
        return "DistributedSetupError", "same number of ranks"
    groups = [range(s, s + tp) for s in range(0, ws, tp)]
    for g in groups:
        nodes = {r // lws for r in g}
        whole = all(sum(1 for r in g if r // lws == n) == lws for n in nodes)
        if len(nodes) > 1 and not (multi and whole):
            return "DistributedSetupError", "node"
    n_visible = lws if visible is None else len(visible)
    if lws > n_visible:
        return "DistributedSetupError", "visible" if min(tp, lws) > n_visible else "outside CUDA_VISIBLE"
    return None


VISIBLE_CHOICES: list[tuple[str, ...] | None] = [None, ("7", "6", "5", "4", "3", "2", "1", "0"), ("2", "3")]


def test_topology_exhaustive() -> None:
    checked = valid = 0
    for ws, tp, multi, visible in itertools.product(range(1, 13), range(1, 14), (False, True), VISIBLE_CHOICES):
        for lws in range(1, ws + 1):
            expected = _oracle_error(ws, lws, tp, visible, multi)
            outcomes: list[gd.Topology | DistributedSetupError] = []
            for rank in range(ws):
                try:
                    outcomes.append(
                        gd.compute_topology(rank, ws, rank % lws, lws, tp, visible, 30000, allow_multi_node=multi)
                    )
                except DistributedSetupError as exc:
                    outcomes.append(exc)
            checked += 1
            errors = {str(o) for o in outcomes if isinstance(o, Exception)}
            where = f"ws={ws} lws={lws} tp={tp} multi={multi} visible={visible}"
            if expected is not None:
                # Every rank fails, with the same message: none is left waiting in a collective.
                assert len(errors) == 1 and all(isinstance(o, Exception) for o in outcomes), where
                assert expected[1] in errors.pop(), where
                continue
            assert not errors, (where, errors)
            valid += 1
            topos: list[gd.Topology] = outcomes  # type: ignore[assignment]
            engines: dict[int, list[gd.Topology]] = {}
            for t in topos:
                engines.setdefault(t.leader_rank, []).append(t)
                assert t.tp_group_ranks == tuple(range(t.leader_rank, t.leader_rank + tp)), where
                assert t.tp_group_ranks[t.tp_rank] == t.rank and t.dp_rank == t.rank // tp, where
                assert t.is_leader == (t.tp_rank == 0) and t.dp_size * tp == ws, where
                assert t.node_rank == t.rank // lws and t.num_nodes == ws // lws, where
                on_node = tuple(r % lws for r in t.tp_group_ranks if r // lws == t.node_rank)
                assert t.gpu_ids == on_node and t.base_gpu_id == on_node[0] and t.gpu_id in on_node, where
                assert t.engine_num_nodes == len({r // lws for r in t.tp_group_ranks}), where
                want = tuple(str(g) if visible is None else visible[g] for g in t.gpu_ids)
                assert t.physical_gpu_ids == want, where
                assert t.port == 30000 + t.leader_rank % lws, where
            assert len(engines) == ws // tp and sum(len(v) for v in engines.values()) == ws, where
            for members in engines.values():  # one engine, one answer, whichever rank asks
                assert len({(m.leader_rank, m.port, m.tp_group_ranks) for m in members}) == 1, where
            for node in range(ws // lws):  # engines sharing a node share no port and no GPU
                here = [m[0] for m in engines.values() if m[0].leader_rank // lws == node]
                assert len({t.port for t in here}) == len(here), where
                per_engine = [{x.gpu_ids for x in m if x.node_rank == node} for m in engines.values()]
                assert all(len(ids) <= 1 for ids in per_engine), where
                gpus = [g for ids in per_engine for gs in ids for g in gs]
                assert len(gpus) == len(set(gpus)) == lws, where
    assert checked > 5000 and valid > 400


def test_group_seed_is_shared_by_a_tp_group_and_differs_between_groups() -> None:
    """Every rank of a TP group gets one seed (they must sample alike); data-parallel groups get different ones
    (else a GRPO group spread over ranks repeats its completions); no world: the config's seed."""
    seeds = [
        gd.group_seed(7, gd.compute_topology(rank=r, world_size=8, local_rank=r, local_world_size=8, tp_size=2))
        for r in range(8)
    ]
    assert seeds == [7, 7, 8, 8, 9, 9, 10, 10]
    assert gd.group_seed(7, None) == 7


def test_reference_layout() -> None:
    """LightRFT's mapping: leader = first rank, base_gpu_id = its local_rank, port = 40000 + local_rank."""
    t = gd.compute_topology(rank=3, world_size=8, local_rank=3, local_world_size=8, tp_size=2)
    assert (t.leader_rank, t.tp_rank, t.dp_rank, t.dp_size, t.base_gpu_id, t.port) == (2, 1, 1, 4, 2, 40002)
    assert t.tp_group_ranks == (2, 3) and t.gpu_ids == (2, 3) and not t.is_leader
    # Two nodes of four: node 1's first engine mirrors node 0's (same local GPUs, same port on its host).
    t = gd.compute_topology(5, 8, 1, 4, 2, ("4", "5", "6", "7"), 41000)
    assert (t.node_rank, t.leader_rank, t.base_gpu_id, t.gpu_ids, t.physical_gpu_ids, t.port) == (
        1,
        4,
        0,
        (0, 1),
        ("4", "5"),
        41000,
    )
    t = gd.compute_topology(6, 8, 2, 4, 8, None, allow_multi_node=True)
    assert (t.engine_num_nodes, t.leader_rank, t.gpu_ids, t.port) == (2, 0, (0, 1, 2, 3), 40000)
    uuids = ("GPU-aaaa", "GPU-bbbb")
    assert gd.compute_topology(1, 2, 1, 2, 2, uuids).physical_gpu_ids == uuids


@pytest.mark.parametrize(
    ("args", "kwargs", "needles"),
    [
        ((0, 6, 0, 6, 4), {}, ["world size 6", "tp_size 4", "not divisible"]),
        ((0, 8, 0, 4, 8), {}, ["tp_size 8", "4 ranks (GPUs) of a node", "cannot span nodes"]),
        ((0, 12, 0, 6, 4), {}, ["[4, 5, 6, 7]", "node 0 and node 1"]),
        ((0, 12, 0, 6, 4), {"allow_multi_node": True}, ["[4, 5, 6, 7]", "crosses"]),
        ((0, 12, 0, 4, 6), {"allow_multi_node": True}, ["tp_size 6", "local world size 4", "whole nodes"]),
        ((0, 4, 0, 4, 4, ("0", "1")), {}, ["tp_size 4 needs 4 GPUs", "only 2", "'0,1'"]),
        ((0, 4, 0, 4, 2, ("0", "1")), {}, ["GPU ids [2, 3]", "outside CUDA_VISIBLE_DEVICES='0,1'"]),
        ((0, 6, 0, 4, 2), {}, ["world size 6", "local world size 4"]),
        ((5, 8, 0, 4, 2), {}, ["rank 5 has local_rank 0, expected 1"]),
        ((8, 8, 0, 8, 2), {}, ["rank must be", "[0, 8)", "8"]),
    ],
)
def test_setup_errors_name_the_values(args: tuple[Any, ...], kwargs: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(DistributedSetupError) as info:
        gd.compute_topology(*args, **kwargs)
    assert isinstance(info.value, AssertionError)  # the reference's exception type
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize("bad", [0, -2, 2.0, "2", True, None])
def test_bad_tp_size(bad: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=r"tp_size must be .*int >= 1") as info:
        gd.compute_topology(0, 4, 0, 4, bad)
    assert repr(bad) in str(info.value) or str(bad) in str(info.value)


def test_bad_base_port() -> None:
    with pytest.raises(InvalidArgumentError, match="base_port=65530, local_world_size=8"):
        gd.compute_topology(0, 8, 0, 8, 1, base_port=65530)


def test_parse_cuda_visible_devices() -> None:
    assert gd.parse_cuda_visible_devices(None) is None
    assert gd.parse_cuda_visible_devices("") == ()
    assert gd.parse_cuda_visible_devices(" 3, 1 ,GPU-ab ") == ("3", "1", "GPU-ab")
    assert gd.parse_cuda_visible_devices("0,1,-1,2") == ("0", "1")  # CUDA stops at an invalid id


def test_input_digest_is_by_content() -> None:
    import torch

    d = gd.input_digest
    assert d({"a": 1, "b": [1.5, "x"]}) == d({"b": [1.5, "x"], "a": 1})
    assert d(torch.arange(4)[::2]) == d(torch.tensor([0, 2]))  # layout does not matter
    assert d(torch.ones(2, dtype=torch.bfloat16)) != d(torch.ones(2, dtype=torch.float16))
    assert d(torch.ones(2, 1)) != d(torch.ones(1, 2))
    assert d([1, 2]) != d((1, 2)) and d(1) != d(1.0) and d(1) != d(True) and d("1") != d(b"1")
    assert d({"p": "hi", "seed": 1}) != d({"p": "hi", "seed": 2})
    assert d({3, 1, 2}) == d({2, 3, 1})


def test_default_timeout_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gd.TIMEOUT_ENV, raising=False)
    assert gd.default_collective_timeout_s() == gd.DEFAULT_COLLECTIVE_TIMEOUT_S
    monkeypatch.setenv(gd.TIMEOUT_ENV, "2.5")
    assert gd.default_collective_timeout_s() == 2.5
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv(gd.TIMEOUT_ENV, bad)
        with pytest.raises(InvalidArgumentError, match=gd.TIMEOUT_ENV):
            gd.default_collective_timeout_s()


def test_not_initialised_is_an_assertion_error() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(AssertionError, match=r"torch\.distributed is not initialised"):
        gd.engine_group(1)
    with pytest.raises(DistributedSetupError, match="init_process_group"):
        gd.topology_from_env(1)


def test_check_port_free() -> None:
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(DistributedSetupError, match=f"engine port {port} is already in use"):
            gd.check_port_free(port)
    gd.check_port_free(port)  # closed again


OPTIMIZED_SCRIPT = textwrap.dedent(
    """
    import sys, tempfile, os
    import torch.distributed as dist
    from genengine import distributed as gd
    assert sys.flags.optimize == 1
    out = []
    def probe(name, fn):
        try:
            fn()
            out.append(f"{name}: no error")
        except AssertionError as exc:
            out.append(f"{name}: {type(exc).__name__}: {exc}")
    probe("not initialised", lambda: gd.engine_group(1))
    probe("pure", lambda: gd.compute_topology(0, 6, 0, 6, 4))
    probe("wrong ranks", lambda: gd.check_tp_group_ranks((0, 2), gd.compute_topology(0, 4, 0, 4, 2), what="pg"))
    path = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method="file://" + path, rank=0, world_size=1)
    probe("world of 1, tp 2", lambda: gd.engine_group(2, check_port=False))
    from genengine_sglang.lightrft import RLGenerationEngine
    outside = dist.GroupMember.NON_GROUP_MEMBER
    probe("not a member", lambda: RLGenerationEngine(outside, model_path=tempfile.mkdtemp()))
    dist.destroy_process_group()
    print("\\n".join(out))
    """
)


def test_checks_survive_python_O() -> None:
    proc = subprocess.run([sys.executable, "-O", "-c", OPTIMIZED_SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("not initialised: DistributedSetupError: torch.distributed is not initialised")
    assert lines[1].startswith("pure: DistributedSetupError: world size 6 is not divisible by tp_size 4")
    assert lines[2].startswith("wrong ranks: DistributedSetupError: pg holds ranks [0, 2], but rank 0's TP group")
    assert lines[3].startswith("world of 1, tp 2: DistributedSetupError: world size 1 is not divisible by tp_size 2")
    assert lines[4].startswith("not a member: DistributedSetupError: rank 0 is not a member of tp_group_cpu")


def test_import_stays_light() -> None:
    code = (
        "import sys, argparse, genengine.distributed, genengine.cli.topology as c\n"
        "p = argparse.ArgumentParser(); c.add_parser(p.add_subparsers())\n"
        "a = p.parse_args(['topology', '--world-size', '4', '--tp-size', '2']); a.func(a)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "tp_group" in proc.stdout


# --- the CLI ---------------------------------------------------------------------------------------------
def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="genengine")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    code = args.func(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("ws", "tp", "nodes", "visible", "base"),
    [(8, 2, 2, None, None), (8, 4, 1, "4,5,6,7,0,1,2,3", 45000), (4, 1, 4, "3", None), (16, 8, 2, None, 100)],
)
def test_cli_table_matches_function(
    ws: int, tp: int, nodes: int, visible: str | None, base: int | None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["topology", "--world-size", str(ws), "--tp-size", str(tp), "--nodes", str(nodes)]
    argv += ["--cuda-visible-devices", visible] if visible else []
    argv += ["--base-port", str(base)] if base else []
    code, out, _ = _cli(argv, capsys)
    assert code == 0
    lines = out.strip().splitlines()
    header = lines[1].split()
    assert header == ["rank", "node", "local_rank", "tp_group", "tp_rank", "dp_rank", "leader", "gpu_ids", "port"]
    assert len(lines) == 2 + ws
    lws = ws // nodes
    for line in lines[2:]:
        cell = dict(zip(header, line.split(), strict=True))
        t = gd.compute_topology(
            int(cell["rank"]),
            ws,
            int(cell["rank"]) % lws,
            lws,
            tp,
            gd.parse_cuda_visible_devices(visible),
            base or gd.DEFAULT_BASE_PORT,
        )
        lo, _, hi = cell["tp_group"].partition("-")
        assert (int(lo), int(hi or lo)) == (t.tp_group_ranks[0], t.tp_group_ranks[-1])
        assert int(cell["node"]) == t.node_rank and int(cell["local_rank"]) == t.local_rank
        assert (int(cell["tp_rank"]), int(cell["dp_rank"])) == (t.tp_rank, t.dp_rank)
        assert cell["leader"] == f"{t.leader_rank}*" if t.is_leader else cell["leader"] == str(t.leader_rank)
        assert cell["gpu_ids"].split(",") == list(t.physical_gpu_ids) and int(cell["port"]) == t.port

    code, out, _ = _cli([*argv, "--json"], capsys)
    assert code == 0
    for line in out.strip().splitlines():
        row = json.loads(line)
        t = gd.compute_topology(
            row["rank"],
            ws,
            row["rank"] % lws,
            lws,
            tp,
            gd.parse_cuda_visible_devices(visible),
            base or gd.DEFAULT_BASE_PORT,
        )
        assert row["tp_group"] == list(t.tp_group_ranks) and row["gpu_ids"] == list(t.physical_gpu_ids)
        assert (row["leader"], row["port"], row["node"]) == (t.leader_rank, t.port, t.node_rank)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--world-size", "8", "--tp-size", "3"], "world size 8 is not divisible by tp_size 3"),
        (["--world-size", "8", "--tp-size", "8", "--nodes", "2"], "cannot span nodes"),
        (["--world-size", "8", "--tp-size", "2", "--nodes", "3"], "not divisible by 3 nodes"),
        (["--world-size", "4", "--tp-size", "0"], "tp_size must be an int >= 1"),
        (["--world-size", "4", "--tp-size", "2", "--cuda-visible-devices", "0"], "only 1 are visible"),
    ],
)
def test_cli_errors(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(["topology", *argv], capsys)
    assert code == 2 and out == ""
    assert err.startswith("genengine topology: error:") and needle in err


def test_cli_multi_node(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["topology", "--world-size", "8", "--tp-size", "8", "--nodes", "2", "--allow-multi-node"]
    code, out, _ = _cli(argv, capsys)
    assert code == 0 and out.count("0-7") == 8


# --- real process groups ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    workers = dw.WorkerPool(8)
    try:
        yield workers
    finally:
        workers.close()


def _ok(results: list[Any]) -> list[Any]:
    bad = [r for r in results if r.status != "ok"]
    assert not bad, [(r.rank, r.status, r.error_type, r.message, r.value) for r in bad]
    return [r.value for r in results]


def _check_helpers(values: list[dict[str, Any]], ws: int, lws: int, tp: int, base: int, backend: str = "gloo") -> None:
    for rank, v in enumerate(values):
        t = gd.compute_topology(rank, ws, rank % lws, lws, tp, None, base, allow_multi_node=tp > lws)
        assert v["topology"]["tp_group_ranks"] == t.tp_group_ranks and v["topology"] == t.__dict__
        assert v["backend"] == backend and v["cached"]
        assert v["group_ranks"] == list(t.tp_group_ranks)
        assert v["broadcast"] == {"from": t.leader_rank, "text": "héllo"}
        leader_tensor = [[float(x * (t.leader_rank + 1)) for x in row] for row in ([0, 1, 2], [3, 4, 5])]
        assert v["tensor"] == (leader_tensor, "torch.bfloat16", (2, 3))
        if t.is_leader:
            assert v["gathered"] == [{"rank": r, "handle": "ipc-" + "x" * r} for r in t.tp_group_ranks]
        else:
            assert v["gathered"] is None
        assert v["sum"] == sum(t.tp_group_ranks)


@pytest.mark.parametrize(("ws", "tp"), [(ws, tp) for ws in (1, 2, 4, 8) for tp in (1, 2, 4, 8) if tp <= ws])
def test_real_groups_one_node(pool: Any, ws: int, tp: int) -> None:
    base = dw.free_port_block(ws)
    values = _ok(pool.run("helpers", ws, tp_size=tp, base_port=base))
    _check_helpers(values, ws, ws, tp, base)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_real_groups_two_nodes_of_four(pool: Any, tp: int) -> None:
    base = dw.free_port_block(4)
    values = _ok(pool.run("helpers", 8, local_world_size=4, tp_size=tp, base_port=base))
    _check_helpers(values, 8, 4, tp, base)
    assert [v["topology"]["node_rank"] for v in values] == [0, 0, 0, 0, 1, 1, 1, 1]
    # Each node numbers its GPUs and ports from 0 again: the engines of node 1 mirror node 0's.
    assert [v["topology"]["base_gpu_id"] for v in values[:4]] == [v["topology"]["base_gpu_id"] for v in values[4:]]


def test_real_engine_spanning_two_nodes(pool: Any) -> None:
    base = dw.free_port_block(4)
    values = _ok(pool.run("multi_node", 8, local_world_size=4, base_port=base))
    assert all("cannot span nodes" in v["refused"] for v in values)
    _check_helpers(values, 8, 4, 8, base)
    assert {v["topology"]["engine_num_nodes"] for v in values} == {2}


def test_real_invalid_tp_sizes_fail_on_every_rank(pool: Any) -> None:
    values = _ok(pool.run("invalid", 4, tp_sizes=[3, 8, 0, "2"]))
    for v in values:
        (t3, m3, a3), (t8, m8, a8), (t0, m0, _), (ts, ms, _), after = v
        assert (t3, a3) == ("DistributedSetupError", True) and "world size 4 is not divisible by tp_size 3" in m3
        assert (t8, a8) == ("DistributedSetupError", True) and "tp_size 8" in m8
        assert t0 == "InvalidArgumentError" and "got 0" in m0
        assert ts == "InvalidArgumentError" and "'2'" in ms
        assert after == ("all_reduce after errors", "4.0", True)  # nobody was left hanging


def test_consistency_names_the_odd_rank(pool: Any) -> None:
    results = pool.run("consistency", 4, tp_size=4, odd_ranks=[2])
    for r in results:
        assert r.raised("InconsistentInputsError"), (r.status, r.message)
        assert "rank(s) [2] of TP group [0, 1, 2, 3] passed different prompts than rank(s) [0, 1, 3]" in r.message


def test_consistency_majority_and_per_group(pool: Any) -> None:
    # Group [0, 1] agrees; in group [2, 3] the tie goes to the leader, so rank 3 is the odd one.
    results = pool.run("consistency", 4, tp_size=2, odd_ranks=[3])
    assert [r.status for r in results[:2]] == ["ok", "ok"]
    for r in results[2:]:
        assert r.raised("InconsistentInputsError") and "rank(s) [3] of TP group [2, 3]" in r.message
    # A leader outvoted by its group is the one named.
    results = pool.run("consistency", 4, tp_size=4, odd_ranks=[0])
    assert all(r.raised("InconsistentInputsError") and "rank(s) [0] of" in r.message for r in results)


def test_lightrft_tp_group_cpu_of_the_wrong_ranks_is_refused_on_every_rank(pool: Any, tmp_path: Path) -> None:
    """B10: ``RLGenerationEngine(tp_group_cpu)`` with a group of the right size but the wrong ranks (``[0, 2]``
    in a world of 4) raises the reference's AssertionError on every rank, before any engine starts: the
    crossed groups on all four ranks, and ``new_group([0, 2])`` on its members and on the ranks it left out."""
    (tmp_path / "config.json").write_text("{}")  # a model directory as far as the settings look (no engine starts)
    values = _ok(pool.run("tp_group_cpu", 4, model=str(tmp_path)))
    for rank, v in enumerate(values):
        mine = [0, 1] if rank < 2 else [2, 3]
        crossed = [0, 2] if rank % 2 == 0 else [1, 3]
        kind, message, is_assertion = v["crossed"]
        assert (kind, is_assertion) == ("DistributedSetupError", True), (rank, v["crossed"])
        assert f"tp_group_cpu holds ranks {crossed}, but rank {rank}'s TP group" in message, (rank, message)
        assert f"contiguous ranks is {mine}" in message, (rank, message)
        kind, message, is_assertion = v["listed"]
        assert (kind, is_assertion) == ("DistributedSetupError", True), (rank, v["listed"])
        if rank in (0, 2):
            assert f"tp_group_cpu holds ranks [0, 2], but rank {rank}'s" in message, (rank, message)
        else:
            assert f"rank {rank} is not a member of tp_group_cpu" in message, (rank, message)
        # the right groups pass the check and reach the engine's start; the wrong ones never did
        assert v["right"] == ("RuntimeError", "the engine's start was reached", False), (rank, v["right"])
        assert v["started"] == ["right"] and v["after"] == 4.0, (rank, v)


# How long an absent rank stays away at most. It leaves as soon as its group's callers have given up, so
# this is only paid when a timeout fails to fire: then the callers could only fail once the absent rank
# leaves, and its report says so. Far above CEILING_S, so "gave up too late" and "never gave up" both fail.
ABSENT_CAP_S = 30.0
# Generous ceiling for a 1 s timeout to fire, counted from the call itself (not from group setup): scheduling
# on a loaded 2-core machine can add seconds, never CEILING_S - 1; a timeout that does not fire takes
# ABSENT_CAP_S. The floor is the timeout itself: a deadline never fires early (the 50 ms is the milliseconds
# gloo rounds the remaining time down to).
CEILING_S = 12.0
EARLY_S = 0.05


def test_rank_that_never_joins_times_out(pool: Any, tmp_path: Path) -> None:
    # Four groups of two, each with a different helper and one absent rank (the leader in the last).
    plan = {0: "broadcast_object", 2: "gather_object", 4: "check_consistent", 7: "barrier"}
    results = pool.run(
        "absent", 8, tp_size=2, plan=plan, sync_dir=str(tmp_path), absent_for_s=ABSENT_CAP_S, timeout_s=1.0
    )
    for rank in (1, 3, 5, 6):
        # Still away when its peer's call ended: the peer gave up on its deadline, not because this rank left.
        assert results[rank].value == "absent", (rank, results[rank].value)
    for rank, op in plan.items():
        r = results[rank]
        assert r.raised("CollectiveTimeoutError") and r.raised("TimeoutError"), (rank, r.status, r.message)
        assert f"{op} in TP group [{rank - rank % 2}, {rank - rank % 2 + 1}]" in r.message
        assert "timeout 1 s" in r.message and 1.0 - EARLY_S <= r.elapsed < CEILING_S, (rank, r.elapsed)
    assert "rank(s) [5] did not arrive" in results[4].message  # the roll call names who is missing
    assert "the leader rank 6 did not answer" in results[7].message


def test_timeout_from_env_applies_to_tensor_broadcast(pool: Any, tmp_path: Path) -> None:
    env = {gd.TIMEOUT_ENV: "1"}
    results = pool.run(
        "absent", 2, env=env, tp_size=2, plan={0: "broadcast_tensor"}, sync_dir=str(tmp_path), absent_for_s=ABSENT_CAP_S
    )
    r = results[0]
    assert r.raised("CollectiveTimeoutError") and "broadcast_tensor" in r.message, r.message
    assert "timeout 1 s" in r.message and 1.0 - EARLY_S <= r.elapsed < CEILING_S, r.elapsed
    assert results[1].value == "absent", results[1].value  # rank 1 was still away: the 1 s deadline fired


def test_engine_port_in_use(pool: Any) -> None:
    with socket.socket() as held:
        held.bind(("", dw.free_port_block(4)))
        held.listen()
        port = held.getsockname()[1]
        values = _ok(pool.run("ports", 4, held_port=port))
    for rank, ((base1, kind1, msg1), (_, kind2, msg2)) in enumerate(values):
        assert base1 == port
        if rank < 2:  # group [0, 1]'s leader has local_rank 0: its port is the held one
            assert kind1 == "DistributedSetupError" and f"engine port {port} is already in use" in msg1
            assert kind2 == "DistributedSetupError" and "is MASTER_PORT" in msg2
        else:  # group [2, 3] listens on base + 2, which is free
            assert (kind1, msg1) == ("ok", str(port + 2)) and kind2 == "ok"


# How long pool.run waits for the "dies" job: its setup, the victims' deaths (20 s at most) and a death only
# noticed at the helper's 60 s timeout all fit, so such a run fails on its elapsed time, with each rank's error;
# a rank that hangs past it fails with pool.run's report of which ranks hung and their stacks. pytest-timeout
# (which does not count the pool's start, a fixture) allows for restarting dead workers first, so it never
# fires before pool.run's report.
DIES_RUN_S = 100.0


@pytest.mark.timeout(DIES_RUN_S + 80, func_only=True)
def test_rank_dying_mid_collective_fails_fast(pool: Any) -> None:
    # Ranks 1 and 3 die (by timer) while waiting inside the helper; their leaders enter it once they are gone.
    plan = {0: "broadcast_object", 1: "die:broadcast_object", 2: "gather_object", 3: "die:gather_object"}
    # A timeout far above any scheduling delay: raising well before it means the death itself was noticed.
    # (Were it only noticed at the timeout, elapsed would be >= 60 s.)
    timeout_s = 60.0
    results = pool.run("dies", 4, tp_size=2, plan=plan, die_after_s=0.5, timeout_s=timeout_s, timeout=DIES_RUN_S)
    assert [r.status for r in results[1::2]] == ["died", "died"]
    for rank in (0, 2):
        r = results[rank]
        assert r.raised("CollectiveTimeoutError"), (r.status, r.message)
        assert f"{plan[rank]} in TP group [{rank}, {rank + 1}]" in r.message and "died" in r.message
        assert r.elapsed < timeout_s / 3, r.elapsed  # counted from entering the helper, with the peer already dead


def test_hung_job_names_the_ranks_and_where_they_are(pool: Any) -> None:
    # After the tests above, so that the killed worker is not restarted inside the module's other tests.
    with pytest.raises(AssertionError) as info:
        pool.run("hangs", 1, seconds=60, timeout=0.5)
    message = str(info.value)
    assert "hangs hung: ranks [0] did not finish in 0.5 s" in message, message
    assert "--- rank 0 (pid " in message and "in _hangs" in message, message  # its stack, down to the sleep


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_devices() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_device_group_on_two_gpus(pool: Any, tmp_path: Path) -> None:
    base = dw.free_port_block(2)
    values = _ok(pool.run("helpers", 2, backend="nccl", tp_size=2, base_port=base))
    _check_helpers(values, 2, 2, 2, base, backend="nccl")
    # The leader diverges: it sends what looks like broadcast_tensor's metadata (over gloo), then never
    # joins the NCCL half. Rank 1 waits on NCCL, whose Work.wait(timeout) must turn that into an error.
    # The leader stays diverged (alive, not joining) until rank 1's call has ended, ABSENT_CAP_S at most.
    plan = {0: "broadcast_meta", 1: "broadcast_tensor"}
    results = pool.run(
        "absent",
        2,
        backend="nccl",
        exit_after=True,
        tp_size=2,
        plan=plan,
        sync_dir=str(tmp_path),
        absent_for_s=0,
        timeout_s=2.0,
        linger_s=ABSENT_CAP_S,
    )
    r = results[1]
    assert r.raised("CollectiveTimeoutError"), (r.status, r.message)
    assert "broadcast_tensor in TP group [0, 1]" in r.message and "did not join in time" in r.message
    assert 2.0 - EARLY_S <= r.elapsed < CEILING_S, r.elapsed
    assert results[0].value == "returned", results[0].value  # the leader was still there: the deadline fired
