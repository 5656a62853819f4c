#!/bin/bash
# verl's own GRPO trainer (python -m verl.trainer.main_ppo: FSDP actor, hybrid rollout on one GPU) on a tiny random
# Qwen2 built by genengine's model builder, a generated parquet of prompts and a rule reward, for STEPS steps.
#
#   bash examples/verl_grpo.sh                         # rollout.name=genengine, genengine backend sglang
#   BACKEND=vllm bash examples/verl_grpo.sh            # rollout.name=genengine, genengine backend vllm
#   ROLLOUT=vllm bash examples/verl_grpo.sh            # verl's own vLLM rollout, the same config otherwise
#
# Env: ROLLOUT (genengine | vllm | sglang), BACKEND (sglang | vllm: the genengine backend), STEPS (5), OUT (a work
# folder, default a temporary one), MODEL (an HF model folder; default: the tiny random Qwen2 built into OUT), and
# any extra Hydra overrides as arguments. Needs verl 0.9.1 (pip install 'genengine[verl]' or the GPU kit's
# WITH_VERL=1), Ray and the engine. The two lines that select genengine are marked below; docs/verl.md says more.
# The FSDP actor uses PyTorch's SDPA attention (no flash-attn needed). Prints verl's per-step metrics; the step
# times are timing_s/gen, timing_s/update_weights and timing_s/step. TransferQueue (verl's default v1 trainer) keeps
# 2 storage units instead of its 8: each reserves one of Ray's CPUs for the whole run, too many beside one GPU's workers.
set -euo pipefail
ROLLOUT=${ROLLOUT:-genengine}
BACKEND=${BACKEND:-sglang}
STEPS=${STEPS:-5}
OUT=${OUT:-$(mktemp -d -t verl-grpo-XXXXXX)}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
# genengine from this checkout in every Ray process; without an installed entry point, verl imports the plugin
# through its own VERL_USE_EXTERNAL_MODULES (an installed genengine[verl] needs neither line).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export VERL_USE_EXTERNAL_MODULES=${VERL_USE_EXTERNAL_MODULES:-genengine.integrations.verl.plugin}

MODEL=${MODEL:-$OUT/model}
"$PYTHON" - "$OUT" "$MODEL" <<'EOF'
import json, os, sys
import pandas as pd

out, model = sys.argv[1], sys.argv[2]
if not os.path.exists(os.path.join(model, "config.json")):
    from genengine.testing.tiny_model import build_tiny_model

    build_tiny_model(model, arch="qwen2", seed=0)  # random weights, a real tokenizer and chat template
words = ["apple", "river", "stone", "cloud", "seven", "green", "music", "north"]
def rows(n, offset):
    for i in range(n):
        w = words[(i + offset) % len(words)]
        yield {
            "data_source": "genengine_tiny",
            "prompt": [{"role": "user", "content": f"Say the word {w} {i} times."}],
            "ability": "echo",
            "reward_model": {"style": "rule", "ground_truth": w},
            "extra_info": {"index": i},
        }
pd.DataFrame(list(rows(256, 0))).to_parquet(os.path.join(out, "train.parquet"))
pd.DataFrame(list(rows(16, 3))).to_parquet(os.path.join(out, "val.parquet"))
with open(os.path.join(out, "reward.py"), "w") as fh:
    fh.write(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    # rule reward: the ground-truth word counts, and shorter answers are preferred a little\n"
        "    return float(solution_str.count(ground_truth)) - 0.001 * len(solution_str)\n"
    )
print(json.dumps({"model": model, "data": out}))
EOF

ENGINE_ARGS=()
if [ "$ROLLOUT" = genengine ]; then
  # the two lines of a verl config that switch it to genengine (and through it to BACKEND):
  ENGINE_ARGS+=("actor_rollout_ref.rollout.name=genengine")
  ENGINE_ARGS+=("+actor_rollout_ref.rollout.engine_kwargs.genengine.backend=$BACKEND")
else
  ENGINE_ARGS+=("actor_rollout_ref.rollout.name=$ROLLOUT")
fi

"$PYTHON" -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  data.train_files="$OUT/train.parquet" \
  data.val_files="$OUT/val.parquet" \
  data.train_batch_size=32 \
  data.max_prompt_length=64 \
  data.max_response_length=64 \
  data.filter_overlong_prompts=False \
  data.truncation=error \
  data.dataloader_num_workers=0 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.use_remove_padding=False \
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
  actor_rollout_ref.model.enable_gradient_checkpointing=False \
  actor_rollout_ref.actor.strategy=fsdp \
  actor_rollout_ref.actor.optim.lr=1e-5 \
  actor_rollout_ref.actor.ppo_mini_batch_size=32 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.fsdp_config.param_offload=False \
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
  actor_rollout_ref.rollout.mode=async \
  actor_rollout_ref.rollout.n=4 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
  actor_rollout_ref.rollout.max_model_len=1024 \
  actor_rollout_ref.rollout.max_num_batched_tokens=8192 \
  actor_rollout_ref.rollout.enforce_eager=True \
  actor_rollout_ref.rollout.free_cache_engine=True \
  actor_rollout_ref.rollout.calculate_log_probs=True \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
  actor_rollout_ref.rollout.agent.num_workers=2 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
  "${ENGINE_ARGS[@]}" \
  reward.custom_reward_function.path="$OUT/reward.py" \
  reward.custom_reward_function.name=compute_score \
  reward.num_workers=1 \
  trainer.logger='["console"]' \
  trainer.project_name=genengine-verl \
  trainer.experiment_name="grpo-$ROLLOUT-$BACKEND" \
  trainer.val_before_train=False \
  trainer.test_freq=-1 \
  trainer.save_freq=-1 \
  trainer.n_gpus_per_node=1 \
  trainer.nnodes=1 \
  trainer.total_epochs=100 \
  trainer.total_training_steps="$STEPS" \
  trainer.default_local_dir="$OUT/checkpoints" \
  transfer_queue.backend.SimpleStorage.num_data_storage_units=2 \
  "$@"
