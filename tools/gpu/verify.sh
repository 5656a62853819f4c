#!/bin/bash
# tools/gpu/verify.sh ENGINE        (ENGINE = sglang | vllm; on the GPU machine, after the kit's last chunk)
#
# One call checks an engine: its GPU suite, the Ray GPU test run at the pool benchmark's 7B settings (so that
# it also gives P7), the exit test, the transport GPU test and bench_async (and on request the pool benchmark
# alone, TRL's GRPO example and the TRL sync benchmark), each part under its own timeout and inside one overall
# budget (VERIFY_BUDGET_S, default 540 s: a part that no longer fits is reported "skipped (budget)"). Every part runs in a session of
# its own with its output in a file (no pipe a leftover process could hold open); whatever it leaves running
# is killed before the next part starts. Logs, junit XML and JSON go to one tarball in $OUT
# (verify_ENGINE.tar.gz) beside the summary table (verify_ENGINE.md), which is also printed.
#
# Env: VERIFY_BUDGET_S (540), VERIFY_PARTS (default "suite ray exit transport async", in that order of priority;
#      also "pool": benchmarks/bench_pool.py by itself, "p1": bench_ENGINE.py --p1-only (ours and raw paired,
#      CUDA graphs on, 12 rounds; ~150 s at 7B; VERIFY_P1_MODES=graphs,eager adds the eager row, graphs,control
#      a row of raw against raw, the start order's share of the ratio), "ipc": benchmarks/bench_ipc.py (torch's CUDA IPC against
#      the driver's, per phase), "trl": where TRL is installed its two scripts, else one
#      "skipped" row at no cost, "trl_grpo" or "trl_sync": one of them, "trl_step": benchmarks/bench_trl_step.py, only on request;
#      "bench": bench_ENGINE.py without P1 (P2, P3, SGLang's level-2 memory per process; ~200 s),
#      "sync": benchmarks/bench_sync_7b.py (genengine bench --sync at 7B, phases JSON + PNG; ~60 s), "sync_pool": the same
#      with --pool (the pool's row too: two 7B replicas on the GPU; ~150-200 s),
#      "adapters": tests/gpu/test_ENGINE_adapters_gpu.py, "trl_async": tests/gpu/test_trl_async_gpu.py, "verl":
#      tests/gpu/test_verl_gpu.py's run on genengine, "verl_base": its run on verl's own rollout (the comparison), "lora":
#      benchmarks/bench_lora_sync.py at 7B (adapter sync against merge + full sync + unmerge),
#      "profile": benchmarks/profile_p1.py (P1's pair timed inside at two lengths; ~90 s)), VERIFY_RAY_SCALE (7b, the default, or
#      tiny: the Ray test alone, no P7 figures), GENENGINE_EXIT_PARALLEL (1: the exit cases side by side, then
#      one at a time only if that failed, as the row exit_seq; 0: one at a time), EXIT_CASES (pytest
#      -k for the exit test; default: all four cases), VERIFY_TRL_BACKEND (the trl part's --backend, default
#      ENGINE; "transformers" runs the same two scripts on the CPU, to check this script where there is no GPU),
#      SITE_ENGINE (default /tmp/site-ENGINE, as for run_tests.sh), SITE_PROJ (default /tmp/site-proj),
#      SAVE_JIT=1 (the kernels and vLLM's torch.compile artifacts all parts made, in $OUT/jit-cache-ENGINE.tar.xz).
set -uo pipefail
ENGINE=${1:?usage: tools/gpu/verify.sh sglang|vllm}
case "$ENGINE" in sglang|vllm) ;; *) echo "verify.sh: ENGINE must be sglang or vllm, not '$ENGINE'" >&2; exit 3 ;; esac
cd "$(dirname "$0")/../.."
REAL_OUT=${OUT:-/tmp/verify-out}; mkdir -p "$REAL_OUT"
WORK=$(mktemp -d /tmp/verify-$ENGINE-XXXX)
BUDGET=${VERIFY_BUDGET_S:-540}
PARTS=${VERIFY_PARTS:-suite ray exit transport async}
RAY_SCALE=${VERIFY_RAY_SCALE:-7b}
case "$RAY_SCALE" in 7b) RAY_TIMEOUT=330 ;; tiny) RAY_TIMEOUT=240 ;;
  *) echo "verify.sh: VERIFY_RAY_SCALE must be 7b or tiny, not '$RAY_SCALE'" >&2; exit 3 ;; esac
SITE_ENGINE=${SITE_ENGINE:-/tmp/site-$ENGINE}
TRL_BACKEND=${VERIFY_TRL_BACKEND:-$ENGINE}
T0=$(date +%s)
SUMMARY="$REAL_OUT/verify_$ENGINE.md"
ROWS=()
LAST_RC=skipped  # the last part's exit status (or "skipped")
export GENENGINE_EXIT_DUMP_S=15 PYTHONUNBUFFERED=1
SAVE_JIT_AT_END=${SAVE_JIT:-0}; export SAVE_JIT=0  # once, after the last part (not after every part)
# The project installed once for every part (run_tests.sh reuses it with KEEP_SITE_PROJ=1).
rm -rf "${SITE_PROJ:-/tmp/site-proj}"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "${SITE_PROJ:-/tmp/site-proj}" . \
  || { echo "verify.sh: offline install of the project failed" >&2; exit 3; }
export KEEP_SITE_PROJ=1

elapsed() { echo $(( $(date +%s) - T0 )); }

reap() {  # every process that carries this part's mark (its whole tree: Ray workers, engine processes, orphans)
  local mark=$1 pid
  for pid in $(grep -lsa "GENENGINE_VERIFY_MARK=$mark" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do
    [ "$pid" != $$ ] && kill -9 "$pid" 2>/dev/null
  done
  # By name only on the GPU machine, which runs nothing else; on a shared CPU machine only the marked tree.
  command -v nvidia-smi >/dev/null && pkill -9 -f 'sglang::|raylet|gcs_server|dashboard_agent|runtime_env_agent' 2>/dev/null
  for _ in $(seq 1 40); do  # killed processes give their GPU memory back a little later
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return
    sleep 0.5
  done
}

junit_counts() {  # "N tests, F failed, E errors, S skipped" of a junit file
  python3 - "$1" <<'EOF' 2>/dev/null || echo "no junit"
import sys, xml.etree.ElementTree as ET
r = ET.parse(sys.argv[1]).getroot()
s = r if r.tag == "testsuite" else r.find("testsuite")
print(f"{s.get('tests')} tests, {s.get('failures')} failed, {s.get('errors')} errors, {s.get('skipped')} skipped")
EOF
}

exit_gap() {  # seconds from the suite's GENENGINE_EXIT_WATCH line to the part's end ($2), or "-"
  local t; t=$(grep -o 'GENENGINE_EXIT_WATCH at [0-9.]*' "$1" | tail -1 | awk '{print $3}')
  [ -n "$t" ] && python3 -c "print(f'{$2 - $t:.1f} s')" || echo "-"
}

pool_figures() {  # P7 from the pool benchmark's report (written by bench_pool.py, or by the Ray test at 7B)
  python3 - "$WORK/bench_pool_$ENGINE.json" "$WORK/trace" <<'EOF' 2>/dev/null || echo "no report"
import glob, json, statistics, sys
r = json.load(open(sys.argv[1]))
if "error" in r: print("error: " + r["error"][:200]); raise SystemExit
s = r["sync"]
t = r["tokens_per_s"]; sp = t.get("spread", {})
print(f"pool/in-process {r['ratio']:.3f}, paired {r.get('paired_ratio', float('nan')):.3f} (tok/s {t['median']['pool']:.0f} / {t['median']['in_process']:.0f}; "
      f"spread {sp.get('pool', float('nan')):.0%} / {sp.get('in_process', float('nan')):.0%}); "
      f"sync pool {s['pool_median_s']:.3f} s vs in-process {s['in_process_median_s']:.3f} s; outputs equal: {r['verdicts']['outputs_equal']}")
by = s.get("pool_median_s_by_handles", {})
if len(by) > 1:
    print("; pool sync by cuda_ipc handles: " + ", ".join(f"{h} {v:.3f} s" for h, v in by.items()))
# Both ends of each sync after the first ($GENENGINE_SYNC_TRACE), per way of sharing: where the sync time goes.
for side, who in (("sender", "trainer"), ("receiver", "replica")):
    found = [json.load(open(f)) for f in glob.glob(sys.argv[2] + f"/sync-*-{side}-*.json")]
    for handles in sorted({x.get("handles", "torch") for x in found}):
        rows = [x for x in found if x["seq"] > 1 and x.get("handles", "torch") == handles]
        if rows:
            phases = sorted({k for x in rows for k in x["totals"]}, key=lambda k: -statistics.median(x["totals"].get(k, 0) for x in rows))
            print(f"; {who} per sync, {handles} handles (ms, medians): " + ", ".join(f"{k} {1000 * statistics.median(x['totals'].get(k, 0) for x in rows):.1f}" for k in phases))
EOF
}

run_part() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - $(elapsed) ))
  if [ "$left" -lt 60 ]; then ROWS+=("| $name | - | - | skipped (budget: ${left} s left) |"); LAST_RC=skipped; return; fi
  [ "$limit" -gt $(( left - 5 )) ] && limit=$(( left - 5 ))
  local log="$WORK/$name.log" start end rc
  start=$(date +%s.%N)
  echo "verify.sh: [$(elapsed) s] $name (timeout $limit s)"
  local mark="$name-$$-$RANDOM"
  GENENGINE_VERIFY_MARK=$mark OUT=$WORK setsid -w bash -c "timeout -k 10 $limit $* > '$log' 2>&1 < /dev/null"
  rc=$?; LAST_RC=$rc
  end=$(date +%s.%N)
  reap "$mark"
  local secs; secs=$(python3 -c "print(f'{$end - $start:.0f}')")
  local what
  case "$name" in
    suite|ray|transport|exit|exit_seq|adapters|trl_async) what="$(junit_counts "$WORK/$name.xml")" ;;
    verl|verl_base) what="$(junit_counts "$WORK/$name.xml"); $(python3 - "$WORK" "$ENGINE" \
                      "$([ "$name" = verl ] && echo genengine || echo verl)" <<'EOF' 2>/dev/null || echo "no step report"
import json, sys
from pathlib import Path
r = json.loads((Path(sys.argv[1]) / f"verl_steps_{sys.argv[2]}_{sys.argv[3]}.json").read_text())
if "error" in r: print(f"{sys.argv[3]}: error: " + r["error"][:120]); raise SystemExit
print(f"{sys.argv[3]} rollout, median of steps 2-{r['steps']}: step {r['step_s']:.2f} s = generate "
      f"{r['generate_s']:.2f} + weight update {r['update_weights_s']:.2f} + rest {r['rest_s']:.2f}")
EOF
)" ;;
    pool) what=$(pool_figures) ;;
    trl_grpo) what=$(python3 - "$WORK/trl_grpo_$TRL_BACKEND.json" <<'EOF' 2>/dev/null || echo "no report"
import json, sys
r = json.load(open(sys.argv[1]))
if "error" in r: print("error: " + r["error"][:200]); raise SystemExit
g = r["runs"][0]; s = g["last_sync"]
print(f"{len(g['reward'])} GRPO steps in {g['seconds']:.1f} s (trainer and engine built in {g['setup_s']:.1f} s); "
      "reward per step " + " ".join(f"{x:.2f}" for x in g["reward"]) + "; max engine-policy logprob gap "
      f"{max(g['logp_gap_max']):.3g}; last sync {s['tensors']} tensors in {s['buckets']} bucket(s), {s['seconds']:.3f} s")
EOF
) ;;
    trl_sync) what=$(python3 - "$WORK/bench_trl_sync_$TRL_BACKEND.json" <<'EOF' 2>/dev/null || echo "no report"
import json, sys
r = json.load(open(sys.argv[1]))
if "genengine" not in r: print("error: " + r.get("error", "no result")[:200]); raise SystemExit
m, x = r.get("median_s", {}), r.get("speedup", {})
s = lambda key: "-" if m.get(key) is None else f"{m[key]:.4f} s" + (f" ({x[key]:.1f}x ours)" if x.get(key) else "")
trl = s("trl_vllm_per_param") if r.get("trl_vllm_per_param") else f"not run ({r.get('trl_not_run', 'failed')})"
print(f"{r.get('shape', '?')}: genengine {s('genengine')}; TRL's per-parameter loop into it {s('per_param_into_genengine')}; "
      f"TRL VLLMGeneration {trl}; landed {r.get('landed')}" + (f"; error: {r['error'][:200]}" if "error" in r else ""))
EOF
) ;;
    p1) what=$(python3 - "$WORK/bench_$ENGINE.json" <<'EOF' 2>/dev/null || echo "no report"
import json, sys
r = json.load(open(sys.argv[1]))
out = []
for mode, row in (r.get("p1") or {}).items():
    if "ratio" not in row:
        out.append(f"{mode}: failed: {row.get('error', 'no samples')[:200]}")
        continue
    o, w, q = row["ours"], row["raw"], row["ratio"]
    who = "raw started second/raw" if mode == "control" else "ours/raw"
    out.append(f"{mode}: {who} {q['median']:.4f} (rounds {q['min']:.3f}-{q['max']:.3f}, n={row['samples']}); "
               f"tok/s {o['median']:.0f} / {w['median']:.0f} (spread {o['spread_pct']:.1f} % / {w['spread_pct']:.1f} %); {row['seconds']:.0f} s")
print("; ".join(out) or "no P1 rows")
EOF
) ;;
    trl_step) what=$(python3 - "$WORK/bench_trl_step_$TRL_BACKEND.json" <<'EOF' 2>/dev/null || echo "no report"
import json, sys
r = json.load(open(sys.argv[1]))
out = []
for side in ("trl", "genengine"):
    row = r.get(side)
    if not row:
        continue
    if "median_s" not in row:
        out.append(f"{side}: {row.get('error', 'no result')[:200]}")
        continue
    m = row["median_s"]
    out.append(f"{side} ({row['backend']}): step {m['total']:.2f} s = generate {m['generate']:.2f}, sync {m['sync']:.3f}, "
               f"sleep+wake {m['sleep_wake']:.3f}, train {m['train']:.2f}")
if r.get("step_ratio_vs_trl"):
    out.append(f"genengine/TRL {r['step_ratio_vs_trl']:.3f}")
print(f"{r.get('shape')}, median of {r.get('steps')}: " + "; ".join(out))
EOF
) ;;
    bench) what=$(python3 - "$WORK/bench_p2p3_$ENGINE.json" <<'EOF' 2>/dev/null || echo "no report"
import json, sys
r = json.load(open(sys.argv[1]))
out = []
if "error" in r:
    out.append("error: " + str(r["error"])[:200])
ours = r.get("ours", r)  # vLLM's report keeps ours under "ours", SGLang's at the top
p2, p3, raw = ours.get("p2") or {}, ours.get("p3") or {}, r.get("raw") or {}
d = p2.get("bucketed_512MiB") or p2.get("handles") or {}
if d:
    s = d.get("s", d.get("until_visible_s"))
    out.append(f"P2 {s:.4f} s" + (f" ({d['speedup_vs_per_param']}x per-param)" if "speedup_vs_per_param" in d else ""))
for level in (1, 2):
    m = p3.get(f"level{level}")
    if m:
        out.append(f"P3 level {level} frees {m['share']:.2%}")
if "cycle_s" in p3:
    out.append(f"cycle {p3['cycle_s']:.3f} s" + (f" ({p3['cycle_parts_s']})" if "cycle_parts_s" in p3 else ""))
w = p3.get("level2_who_keeps_what")
if w:
    out.append(f"level 2 leaves {w.get('left_gib')} GiB: scheduler {w.get('scheduler_gib')} (torch outside the saver "
               f"{w.get('scheduler_torch_outside_saver_gib')}, not torch {w.get('scheduler_not_torch_gib')}), trainer "
               f"+{w.get('trainer_process_extra_gib')}, a bare CUDA process {w.get('cuda_process_floor_gib')}")
t = raw.get("p3_release_by_tag")
if t:
    out.append(f"raw release of every tag {t['all_tags_share']:.2%}")
out.append("verdicts " + ", ".join(f"{k} {v}" for k, v in (r.get("verdicts") or {}).items()))
print("; ".join(out))
EOF
) ;;
    sync|sync_pool) what=$(python3 - "$WORK/bench_sync_$ENGINE.json" "$WORK/bench_sync_$ENGINE.png" <<'EOF' 2>/dev/null || echo "no report"
import json, os, sys
r = json.load(open(sys.argv[1]))
if "error" in r: print("error: " + r["error"][:200]); raise SystemExit
t = r["targets"]["in_process"]
ms = lambda v: "n/a" if v is None else f"{1000 * v:.1f}"
print(f"{r['num_tensors']} tensors {r['num_bytes'] / 1e9:.1f} GB, medians (ms): "
      + ", ".join(f"{p} {ms((v or {}).get('median'))}" for p, v in t["phases"].items())
      + f"; total {ms(t['total_median'])}; slowest {t['slowest']}; requests finished {t.get('requests_finished')}; "
      + ("PNG written" if os.path.exists(sys.argv[2]) else "no PNG (no matplotlib: draw it from the JSON)"))
p = r["targets"].get("pool")  # bench_sync_7b.py --pool
if p:
    print(f"; pool ({r['pool']['replicas']} replicas over {r['pool']['transport']}), medians (ms): "
          + ", ".join(f"{k} {ms((v or {}).get('median'))} (spread {ms((v or {}).get('spread'))})" for k, v in p["phases"].items())
          + f"; whole {ms(p['whole']['median'])}; slowest {p['slowest']}; requests finished {p.get('requests_finished')}")
EOF
) ;;
    profile) what=$(head -c 1500 "$WORK/profile_p1_$ENGINE.txt" 2>/dev/null | tr -s ' ' || echo "no report") ;;
    ipc) what=$(python3 - "$WORK/bench_ipc.json" <<'EOF' 2>/dev/null || echo "no report"
import json, sys
r = json.load(open(sys.argv[1]))
m = r["median_ms"]
print("; ".join(f"{way}: " + ", ".join(f"{k} {v:.1f}" for k, v in p.items()) + " ms" for way, p in m.items())
      + f" ({r['tensors']} tensors in {r.get('driver_allocations')} allocations)")
EOF
) ;;
    async) what=$(python3 - "$WORK/bench_async_$ENGINE.json" <<'EOF' 2>/dev/null || echo "no report"
import json, statistics, sys
r = json.load(open(sys.argv[1]))
if "error" in r: print("error: " + r["error"][:200]); raise SystemExit
a = r["async"]; parts = a.get("pause_load_resume_parts", {})
split = ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in parts.items())
print(f"async/sync {r['ratio']:.3f}; pause-load-resume max {a['pause_load_resume_max']:.3f} s" + (f" (medians: {split} s)" if split else ""))
EOF
) ;;
    lora) what=$(python3 - "$WORK/bench_lora_sync_$ENGINE.json" <<'EOF' 2>/dev/null || echo "no report (see lora.log)"
import json, sys
r = json.load(open(sys.argv[1]))
if "error" in r: print("error: " + r["error"][:200]); raise SystemExit
print(f"adapter {r['adapter_s']:.4f} s (+{r['adapter_extra_gib']:.2f} GiB, free -{r['adapter_free_drop_gib']:.2f} GiB); "
      f"merge + full sync + unmerge {r['merge_s']:.4f} s (+{r['merge_extra_gib']:.2f} GiB, free -{r['merge_free_drop_gib']:.2f} GiB); "
      f"{r['adapter_tensors']} adapter tensors; served {r['adapter_served']}; goal 10 ms {r['goal_10ms']}")
phases = r.get("adapter_phases") or {}
if phases:
    print(f"adapter steps ({r.get('adapter_sync_mode', '?')}, ms): " + ", ".join(f"{k} {1e3 * v:.2f}" if k.endswith("_s") else f"{k} {v:g}" for k, v in phases.items()))
if "adapter_first_use_s" in r:
    print(f"one-token generate right after a sync {r['adapter_first_use_s']:.4f} s, again {r['adapter_warm_use_s']:.4f} s")
EOF
) ;;
    *) what="see $name.log" ;;
  esac
  what=$(printf '%s' "$what" | tr '\n|' ' /')  # one table row: no line breaks, no cell separators
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && what="TIMED OUT; $what"
  if [ "$name" = suite ]; then what="$what; exit after summary: $(exit_gap "$log" "$end")"; fi
  grep -q 'Timeout (0:00:' "$log" && what="$what; EXIT HELD (stacks in $name.log)"
  ROWS+=("| $name | $rc | $secs | $what |")
  if [ "$name" = ray ] && [ "$RAY_SCALE" = 7b ]; then  # the same run gave the pool benchmark's figures
    ROWS+=("| pool | (ray) | - | $(pool_figures | tr '\n|' ' /') |")
  fi
}

trl_parts() {  # TRL's GRPO example (tiny model, 3 steps) and/or the TRL sync benchmark (7B), where TRL is installed
  local which=${1:-trl_grpo trl_sync} info
  if ! info=$(PYTHONPATH="$SITE_ENGINE${PYTHONPATH:+:$PYTHONPATH}" python3 - 2>&1 <<'EOF'
import importlib.metadata as md
import datasets, trl  # noqa: F401  (the part needs both: an ImportError skips it)
from packaging.requirements import Requirement
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
unmet = []
for dist in ("trl", "datasets", "multiprocess"):  # what pip would have checked: met by the image and the site?
    for text in md.requires(dist) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        have = version(req.name)
        if have is None:
            unmet.append(f"{req.name} missing ({dist} wants {req.specifier or 'it'})")
        elif not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{req.name} {have} ({dist} wants {req.specifier})")
names = ("trl", "datasets", "transformers", "accelerate", "huggingface-hub", "pyarrow", "fsspec")
print(", ".join(f"{n} {version(n)}" for n in names) + "; requirements unmet: " + ("; ".join(unmet) or "none"))
EOF
  ); then
    ROWS+=("| trl | - | - | skipped (trl not installed: $(echo "$info" | tail -1 | tr '|' '/' | cut -c1-160); the kit carries it with WITH_TRL=1) |")
    return
  fi
  ROWS+=("| trl | - | - | $(echo "$info" | tail -1 | tr '|' '/') |")
  case " $which " in *" trl_grpo "*)
    run_part trl_grpo 240 bash tools/gpu/run_tests.sh "$ENGINE" --script examples/trl_grpo.py --backend "$TRL_BACKEND" --steps 3 ;;
  esac
  case " $which " in *" trl_sync "*)
    run_part trl_sync 330 bash tools/gpu/run_tests.sh "$ENGINE" --script benchmarks/bench_trl_sync.py --backend "$TRL_BACKEND" ;;
  esac
  case " $which " in *" trl_step "*)  # on request only (VERIFY_PARTS=trl_step): ~4 min on vllm (two sides), ~2 on sglang
    run_part trl_step 540 bash tools/gpu/run_tests.sh "$ENGINE" --script benchmarks/bench_trl_step.py --backend "$TRL_BACKEND" ;;
  esac
}

PYTEST_J() { echo "--junitxml $WORK/$1.xml"; }
# A verl run's own limit: under its part's (pytest's start before it, the stack dump after), so that a run that
# never ends leaves every process's stacks in the tarball rather than being killed with the part.
verl_run_s() {
  local t=${VERIFY_VERL_TIMEOUT_S:-420} left=$(( BUDGET - $(elapsed) - 5 ))
  [ "$left" -lt "$t" ] && t=$left
  echo $(( t > 80 ? t - 40 : 40 ))
}
# pytest's faulthandler dump (run_tests.sh's GPU_TEST_HANG_S, 120 s) after the run's own limit: a healthy run
# takes ~200 s, and the run's timeout dumps every process's stacks itself.
verl_hang_s() { echo $(( $(verl_run_s) + 20 )); }
for part in $PARTS; do
  case "$part" in
    suite) run_part suite 330 bash tools/gpu/run_tests.sh "$ENGINE" "$(PYTEST_J suite)" ;;
    ray) run_part ray "$RAY_TIMEOUT" env GENENGINE_RAY_GPU_SCALE="$RAY_SCALE" GPU_TEST_HANG_S=300 GENENGINE_SYNC_TRACE="$WORK/trace" \
           bash tools/gpu/run_tests.sh "$ENGINE" tests/gpu/test_ray_gpu.py "$(PYTEST_J ray)" ;;
    pool) run_part pool 330 bash tools/gpu/run_tests.sh "$ENGINE" --script benchmarks/bench_pool.py "$ENGINE" ;;
    exit) run_part exit 330 bash tools/gpu/run_tests.sh "$ENGINE" tests/gpu/test_exit_gpu.py "$(PYTEST_J exit)" \
            ${EXIT_CASES:+-k "'$EXIT_CASES'"}
          # The cases run side by side; if that failed, once more one at a time (is it the sharing, or the exit?)
          if [ "$LAST_RC" != 0 ] && [ "$LAST_RC" != skipped ] && [ "${GENENGINE_EXIT_PARALLEL:-1}" != 0 ]; then
            run_part exit_seq 330 env GENENGINE_EXIT_PARALLEL=0 bash tools/gpu/run_tests.sh "$ENGINE" \
              tests/gpu/test_exit_gpu.py "$(PYTEST_J exit_seq)" ${EXIT_CASES:+-k "'$EXIT_CASES'"}
          fi ;;
    transport) run_part transport 150 bash tools/gpu/run_tests.sh "$ENGINE" tests/gpu/test_transport_gpu.py "$(PYTEST_J transport)" ;;
    async) run_part async 240 bash tools/gpu/run_tests.sh "$ENGINE" --script benchmarks/bench_async.py "$ENGINE" ;;
    p1) run_part p1 "${VERIFY_P1_TIMEOUT_S:-$([ "${VERIFY_P1_MODES:-graphs}" = graphs ] && echo 240 || echo 360)}" \
          bash tools/gpu/run_tests.sh "$ENGINE" --bench --p1-only --p1-modes "${VERIFY_P1_MODES:-graphs}" ;;
    ipc) run_part ipc 120 bash tools/gpu/run_tests.sh "$ENGINE" --script benchmarks/bench_ipc.py --rounds 6 ;;
    bench) run_part bench 330 bash tools/gpu/run_tests.sh "$ENGINE" --bench --p1-modes "''" --json "$WORK/bench_p2p3_$ENGINE.json" \
             $([ "$ENGINE" = sglang ] && echo --variants handles,flattened,per_param) ;;
    sync) run_part sync 240 bash tools/gpu/run_tests.sh "$ENGINE" --script benchmarks/bench_sync_7b.py "$ENGINE" ;;
    sync_pool) run_part sync_pool 300 bash tools/gpu/run_tests.sh "$ENGINE" --script benchmarks/bench_sync_7b.py "$ENGINE" --pool ;;
    profile) run_part profile 240 bash tools/gpu/run_tests.sh "$ENGINE" --script benchmarks/profile_p1.py "$ENGINE" ;;
    adapters) run_part adapters 240 bash tools/gpu/run_tests.sh "$ENGINE" "tests/gpu/test_${ENGINE}_adapters_gpu.py" "$(PYTEST_J adapters)" ;;
    trl_async) run_part trl_async 360 bash tools/gpu/run_tests.sh "$ENGINE" tests/gpu/test_trl_async_gpu.py "$(PYTEST_J trl_async)" ;;
    verl) run_part verl "${VERIFY_VERL_TIMEOUT_S:-420}" env GENENGINE_VERL_BASELINE=0 GENENGINE_VERL_RUN_TIMEOUT_S="$(verl_run_s)" GPU_TEST_HANG_S="$(verl_hang_s)" \
            bash tools/gpu/run_tests.sh "$ENGINE" tests/gpu/test_verl_gpu.py "$(PYTEST_J verl)" ;;
    verl_base) run_part verl_base "${VERIFY_VERL_TIMEOUT_S:-420}" env GENENGINE_VERL_BASELINE=only GENENGINE_VERL_RUN_TIMEOUT_S="$(verl_run_s)" GPU_TEST_HANG_S="$(verl_hang_s)" \
            bash tools/gpu/run_tests.sh "$ENGINE" tests/gpu/test_verl_gpu.py "$(PYTEST_J verl_base)" ;;
    lora) run_part lora 330 bash tools/gpu/run_tests.sh "$ENGINE" --script benchmarks/bench_lora_sync.py --backend "$ENGINE" \
            --json "$WORK/bench_lora_sync_$ENGINE.json" ;;
    trl) trl_parts ;;
    trl_grpo|trl_sync|trl_step) trl_parts "$part" ;;
    *) ROWS+=("| $part | - | - | unknown part (allowed: suite ray pool p1 profile bench sync exit transport async ipc adapters trl_async verl verl_base lora sync_pool trl trl_grpo trl_sync trl_step) |") ;;
  esac
done

# The engine release that ran: the installed distribution's version (the kit's site first, as every part saw it).
ENGINE_VERSION=$(PYTHONPATH="$SITE_ENGINE${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
  'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$ENGINE" 2>/dev/null) || ENGINE_VERSION="not installed"
{
  echo "### verify.sh $ENGINE $ENGINE_VERSION — $(date -u +%Y-%m-%dT%H:%MZ), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(elapsed) s of a $BUDGET s budget"
  echo
  echo "| part | rc | s | result |"
  echo "| --- | --- | --- | --- |"
  printf '%s\n' "${ROWS[@]}"
} > "$SUMMARY"
cat "$SUMMARY"
tar -C "$WORK" -czf "$REAL_OUT/verify_$ENGINE.tar.gz" . 2>/dev/null
if [ "$SAVE_JIT_AT_END" = 1 ]; then  # what every part compiled, for the kit's next chunks (README.md)
  tar -C ~ --ignore-failed-read -cJf "$REAL_OUT/jit-cache-$ENGINE.tar.xz" .cache/tvm-ffi .triton/cache .cache/flashinfer .cache/vllm 2>/dev/null
  echo "verify.sh: kernel and compile caches in jit-cache-$ENGINE.tar.xz ($(du -m "$REAL_OUT/jit-cache-$ENGINE.tar.xz" | cut -f1) MiB)"
fi
