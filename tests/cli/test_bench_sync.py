"""``genengine bench --sync``: a weight sync split into pause, gather, transfer, load and resume."""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from genengine.cli import main
from genengine.cli.bench.sync import (
    PHASES,
    SyncBenchSettings,
    format_sync_report,
    one_sync,
    run_sync_bench,
    split_traced,
    summarize_phases,
)
from genengine.errors import InvalidArgumentError
from genengine.protocol import LoadReport


class _Recorder:
    """An async engine that records what the sync does, in order."""

    supports_async = True

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.loaded: list[tuple[str, torch.Tensor]] = []

    async def generate_async(self, prompt_token_ids: list[int], sampling_params: Any) -> Any:
        self.calls.append("submit")
        from types import SimpleNamespace

        out = SimpleNamespace(finish_reason="length", token_ids=[1] * sampling_params["max_new_tokens"])
        return SimpleNamespace(outputs=[out])

    async def pause_generation(self, mode: str = "keep") -> None:
        self.calls.append(f"pause:{mode}")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    def load_weights(self, pairs: list[tuple[str, torch.Tensor]], **kwargs: Any) -> LoadReport:
        self.calls.append(f"load:{sorted(kwargs.items())}")
        self.loaded = list(pairs)
        return LoadReport(num_tensors=len(pairs), num_bytes=0, num_buckets=1, seconds=0.0)


def test_one_sync_pauses_gathers_in_the_engine_dtype_loads_then_resumes() -> None:
    target = _Recorder()
    params = {"a": torch.ones(4, dtype=torch.float32), "b": torch.zeros(2, dtype=torch.bfloat16)}
    times = one_sync(target, params.items(), dtype=torch.bfloat16, prompts=[[1, 2], [3, 4]], max_new_tokens=3)
    assert target.calls == ["submit", "submit", "pause:keep", "load:[('bucket_bytes', None)]", "resume"]
    assert [(n, t.dtype) for n, t in target.loaded] == [("a", torch.bfloat16), ("b", torch.bfloat16)]
    assert times["transfer"] is None and times["num_buckets"] == 1
    assert all(times[p] >= 0 for p in ("pause", "gather", "load", "resume"))
    assert times["requests_finished"] == times["requests"] == 2


def test_a_synchronous_engine_has_no_pause_or_resume() -> None:
    class Sync:
        def load_weights(self, pairs: Any, **kwargs: Any) -> LoadReport:
            return LoadReport(num_tensors=len(pairs), num_bytes=0, num_buckets=2, seconds=0.0)

    times = one_sync(Sync(), [("w", torch.ones(2))], version=3)
    assert times["pause"] is None and times["resume"] is None and times["load"] >= 0


def test_summarize_phases_and_the_table() -> None:
    rows = [
        {"pause": 0.001, "gather": 0.002, "transfer": None, "load": 0.010, "resume": 0.001},
        {"pause": 0.003, "gather": 0.002, "transfer": None, "load": 0.030, "resume": 0.001},
    ]
    s = summarize_phases(rows)
    assert s["phases"]["transfer"] is None and s["phases"]["load"]["median"] == pytest.approx(0.02)
    assert s["slowest"] == "load" and s["total_median"] == pytest.approx((0.014 + 0.036) / 2)
    table = format_sync_report({"backend": "x", "targets": {"in_process": s, "pool": s}, "settings": {"syncs": 2}})
    lines = table.splitlines()
    assert [line.split()[0] for line in lines[2:7]] == list(PHASES)
    assert "20.00 ms" in lines[5] and "n/a" in lines[4] and lines[-1].split()[1:] == ["load", "load"]
    with pytest.raises(InvalidArgumentError, match="no syncs"):
        summarize_phases([])


def test_split_traced_takes_the_receivers_write_as_load(tmp_path: Path) -> None:
    (tmp_path / "sync-2-receiver-11.json").write_text(
        json.dumps({"totals": {"notice_wait": 0.02, "copy": 0.01, "write": 0.03, "commit": 0.005}})
    )
    (tmp_path / "sync-2-sender-10.json").write_text(json.dumps({"totals": {"pack_issue": 0.04}}))
    assert split_traced(0.1, tmp_path, 2) == pytest.approx({"transfer": 0.065, "load": 0.035})
    assert split_traced(0.1, tmp_path, 3) is None  # that sync left no receiver trace
    # another pool's sync 2, written before this one started, is not this one's
    assert split_traced(0.1, tmp_path, 2, since=time.time() + 60) is None


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("syncs", 0, "syncs=0"),
        ("in_flight", -1, "in_flight=-1"),
        ("trainer_dtype", "int8", "allowed are"),
        ("replicas", 0, "replicas=0"),
        ("transport", "tcp", "transport='tcp': allowed are gloo, nccl, cuda_ipc"),
    ],
)
def test_bad_settings_are_refused(field: str, value: Any, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        SyncBenchSettings(**{field: value}).check()


def test_cli_refuses_sync_with_async(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--sync", "--async"]) == 2
    assert "--sync and --async are two different measurements" in capsys.readouterr().err


def test_a_pool_sync_is_split_by_both_ends_traces() -> None:
    """The call (``load``) of one pool sync, split by its traces: the pool's row takes the slowest replica's
    own load; the trainer's side its waits for the replicas; what no trace covers is ``untraced``."""
    from genengine.cli.bench.pool_sync import split_pool_sync
    from genengine.errors import ConfigError

    times = {"pause": 0.01, "gather": 0.002, "transfer": None, "load": 0.1, "resume": 0.005, "whole": 0.118}
    sender = {"totals": {"plan": 0.01, "pack": 0.02, "broadcast": 0.01, "status_wait": 0.04}}
    slow = {"totals": {"metadata": 0.02, "receive_wait": 0.01, "session": 0.005, "write": 0.03, "commit": 0.01}}
    fast = {"totals": {"metadata": 0.02, "receive_wait": 0.03, "write": 0.01}}
    got = split_pool_sync(times, [sender], [fast, slow])
    row, trainer, replica = got["row"], got["sides"]["trainer"], got["sides"]["replica"]
    assert row["load"] == pytest.approx(0.045) and row["transfer"] == pytest.approx(0.055) and row["call"] == 0.1
    assert (row["pause"], row["gather"], row["resume"], row["whole"]) == (0.01, 0.002, 0.005, 0.118)
    assert trainer["load"] == pytest.approx(0.04) and trainer["transfer"] == pytest.approx(0.06)
    assert trainer["trace"]["untraced"] == pytest.approx(0.02) and trainer["pause"] == 0.01
    assert (replica["pause"], replica["gather"], replica["resume"]) == (None, None, None)
    assert replica["trace"]["untraced"] == pytest.approx(0.025) and replica["whole"] == 0.1
    with pytest.raises(ConfigError, match="0 receiver trace"):
        split_pool_sync(times, [sender], [])


def test_cli_refuses_sync_under_tensor_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--sync", "--tp-size", "2"]) == 2
    assert "--tp-size 2: bench --sync measures one engine in this process; allowed: 1" in capsys.readouterr().err


def test_sync_bench_on_the_embedded_backend(tmp_path: Path) -> None:
    """The real run: the tiny model on CPU, requests in flight, a trainer in bfloat16 (gather casts)."""
    buf = io.StringIO()
    args = ["bench", "--sync", "--syncs", "2", "--in-flight", "2", "--max-new-tokens", "8", "--trainer-dtype"]
    args += ["bfloat16", "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png")]
    with contextlib.redirect_stdout(buf):
        assert main(args) == 0
    report = json.loads((tmp_path / "s.json").read_text())
    t = report["targets"]["in_process"]
    assert report["trainer_dtype"] == "bfloat16" and report["dtype"] == "float32"
    for phase in ("pause", "gather", "load", "resume"):
        assert len(t["phases"][phase]["all"]) == 2 and t["phases"][phase]["median"] > 0
    assert t["phases"]["transfer"] is None  # in-process: the engine reads the trainer's tensors
    assert t["requests_finished"] == "4/4"
    assert format_sync_report(report) in buf.getvalue()
    png = tmp_path / "s.png"
    assert (("wrote " + str(png)) in buf.getvalue() and png.read_bytes()[:4] == b"\x89PNG") or (
        "matplotlib is missing" in buf.getvalue()
    )


def test_a_config_only_folder_syncs_random_weights_under_the_models_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU engines' ``load_format="dummy"`` folders have no safetensors: the trainer's weights are random,
    one per weight the model takes, in the trainer's dtype."""
    import shutil

    import genengine.plugins.registry
    from genengine.models.tiny_model import tiny_model_dir

    src = tiny_model_dir()
    model = tmp_path / "m"
    shutil.copytree(src, model, ignore=shutil.ignore_patterns("*.safetensors"))
    loaded: list[tuple[str, torch.Tensor]] = []

    class Engine:
        def load_weights(self, pairs: Any, **kwargs: Any) -> LoadReport:
            loaded[:] = pairs
            return LoadReport(num_tensors=len(pairs), num_bytes=0, num_buckets=1, seconds=0.0)

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(genengine.plugins.registry, "create_engine", lambda config: Engine())
    report = run_sync_bench(SyncBenchSettings(model=str(model), syncs=1, trainer_dtype="bfloat16", dtype="float32"))
    from safetensors import safe_open

    with safe_open(str(next(Path(src).glob("*.safetensors"))), "pt") as fh:
        names = set(fh.keys())
    assert {n for n, _ in loaded} == names and report["num_tensors"] == len(names)
    assert {t.dtype for _, t in loaded} == {torch.float32}  # gathered in the engine's dtype from bf16 ones
    assert report["targets"]["in_process"]["phases"]["pause"] is None  # a synchronous engine


def test_bench_sync_7b_writes_the_json_and_verify_reads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/bench_sync_7b.py (verify.sh's ``sync`` part) with the embedded backend standing in for the 7B
    engine: its JSON lands in $OUT under the name verify.sh's summary reads, and that summary reads it."""

    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    import bench_sync_7b

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(bench_sync_7b, "make_model_dir", lambda path, tokenizer: path)
    monkeypatch.setattr(
        bench_sync_7b,
        "settings",
        lambda engine, model, syncs, in_flight, replicas: SyncBenchSettings(
            syncs=syncs, in_flight=in_flight, max_new_tokens=4
        ),
    )
    with contextlib.redirect_stdout(io.StringIO()):
        assert bench_sync_7b.main(["vllm", "--syncs", "1", "--in-flight", "1"]) == 0
    report = json.loads((tmp_path / "bench_sync_vllm.json").read_text())
    assert report["targets"]["in_process"]["requests_finished"] == "1/1"
    row = _verify_sync_row(tmp_path / "bench_sync_vllm.json", tmp_path / "bench_sync_vllm.png")
    assert "medians (ms): pause" in row and "requests finished 1/1" in row, row


def test_bench_sync_7b_pool_row_reaches_the_json_and_verify_prints_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bench_sync_7b.py --pool``: the pool's settings (replicas over cuda_ipc, each with the GPU-sharing options)
    go to ``run_pool_sync_bench`` (stood in for here: the real run is tests/cli/test_ray_bench_sync.py), its row
    lands in the JSON beside the in-process one, and verify.sh's summary prints it."""

    import genengine.cli.bench.pool_sync as pool_sync

    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    import bench_sync_7b

    seen: list[SyncBenchSettings] = []

    def fake(settings: SyncBenchSettings) -> dict[str, Any]:
        seen.append(settings)
        row = {"pause": 0.01, "gather": 0.001, "transfer": 0.02, "load": 0.03, "resume": 0.002, "whole": 0.063}
        return {
            "backend": "vllm",
            "num_tensors": 3,
            "num_bytes": 10,
            "targets": {"in_process": summarize_phases([row]), "pool": summarize_phases([row, row])},
            "pool": {"replicas": settings.replicas, "transport": settings.transport},
        }

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(bench_sync_7b, "make_model_dir", lambda path, tokenizer: path)
    monkeypatch.setattr(pool_sync, "run_pool_sync_bench", fake)
    with contextlib.redirect_stdout(io.StringIO()):
        assert bench_sync_7b.main(["vllm", "--pool", "--replicas", "3"]) == 0
    (chosen,) = seen
    assert (chosen.replicas, chosen.transport, chosen.syncs) == (3, "cuda_ipc", 10)
    assert chosen.pool_options == {"kv_cache_memory_bytes": 4 << 30} and chosen.pool_mem_util == 0.3
    report = json.loads((tmp_path / "bench_sync_vllm.json").read_text())
    assert set(report["targets"]) == {"in_process", "pool"}
    row = _verify_sync_row(tmp_path / "bench_sync_vllm.json", tmp_path / "none.png")
    assert "pool (3 replicas over cuda_ipc), medians (ms): pause 10.0 (spread 0.0)" in row, row


def _verify_sync_row(report: Path, png: Path) -> str:
    """verify.sh's summary row of the sync and sync_pool parts, from its own embedded script."""
    import subprocess
    import sys

    verify = (Path(__file__).resolve().parents[2] / "tools/gpu/verify.sh").read_text()
    snippet = verify.split('    sync|sync_pool) what=$(python3 - "$WORK/bench_sync_$ENGINE.json"', 1)[1]
    snippet = snippet.split("<<'EOF' 2>/dev/null || echo \"no report\"\n", 1)[1].split("\nEOF\n", 1)[0]
    return subprocess.run(
        [sys.executable, "-c", snippet, str(report), str(png)], capture_output=True, text=True, check=True
    ).stdout
