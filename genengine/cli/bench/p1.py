"""``genengine bench``'s P1, paired: ours in this process and the raw engine alive at once in a child process,
sampled in turn on the same prompts (:func:`genengine.cli.bench.paired.run_paired`), so the ratio can judge 1 %.

The raw engine comes from the plugin's ``raw_engine`` registration: ``(config) -> engine`` with
``generate_tokens(prompt_token_ids, max_new_tokens) -> int`` and ``close()``. The child is this module run as
``python -m genengine.cli.bench.p1 SPEC_JSON --result-fd N``; it builds the engine from the same ``EngineConfig``
(started before ours, so the two memory profiles do not overlap) and generates, greedy with EOS ignored, on
:func:`prompts_for` of each round's seed, as ours does.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from genengine.cli.bench.paired import SampleChild, run_paired

__all__ = [
    "PAIRED_GPU_MEM_UTIL",
    "OursSide",
    "generate_runs",
    "prompts_for",
    "raw_engine_ref",
    "run_pair",
    "start_raw_child",
]

PAIRED_GPU_MEM_UTIL = 0.4
"""Each engine's ``mem_util`` on a GPU when the user gave none: both must fit at once."""


def prompts_for(vocab: int, batch_size: int, prompt_len: int, seed: int) -> list[list[int]]:
    """The prompts of one round: the same on both sides (torch's CPU generator, seeded)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(min(10, vocab - 1), vocab, (batch_size, prompt_len), generator=gen).tolist()


def raw_engine_ref(backend: Any) -> Any:
    """The backend's ``raw_engine`` registration (None: not a registered name, or it has none)."""
    if not isinstance(backend, str) or ":" in backend:
        return None
    from genengine.plugins.registry import get_backend

    return get_backend(backend).raw_engine


class OursSide:
    """Ours in this process, answering ``sample(seed)`` as a :class:`SampleChild` does."""

    def __init__(self, engine: Any, spec: Mapping[str, Any]) -> None:
        from genengine.protocol import SamplingParams

        self.engine = engine
        self.spec = spec
        self.params = SamplingParams(max_new_tokens=spec["max_new_tokens"], temperature=0.0, ignore_eos=True)

    def sample(self, seed: int) -> dict[str, Any]:
        s = self.spec
        prompts = prompts_for(s["vocab"], s["batch_size"], s["prompt_len"], seed)
        start = time.perf_counter()
        results = self.engine.generate(prompt_token_ids=prompts, sampling_params=self.params)
        secs = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for r in results for o in r.outputs)
        return {"tokens": tokens, "seconds": secs, "tok_per_s": tokens / secs}


def start_raw_child(config: Any, pair: Mapping[str, Any]) -> SampleChild:
    """The raw engine's child for ``config`` (an ``EngineConfig``), started and up (a RuntimeError saying why not)."""
    fields = {k: getattr(config, k) for k in ("backend", "model", "tp_size", "mem_util", "dtype", "seed")}
    spec = {**pair, "config": {**fields, "options": dict(config.options)}}
    child = SampleChild("raw engine", [sys.executable, "-m", "genengine.cli.bench.p1", json.dumps(spec)])
    try:
        child.wait_ready()
    except BaseException:
        child.close(timeout=30)
        raise
    return child


def generate_runs(engine: Any, prompts: list[list[int]], greedy: Any, repeats: int, bar: Any) -> dict[str, Any]:
    """Ours alone (no raw engine to pair with): the median of ``repeats`` runs, with their spread."""
    from genengine.cli.bench.paired import summarize

    runs = []
    for i in range(repeats):
        bar.set_postfix_str(f"generate {i + 1}/{repeats}")
        start = time.perf_counter()
        results = engine.generate(prompt_token_ids=prompts, sampling_params=greedy)
        secs = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for r in results for o in r.outputs)
        runs.append((tokens / secs, secs, tokens))
        bar.update(1)
    spread = summarize([r[0] for r in runs])
    return {
        "paired": False,
        "tokens_per_s": spread["median"],
        "tokens_per_s_runs": [r[0] for r in runs],
        "spread_pct": spread["spread_pct"],
        "iqr_pct": spread["iqr_pct"],
        "tokens": runs[0][2],
        "seconds": sorted(r[1] for r in runs)[len(runs) // 2],
    }


def run_pair(ours: OursSide, raw: SampleChild, *, samples: int, warmup: int) -> dict[str, Any]:
    """``warmup`` + ``samples`` alternating rounds: the generate section of the report."""
    r = run_paired(ours, raw, samples=samples, warmup=warmup)
    o, w, q = r["ours"], r["raw"], r["ratio"]
    return {
        "paired": True,
        "samples": samples,
        "tokens_per_s": o["median"],
        "tokens_per_s_runs": o["all"],
        "spread_pct": o["spread_pct"],
        "iqr_pct": o["iqr_pct"],
        "raw_tokens_per_s": w["median"],
        "raw_tokens_per_s_runs": w["all"],
        "raw_spread_pct": w["spread_pct"],
        "vs_raw": q["median"],
        "vs_raw_min": q["min"],
        "vs_raw_max": q["max"],
        "vs_raw_iqr_pct": q["iqr_pct"],
        "vs_raw_of_medians": q["of_medians"],
        "raw_info": raw.info,
    }


def _child(spec: dict[str, Any], result_fd: int) -> None:
    from genengine.cli.bench.paired import serve
    from genengine.config import EngineConfig
    from genengine.plugins.registry import resolve_ref

    out = os.fdopen(result_fd, "w", encoding="utf-8")
    try:
        if spec.get("threads"):
            import torch

            torch.set_num_threads(int(spec["threads"]))
        config = EngineConfig.from_any(spec["config"])
        start = time.perf_counter()
        engine = resolve_ref(raw_engine_ref(config.backend))(config)
        info = {"pid": os.getpid(), "start_s": round(time.perf_counter() - start, 2)}
    except Exception as exc:
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        raise SystemExit(1) from exc

    def sample(seed: int) -> int:
        prompts = prompts_for(spec["vocab"], spec["batch_size"], spec["prompt_len"], seed)
        return int(engine.generate_tokens(prompts, spec["max_new_tokens"]))

    try:
        serve(sample, out, info=info)
    finally:
        engine.close()


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]), int(sys.argv[sys.argv.index("--result-fd") + 1]))
