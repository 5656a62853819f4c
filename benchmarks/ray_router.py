"""Router hit rate and balance through a real EnginePool (embedded replicas, local Ray cluster, CPU).

A multi-turn workload: ``--sessions`` conversations, each turn a prompt that extends the previous one, sent
in batches as an RL rollout would; half the requests name their session (``session_id``), the other half
rely on the prompt-prefix key. Then GRPO groups: 8 prompts, each ``--group`` times in one batch. Prints
the router's hit rate (requests that went to the replica their key was stuck to), the work per replica,
and the wall time. Not a timed test: numbers for docs/deployment.md.

    PYTHONPATH=$PWD python benchmarks/ray_router.py --replicas 2 --sessions 16 --turns 4
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-imbalance", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="copies of each prompt in the GRPO-group phase")
    args = parser.parse_args()

    import ray

    from genengine import SamplingParams
    from genengine.models.tiny_model import tiny_model_dir
    from genengine.ray import EnginePool

    root = Path(__file__).resolve().parents[1]
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}},
    )
    model = str(tiny_model_dir())
    words = "the quick brown fox jumps over a lazy dog once upon a time in a galaxy far away".split()  # noqa: SIM905
    params = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
    start = time.perf_counter()
    with EnginePool(
        backend="transformers",
        model=model,
        dtype="float32",
        num_replicas=args.replicas,
        num_gpus=0,
        num_cpus=2 / (args.replicas + 1),
        max_imbalance=args.max_imbalance,
    ) as pool:
        started = time.perf_counter() - start
        history = [f"session {s}: {words[s % len(words)]}" for s in range(args.sessions)]
        t0 = time.perf_counter()
        for _ in range(args.turns):
            half = args.sessions // 2
            named = pool.generate(history[:half], params, session_id=[f"s{i}" for i in range(half)])
            keyed = pool.generate(history[half:], params)  # the prompt prefix is the key
            for i, result in enumerate([*named, *keyed]):
                history[i] += " " + (result.outputs[0].text or "") + " and then"
        sessions = pool.router.stats
        sessions_out = {"hit_rate": round(sessions.hit_rate, 3), "hits": sessions.hits, "new": sessions.new}
        # GRPO groups: each prompt sent --group times in one batch; the copies should share a replica
        before = dict(sessions.work)
        hits_before, moved_before = sessions.hits, sessions.moved
        group_prompts = [f"group {g}: {words[g % len(words)]} {words[(g + 3) % len(words)]}" for g in range(8)]
        pool.generate([p for p in group_prompts for _ in range(args.group)], params)
        groups_out = {
            "hits": sessions.hits - hits_before,
            "moved": sessions.moved - moved_before,
            "work_per_replica": {k: v - before.get(k, 0) for k, v in sorted(sessions.work.items())},
        }
        stats = pool.router.stats
        out = {
            "multi_turn": sessions_out,
            "grpo_groups": groups_out,
            "replicas": args.replicas,
            "sessions": args.sessions,
            "turns": args.turns,
            "requests": args.sessions * args.turns + 8 * args.group,
            "hit_rate": round(stats.hit_rate, 3),
            "work_per_replica": dict(sorted(stats.work.items())),
            "balance_max_over_mean": round(max(stats.work.values()) / (sum(stats.work.values()) / len(stats.work)), 3),
            "start_s": round(started, 2),
            "generate_s": round(time.perf_counter() - t0, 2),
        }
    ray.shutdown()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
