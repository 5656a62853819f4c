"""The Ray pool's shape (issue 42, point 2), read from the source (no Ray started): only ``Fleet`` writes what the
pool knows of its replicas, a replica is called only through the typed methods of ``genengine/ray/handle.py``,
every engine call answers a ``Reply``, and no class of ``genengine/ray/`` grows past ~300 lines. The last tests
check the same at run time: the fleet's state is read-only, and the fan-out changes nothing until applied."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

RAY = Path(__file__).resolve().parents[2] / "genengine" / "ray"
FLEET = RAY / "fleet.py"
HANDLE = RAY / "handle.py"
MUTATORS = {"add", "remove", "pick", "done", "clear", "pop", "popitem", "update", "setdefault", "append", "extend"}
ENGINE_CALLS = {
    "generate",
    "sleep",
    "wake",
    "flush_cache",
    "load_weights",
    "transport_receive",
    "abort",
    "pause_generation",
    "resume_generation",
}
"""The replica methods that run an engine call: each answers a ``Reply`` (the engine's state and version after)."""
MAX_CLASS_LINES = 300
LONG_CLASSES = {"sync.py:WeightSync": 330}
"""Allowed over the limit, with the reason: the weight sync's packing and checks are being reshaped by issue 42's
point 3 (one check per tensor per side); split its group formation from its loads once that lands."""


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, name
    return found[0]


def _state_fields() -> set[str]:
    """Every attribute ``Fleet`` keeps (``self.x = ...`` in its methods) and every field of a ``Replica`` record."""
    fleet = _class(_tree(FLEET), "Fleet")
    fields = {
        t.attr
        for n in ast.walk(fleet)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    record = _class(_tree(HANDLE), "Replica")
    fields |= {n.target.id for n in record.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return fields | {"router", "replicas"}


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _writes(tree: ast.Module, fields: set[str]) -> list[tuple[int, str]]:
    """Where a module writes a field of another object (``x.field = ...``, ``del x.field[k]``,
    ``x.field.add(...)``, ``setattr``): a class's own ``self.field`` is its business."""
    found: list[tuple[int, str]] = []

    def target(t: ast.expr, line: int) -> None:
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                target(e, line)
        elif (isinstance(t, ast.Attribute) and t.attr in fields and not _is_self(t.value)) or (
            isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr in fields
        ):
            found.append((line, ast.unparse(t)))

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                target(t, node.lineno)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            target(node.target, node.lineno)
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                target(t, node.lineno)
        elif isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Name) and func.id in ("setattr", "delattr")) or (
                isinstance(func, ast.Attribute)
                and func.attr in MUTATORS
                and isinstance(func.value, ast.Attribute)
                and func.value.attr in fields
                and not (_is_self(func.value.value) and func.value.attr not in ("router", "replicas"))
            ):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_only_the_fleet_writes_the_pool_state() -> None:
    """EnginePool, WeightSync, PoolStream and the fleet's roles (lifecycle, dispatch) change a replica's record,
    the router's entries or the pool's version/pause/closed flags only through ``Fleet``'s verbs."""
    fields = _state_fields()
    assert {"needs_weights", "status", "state", "version", "incarnation", "_version", "_paused"} <= fields
    bad = [
        f"{path.name}:{line}: {text}"
        for path in sorted(RAY.glob("*.py"))
        if path != FLEET
        for line, text in _writes(_tree(path), fields)
    ]
    assert bad == [], "write the fleet's state through its verbs (genengine/ray/fleet.py):\n" + "\n".join(bad)


def _remote_calls(tree: ast.Module) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "remote"
    ]


def test_replicas_are_called_through_typed_methods_only() -> None:
    """Only handle.py touches a replica actor (``.remote``), one typed method per actor method, and no call names
    a method by a string (no ``getattr`` dispatch in the actor, no method name passed as an argument)."""
    outside = [
        f"{path.name}:{call.lineno}: {ast.unparse(call)[:80]}"
        for path in sorted(RAY.glob("*.py"))
        if path != HANDLE
        for call in _remote_calls(_tree(path))
    ]
    assert outside == [], "call replicas through genengine/ray/handle.py's typed methods:\n" + "\n".join(outside)

    actor = _class(_tree(RAY / "replica.py"), "EngineReplica")
    methods = {n.name for n in actor.body if isinstance(n, ast.AsyncFunctionDef) and not n.name.startswith("_")}
    dynamic = [ast.unparse(n) for n in ast.walk(actor) if isinstance(n, ast.Call) and ast.unparse(n.func) == "getattr"]
    assert dynamic == [], f"EngineReplica dispatches by name: {dynamic}"

    handle = _tree(HANDLE)
    called: set[str] = set()
    for call in _remote_calls(handle):
        strings = [a.value for a in ast.walk(call) if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        assert not set(strings) & (methods | ENGINE_CALLS), f"a method named by a string: {ast.unparse(call)}"
        chain = call.func.value  # type: ignore[attr-defined]
        while isinstance(chain, ast.Call) and isinstance(chain.func, ast.Attribute):  # actor.stream.options(...)
            chain = chain.func.value
        if isinstance(chain, ast.Attribute):
            called.add(chain.attr)
    assert methods - called == set(), f"EngineReplica methods without a typed call in handle.py: {methods - called}"


def test_every_engine_call_answers_a_reply() -> None:
    """``transport_receive`` included: no reply is a bare tuple recognised by its shape."""
    actor = _class(_tree(RAY / "replica.py"), "EngineReplica")
    returns = {n.name: ast.unparse(n.returns) for n in actor.body if isinstance(n, ast.AsyncFunctionDef) and n.returns}
    assert {name: returns.get(name) for name in ENGINE_CALLS} == dict.fromkeys(ENGINE_CALLS, "Reply")
    fanout = (RAY / "fanout.py").read_text()
    assert "isinstance(value, tuple)" not in fanout


def test_no_class_in_ray_over_300_lines() -> None:
    long = {
        f"{path.name}:{node.name}": node.end_lineno - node.lineno + 1  # type: ignore[operator]
        for path in sorted(RAY.glob("*.py"))
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.ClassDef)
        and node.end_lineno - node.lineno + 1 > LONG_CLASSES.get(f"{path.name}:{node.name}", MAX_CLASS_LINES)  # type: ignore[operator]
    }
    assert long == {}, f"split these by role: {long}"


# ---- at run time ----------------------------------------------------------------------------------------------
class _Fake:
    """Just enough of Ray for the fan-out: every call already ended, with a value or an error."""

    class RayTaskError(Exception):
        def __init__(self, cause: BaseException) -> None:
            super().__init__(str(cause))
            self.cause = cause

    class RayActorError(Exception):
        pass

    exceptions = SimpleNamespace(RayTaskError=RayTaskError, RayActorError=RayActorError)

    def wait(self, refs: list[Any], num_returns: int, timeout: float) -> tuple[list[Any], list[Any]]:
        return list(refs), []

    def get(self, ref: Any) -> Any:
        if isinstance(ref, BaseException):
            raise ref
        return ref


@pytest.fixture
def fleet(monkeypatch: pytest.MonkeyPatch) -> Any:
    import genengine.ray.fanout as fanout
    from genengine.ray.fleet import Fleet
    from genengine.ray.handle import Replica
    from genengine.ray.router import Router

    monkeypatch.setattr(fanout, "ray_module", _Fake)
    fleet = Fleet(SimpleNamespace(timeout_s=5.0), Router(), "test")  # type: ignore[arg-type]
    for index in (0, 1):
        replica = Replica(index, None, None, None)  # type: ignore[arg-type]
        fleet.adopt(replica)
        fleet.identify(replica, {"incarnation": f"i{index}", "actor_id": f"a{index}"})
        fleet.mark_healthy(replica)
    return fleet


def test_fleet_state_is_read_only(fleet: Any) -> None:
    for name, value in [("version", 3), ("paused", None), ("closed", True), ("loaded_once", True), ("timeout_s", 1)]:
        with pytest.raises(AttributeError):
            setattr(fleet, name, value)
    with pytest.raises(TypeError):
        del fleet.replicas[0]
    assert fleet.version == 0 and not fleet.closed and sorted(fleet.replicas) == [0, 1]


def test_the_fan_out_changes_nothing_until_applied(fleet: Any) -> None:
    """``gather`` gives each replica's reply or error; only ``Fleet.apply`` records the state and version, and
    stops routing to a replica found restarted."""
    from genengine.protocol import EngineState
    from genengine.ray.errors import StaleReplicaError
    from genengine.ray.fanout import gather
    from genengine.ray.replica import Reply

    first, second = fleet.replicas[0], fleet.replicas[1]
    asleep = EngineState(released_tags=frozenset({"weights"}), sleep_level=1)
    calls = [(first, Reply("ok", asleep, 7)), (second, _Fake.RayTaskError(StaleReplicaError("restarted")))]
    outcomes = gather("sleep", calls, 1.0)
    assert [o.value for o in outcomes] == ["ok", None] and outcomes[0].reply.version == 7
    assert outcomes[1].stale and "restarted" in str(outcomes[1].error)
    assert first.state == EngineState() and first.version == 0  # nothing written yet
    assert second.status == "healthy" and fleet.routed == (0, 1)
    fleet.apply(outcomes)
    assert first.state == asleep and first.version == 7
    assert second.status == "stale" and fleet.routed == (0,)


def test_the_verbs_keep_routing_and_versions_together(fleet: Any) -> None:
    first = fleet.replicas[0]
    fleet.mark_needs_weights(first)
    assert first.needs_weights and fleet.routed == (1,) and fleet.infos()[0].needs_weights
    fleet.mark_loaded([first, fleet.replicas[1]], 4)
    assert not first.needs_weights and fleet.routed == (0, 1) and fleet.version == 4 and fleet.loaded_once
    index = fleet.pick("key", 3)
    fleet.release(fleet.replicas[index], "another-incarnation", 3)  # a restored replica's load is left alone
    assert fleet.infos()[index].load == 3
    fleet.release(fleet.replicas[index], f"i{index}", 3)
    assert fleet.infos()[index].load == 0
