"""vLLM (0.24.0 - 0.26.0) on one GPU: the conformance suite, plus what only a real GPU shows.

The engine runs colocated, as under a trainer: this module initialises a one-rank NCCL world first, so the
engine takes the external_launcher path and its shutdown must leave that world alive. One sleep-mode
engine serves the module (vLLM allows one per process); the suite's fresh reference engine on other
weights runs before it, with sleep disabled.

Run on the GPU machine with tools/gpu/run_tests.sh vllm, which amounts to:
    PYTHONPATH=/tmp/site-proj:/tmp/site-vllm python3 -m pytest -m gpu tests/gpu/test_vllm_gpu.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import importlib.util
import os
import socket
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from support.gpu_checks import (  # noqa: E402
    GIB,
    ParityOverSyncs,
    assert_loads_like_fresh,
    assert_sleep_freed,
    free_gpu_memory,
    prefix_cache_drift,
    sleep_and_wake,
    token_ids,
    weight_sync_mode,
    who_holds_gpu_memory,
)

from genengine import create_engine  # noqa: E402
from genengine.errors import EngineClosedError, EngineStateError  # noqa: E402
from genengine.models.tiny_model import tiny_model_dir  # noqa: E402
from genengine.protocol import GenerationEngine, GenerationResult, SamplingParams  # noqa: E402
from genengine.testing.conformance import PROMPTS, EngineConformance  # noqa: E402

pytestmark = pytest.mark.gpu

# Settings of the machine, not of the product: the GPU kit does not carry flashinfer.
if importlib.util.find_spec("flashinfer") is None:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

MEM_UTIL = 0.3
_RECORD: dict[str, Any] = {"engines": []}
_START_VARS = ("VLLM_ENABLE_V1_MULTIPROCESSING", "RANK", "LOCAL_RANK")  # set only while vLLM starts


@pytest.fixture(scope="module", autouse=True)
def trainer_world() -> Any:
    """A one-rank NCCL default group, as torchrun gives a trainer: the group the engine must not destroy."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield dist.group.WORLD
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    world = dist.group.WORLD
    # A trainer has run collectives and matmuls before it builds an engine: its NCCL communicator and its
    # main thread's cuBLAS/cuBLASLt workspaces exist. Made here, so that the memory the tests measure around
    # the engine is the engine's, not the trainer's first all_reduce or matmul.
    warm = torch.ones(1, device="cuda")
    dist.all_reduce(warm)
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    (a @ a).float().sum().item()
    torch.nn.functional.linear(a, a).sum().item()
    del a, warm
    torch.cuda.synchronize()
    yield world
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module", autouse=True)
def allocator_settings() -> Any:
    """make_engine sets expandable_segments:True in the environment; leave the process as it was found."""
    saved = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    yield
    if saved is None:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    else:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = saved
    enabled = "expandable_segments:True" in (saved or "")
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{enabled}")


_LONG = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True, logprobs=True)


async def _read(stream: Any, count: int) -> list[int]:
    """Read ``stream`` until it gave ``count`` tokens (or ended); the stream stays open."""
    tokens: list[int] = []
    while len(tokens) < count:
        try:
            chunk = await stream.__anext__()
        except StopAsyncIteration:
            break
        tokens.extend(chunk.token_ids)
    return tokens


def _scheduler(engine: Any) -> Any:
    """vLLM's scheduler inside the in-process engine core (what the async driver pauses)."""
    return engine._llm.llm_engine.engine_core.engine_core.scheduler


def _hashed_blocks(engine: Any) -> int:
    """Blocks in vLLM's prefix cache (with a hash a new request could hit)."""
    return sum(1 for b in _scheduler(engine).kv_cache_manager.block_pool.blocks if b.block_hash is not None)


def _rng_kept(cpu: Any, cuda: list[Any] | None) -> bool:
    if not torch.equal(cpu, torch.get_rng_state()):
        return False
    now = torch.cuda.get_rng_state_all()
    return cuda is None or (len(cuda) == len(now) and all(torch.equal(a, b) for a, b in zip(cuda, now, strict=True)))


class TestVLLMConformance(EngineConformance):
    greedy_matches_hf = False  # bf16 on the GPU vs float32 transformers on the CPU
    logprob_tolerance = 0.01  # the goal; bf16 engines get 1.25x transformers' own bf16 gap if larger
    compute_dtype = "bfloat16"
    supports_images = False  # the tiny Qwen2 is text-only

    def make_engine(self, model_dir: str, **options: Any) -> GenerationEngine:
        main = model_dir == str(tiny_model_dir(**self.model_kwargs))
        options.setdefault("disable_cuda_graph", True)
        options.setdefault("max_model_len", 1024)
        if not main:
            options.setdefault("enable_sleep", False)  # the fresh reference engine; sleep mode is one per process
        if main:  # the setting with which vLLM's sleep frees nothing: the engine must take it out
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        rng_cpu = torch.get_rng_state()
        rng_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        free_before = free_gpu_memory()
        start_vars = {k: os.environ.get(k) for k in _START_VARS}
        engine: GenerationEngine = create_engine(backend="vllm", model=model_dir, mem_util=MEM_UTIL, **options)
        if main:
            _RECORD.update(
                free_before=free_before,
                free_awake=free_gpu_memory(),
                alloc_conf_alive=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                rng_kept=_rng_kept(rng_cpu, rng_cuda),
                start_vars=(start_vars, {k: os.environ.get(k) for k in _START_VARS}),
            )
        _RECORD["engines"].append(engine)
        return engine

    # ---- beyond the suite ----------------------------------------------------------------------------------
    def test_engine_start_keeps_the_trainers_rng_and_allocator_setting(self, engine: GenerationEngine) -> None:
        assert _RECORD["rng_kept"], "creating the engine changed the trainer's torch RNG state"
        assert "expandable_segments:True" not in (_RECORD["alloc_conf_alive"] or "")
        before, after = _RECORD["start_vars"]
        assert after == before, "the variables vLLM reads while it starts must not outlive the start"
        assert engine.settings.tp_size == 1 and engine.topology is not None  # type: ignore[attr-defined]

    @pytest.mark.parametrize("level", [1, 2])
    def test_sleep_frees_what_the_engine_holds(
        self, engine: Any, baseline: list[GenerationResult], original_weights: dict[str, Any], level: int
    ) -> None:
        with self.restoring(engine, original_weights):
            r = sleep_and_wake(engine, level, _RECORD["free_before"])
            assert_sleep_freed(r)
            assert r.not_taken_back <= 256 * (1 << 20), (
                f"wake did not take the memory back: {r.not_taken_back / GIB:.2f} of {r.freed / GIB:.2f} GiB still free"
            )
        self.assert_baseline(engine, baseline)

    def test_wake_kv_cache_before_weights_after_level_2(
        self, engine: Any, baseline: list[GenerationResult], original_weights: dict[str, Any]
    ) -> None:
        """vLLM restores the model's buffers on the first wake_up: with the weights still unmapped it must wait."""
        with self.restoring(engine, original_weights):
            engine.sleep(2)
            engine.wake(["kv_cache"])
            engine.wake(["weights"])
            engine.load_weights(original_weights.items())
            self.assert_baseline(engine, baseline)

    def test_per_param_mode_loads_the_same(
        self,
        engine: Any,
        baseline: list[GenerationResult],
        original_weights: dict[str, Any],
        other_weights: dict[str, Any],
        other_record: dict[str, Any],
    ) -> None:
        # The mode inside ``restoring``: the original weights come back through the default (bucketed) mode.
        with self.restoring(engine, original_weights), weight_sync_mode(engine, "per_param"):
            assert_loads_like_fresh(engine, other_weights, other_record["results"])
        self.assert_baseline(engine, baseline)

    def test_load_from_cuda_tensors_and_logprob_parity_over_20_syncs(
        self, engine: Any, original_weights: dict[str, Any], model_dir: str, baseline: list[GenerationResult]
    ) -> None:
        """Trainer-style: 20 steps of changed weights, sent from CUDA tensors; logprobs stay at HF parity.

        The reference is transformers' forward on the same weights (bf16 values, computed in float32 on
        the GPU), so the difference is the engine's bf16 arithmetic only; it must not grow with the syncs.
        """
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
        gen = torch.Generator(device="cuda").manual_seed(0)
        cuda_weights = {n: t.cuda() for n, t in original_weights.items()}
        noise = {
            n: torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float32) for n, t in cuda_weights.items()
        }
        parity = ParityOverSyncs("vllm")
        try:
            for step in range(21):
                weights = {
                    n: (t.float() + 0.002 * step * noise[n]).to(t.dtype) if t.dim() >= 2 else t
                    for n, t in cuda_weights.items()
                }
                if step:
                    engine.load_weights(weights.items())
                with torch.no_grad():
                    hf.load_state_dict({n: t.float() for n, t in weights.items()}, strict=False)
                parity.measure(engine, hf)
                del weights
            parity.check()
        finally:
            engine.load_weights(original_weights.items())
            del hf, cuda_weights, noise
            torch.cuda.empty_cache()
        self.assert_baseline(engine, baseline)

    def test_second_sleep_engine_refused_before_taking_memory(self, engine: Any, model_dir: str) -> None:
        from genengine_vllm import get_vllm_engine

        before = free_gpu_memory()
        with pytest.raises(EngineStateError, match="one engine per process"):
            get_vllm_engine(model_dir, 0.1)
        assert abs(free_gpu_memory() - before) < 64 * (1 << 20)

    def test_unseeded_sampling_ignores_the_global_rngs(self, engine: Any) -> None:
        """No request reaches vLLM without a seed: the trainer's numpy/torch RNG use cannot split TP ranks."""
        import numpy as np

        params = SamplingParams(temperature=1.0, max_new_tokens=8)
        np.random.seed(0)
        torch.manual_seed(0)
        first = engine.generate(PROMPTS, params)
        np.random.seed(0)
        torch.manual_seed(0)
        second = engine.generate(PROMPTS, params)
        tokens = token_ids([*first, *second])
        assert tokens[: len(PROMPTS)] != tokens[len(PROMPTS) :], "each call must draw new seeds"

    def test_the_prefix_cache_index_names_every_cached_block(self, engine: Any) -> None:
        """The driver's eviction reads vLLM's hash index, not every block of the pool: the same block ids,
        in a fraction of the time (the pool of a tiny model at mem 0.3 holds millions of blocks)."""
        from genengine_vllm._async import cached_block_ids

        engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=40))
        pool = _scheduler(engine).kv_cache_manager.block_pool
        start = time.perf_counter()
        walked = {b.block_id for b in pool.blocks if b.block_hash is not None}
        walk_s = time.perf_counter() - start
        start = time.perf_counter()
        indexed = cached_block_ids(pool)
        index_s = time.perf_counter() - start
        print(f"prefix-cache blocks: {len(walked)} of {len(pool.blocks)}; walk {walk_s:.4f} s, index {index_s:.6f} s")
        assert walked, "the prompts left nothing in the prefix cache: the check compares empty sets"
        assert indexed == walked
        assert index_s < walk_s

    # ---- async, beyond the suite ---------------------------------------------------------------------------
    def test_sync_generate_while_streams_run_is_served_in_the_same_batches(
        self, engine: Any, baseline: list[GenerationResult]
    ) -> None:
        """The driver serves a synchronous generate() beside the streams (LLM.generate would step theirs too)."""
        greedy = SamplingParams(temperature=0.0, max_new_tokens=12, logprobs=True)

        async def main() -> tuple[list[GenerationResult], int, Any]:
            stream = engine.stream(PROMPTS[0], _LONG)
            try:
                await _read(stream, 2)
                results = await asyncio.to_thread(engine.generate, PROMPTS, greedy)
                more = await _read(stream, 4)
                return results, len(more), engine.in_flight
            finally:
                await engine.abort()

        results, more, in_flight = asyncio.run(main())
        assert more == 4 and in_flight == 1, "the stream must go on after the synchronous generate"
        assert len(results) == len(PROMPTS) and [r.prompt_token_ids for r in results] == [
            r.prompt_token_ids for r in baseline
        ]
        for result in results:
            out = result.outputs[0]
            assert out.finish_reason in ("stop", "length") and 0 < len(out.token_ids) <= 12
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
            assert out.weight_versions == ((0, engine.weight_version),)
        assert engine.in_flight == 0 and engine._driver is not None and not engine._driver.busy
        self.assert_baseline(engine, baseline)  # the direct LLM.generate path again

    def test_generate_while_requests_are_held_is_refused(self, engine: Any) -> None:
        async def main() -> None:
            stream = engine.stream(PROMPTS[1], _LONG)
            try:
                await _read(stream, 2)
                await engine.pause_generation("keep")
                with pytest.raises(EngineStateError, match="resume_generation"):
                    engine.generate(PROMPTS[:1], {"max_new_tokens": 2})
                await engine.resume_generation()
                assert len(await _read(stream, 3)) == 3
            finally:
                await engine.resume_generation()
                await engine.abort()

        asyncio.run(main())

    @pytest.mark.parametrize("clear_cache", [True, False])
    def test_pause_keep_maps_clear_cache_onto_vllm(
        self, engine: Any, original_weights: dict[str, Any], other_weights: dict[str, Any], clear_cache: bool
    ) -> None:
        """True: vLLM preempts the running request (KV freed, recomputed at resume); False: it keeps its KV and
        a weight load still empties the prefix cache (blocks in use included), so nothing new hits old KV."""
        sched = _scheduler(engine)

        async def main() -> tuple[int, int, int, int]:
            stream = engine.stream(PROMPTS[2], _LONG)
            try:
                await _read(stream, 4)
                await engine.pause_generation("keep", clear_cache=clear_cache)
                running, computed = len(sched.running), sum(r.num_computed_tokens for r in sched.running)
                waiting = len(sched.waiting)
                engine.load_weights(other_weights.items())
                hashed = _hashed_blocks(engine)
                await engine.resume_generation()
                assert len(await _read(stream, 3)) == 3
                return running, computed, waiting, hashed
            finally:
                await engine.resume_generation()
                await engine.abort()
                engine.load_weights(original_weights.items())

        running, computed, waiting, hashed = asyncio.run(main())
        assert hashed == 0, f"{hashed} blocks computed with the old weights still in the prefix cache"
        if clear_cache:
            assert (running, waiting) == (0, 1)
        else:
            assert running == 1 and computed > 0 and waiting == 0


def test_shutdown_with_streams_open_ends_them_with_abort(trainer_world: Any) -> None:
    """Streams open at shutdown end with "abort" and keep their tokens; the engine object then says it is closed,
    and (kept by the caller, with its streams) holds no GPU memory any more."""
    import weakref

    from genengine.engine.lifecycle import live_engines
    from genengine_vllm.engine import VLLMEngine

    free_before = _free_device_wide()
    engine = create_engine(
        backend="vllm", model=str(tiny_model_dir()), mem_util=MEM_UTIL, max_model_len=1024, enable_sleep=False
    )
    llm = weakref.ref(engine._llm)  # type: ignore[attr-defined]

    async def main() -> list[tuple[list[int], Any]]:
        streams = [engine.stream(p, _LONG) for p in PROMPTS]
        seen = [await _read(stream, 2) for stream in streams]
        engine.shutdown()
        for tokens, stream in zip(seen, streams, strict=True):
            async for chunk in stream:
                tokens.extend(chunk.token_ids)
        with pytest.raises(EngineClosedError):
            engine.stream(PROMPTS[0], _LONG)
        with pytest.raises(EngineClosedError):
            await engine.pause_generation("keep")
        return [(tokens, stream.result()) for tokens, stream in zip(seen, streams, strict=True)]

    try:
        for tokens, result in asyncio.run(main()):
            out = result.outputs[0]
            assert out.finish_reason == "abort" and out.token_ids == tokens and len(tokens) >= 2
            assert out.logprobs is not None and len(out.logprobs) == len(tokens)
        assert engine.state.closed and engine.in_flight == 0
        engine.shutdown()  # idempotent
        with pytest.raises(EngineClosedError):
            engine.generate(PROMPTS, {"max_new_tokens": 2})
    finally:
        engine.shutdown()
    left = free_before - _free_device_wide()
    holders = [type(r).__name__ for r in gc.get_referrers(llm())] if llm() is not None else []
    assert left <= GIB // 2, (
        f"{left / GIB:.2f} GiB still held after shutdown; vLLM's LLM object alive: {llm() is not None} "
        f"(held by {holders}); live engines in this process: {len(live_engines(VLLMEngine))}"
    )


def test_shutdown_keeps_the_trainer_world_and_frees_memory(trainer_world: Any) -> None:
    """Runs after the suite's class engine was shut down (vLLM's teardown would destroy the default group)."""
    import torch.distributed as dist

    engines = _RECORD["engines"]
    if len(engines) < 2:
        pytest.skip("the conformance class did not run in this session")
    assert all(e.state.closed for e in engines)
    assert dist.is_initialized() and dist.group.WORLD is trainer_world
    total = torch.ones(1, device="cuda")
    dist.all_reduce(total)
    assert total.item() == 1.0
    left = _RECORD["free_before"] - free_gpu_memory()
    assert left < GIB // 2, f"{left / GIB:.2f} GiB still held after shutdown; {who_holds_gpu_memory()}"
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == "expandable_segments:True"  # restored for the trainer


def _free_device_wide() -> int:
    """Free bytes on the GPU as nvidia-smi sees it: without first emptying this process's cache (which
    would hide blocks the engine left cached in the trainer's allocator)."""
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


@pytest.mark.parametrize("cycles", [0, 2])
def test_shutdown_returns_the_memory_while_the_engine_is_still_referenced(trainer_world: Any, cycles: int) -> None:
    """A ``with`` block leaves its name bound: shutdown itself must give the memory back (<= 0.5 GiB left,
    device-wide, nothing emptied by the caller), with sleep/load cycles before it or none."""
    from genengine.testing.conformance import load_checkpoint

    model_dir = str(tiny_model_dir())
    weights = {n: t.to("cuda", torch.bfloat16) for n, t in load_checkpoint(model_dir).items()}
    free_before = free_gpu_memory()
    with create_engine(backend="vllm", model=model_dir, mem_util=MEM_UTIL, max_model_len=1024) as engine:
        engine.generate(PROMPTS, {"temperature": 0.0, "max_new_tokens": 8})
        for _ in range(cycles):
            engine.sleep(level=2)
            engine.wake(["weights"])
            engine.load_weights(weights.items())
            engine.wake(["kv_cache"])
            engine.generate(PROMPTS, {"temperature": 0.0, "max_new_tokens": 8})
    assert engine.state.closed  # the name is still bound: the caller holds the engine
    del weights
    left = free_before - _free_device_wide()
    assert left <= GIB // 2, f"{left / GIB:.2f} GiB still held right after shutdown (engine still referenced)"


def test_prefix_cache_drift_and_the_setting_that_removes_it(trainer_world: Any) -> None:
    """A prefix-cache hit may change greedy logprobs in the last bits (measured, printed for docs/benchmarks.md);
    with ``enable_prefix_caching=False`` (the documented setting) repeated prompts give equal logprobs."""
    model_dir = str(tiny_model_dir())
    drifts = {}
    for caching in (True, False):
        with create_engine(
            backend="vllm",
            model=model_dir,
            mem_util=MEM_UTIL,
            max_model_len=1024,
            enable_sleep=False,
            enable_prefix_caching=caching,
        ) as engine:
            drifts[caching] = prefix_cache_drift(
                engine, PROMPTS, {"temperature": 0.0, "max_new_tokens": 12, "logprobs": True}
            )
        print(f"VLLM_CACHE_DRIFT prefix_caching={caching}: " + drifts[caching].describe())
    assert drifts[True].tokens_equal and drifts[False].tokens_equal
    assert drifts[False].hit == 0.0, drifts[False].describe()


def test_fallback_engine_args_match_the_installed_vllm() -> None:
    """The pass-through names used where vLLM cannot be imported are the installed vLLM's ``EngineArgs`` fields:
    ``compat.recorded_engine_args()`` (this release's ``surfaces/VERSION.json``, read from its wheel by AST) ==
    ``{f.name for f in dataclasses.fields(EngineArgs) if not f.name.startswith("_")}``, and ``engine_arg_names()``
    reads exactly that set here. A release without a recorded surface fails here: run tools/engine_surface.py."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    from genengine_vllm import compat, settings

    assert compat.surface(vllm.__version__.split("+")[0]) is not None, (
        f"no recorded surface for vLLM {vllm.__version__}"
    )
    recorded = compat.recorded_engine_args()
    installed = frozenset(f.name for f in dataclasses.fields(EngineArgs) if not f.name.startswith("_"))
    missing = sorted(installed - recorded)
    extra = sorted(recorded - installed)
    assert not missing and not extra, f"vLLM {vllm.__version__}: recorded fields lack {missing}, have extra {extra}"
    settings.engine_arg_names.cache_clear()
    assert settings.engine_arg_names() == installed


def test_declared_upstream_uses_exist_in_the_installed_vllm() -> None:
    """Every vllm name, member and keyword the plugin declares (``genengine_vllm.upstream``) exists in the
    installed vllm when imported, as the recorded surface (read from the wheel by AST) says."""
    import importlib.metadata

    from support.upstream_uses import unresolved_uses

    version = importlib.metadata.version("vllm").split("+")[0]
    unresolved = unresolved_uses("genengine_vllm", version)
    assert not unresolved, f"vllm {version}: {unresolved}"
