#!/bin/bash
# tools/gpu/run_tests.sh ENGINE [pytest args]      (ENGINE = sglang | vllm; on the GPU machine, any cwd)
# tools/gpu/run_tests.sh ENGINE --tp2 [args]       tests/gpu/tp2_ENGINE.py under torchrun, 2 GPUs
# tools/gpu/run_tests.sh ENGINE --bench [args]     benchmarks/bench_ENGINE.py, one GPU
# tools/gpu/run_tests.sh ENGINE --script F [args]  python3 F args (e.g. benchmarks/soak.py) in the same setting
# tools/gpu/run_tests.sh ENGINE --torchrun2 F [args]  the same under torchrun, 2 ranks
#
# Needs the engine unpacked in /tmp/site-ENGINE by the kit (tools/gpu/prepare.sh chunks, install.sh
# --final in the same call or an earlier one on the same warm machine). Installs this project offline
# into /tmp/site-proj (entry points, i.e. create_engine(backend=...), need the install), then runs
# `python3 -m pytest -m gpu` on the given paths (default tests/gpu/test_ENGINE_gpu.py) with the machine's
# settings. Results (junit XML, JSON) land in $OUT when it is set. Set SAVE_JIT=1 to leave the compiled
# kernels in $OUT/jit-cache.tar.xz for the next prepare.sh (JIT_CACHE=...).
set -euo pipefail
die() { echo "run_tests.sh: ERROR: $*" >&2; exit 3; }
ENGINE=${1:?usage: tools/gpu/run_tests.sh sglang|vllm [--tp2|--bench] [args]}; shift
case "$ENGINE" in sglang|vllm) ;; *) die "ENGINE must be sglang or vllm, not '$ENGINE'" ;; esac
cd "$(dirname "$0")/../.."
SITE_ENGINE=${SITE_ENGINE:-/tmp/site-$ENGINE}
SITE_PROJ=${SITE_PROJ:-/tmp/site-proj}
OUTDIR=${OUT:-/tmp}
[ -d "$SITE_ENGINE/$ENGINE" ] || die "no $ENGINE in $SITE_ENGINE: make the kit's install.sh calls first (--final)"

# This tree's copy, always (the entry points must match the code that runs); KEEP_SITE_PROJ=1 (verify.sh, after
# installing it once) reuses the copy already there.
if [ "${KEEP_SITE_PROJ:-0}" != 1 ] || [ ! -d "$SITE_PROJ/genengine" ]; then
  rm -rf "$SITE_PROJ"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE_PROJ" . \
    || die "offline install of the project failed (does the image have setuptools>=68?)"
fi
# tests/ for the repo's test helpers (tests/support, imported as `support`): pytest finds them by itself,
# the torchrun scripts (tests/gpu/tp2_*.py, dp2.py) and benchmarks run from their own folders do not.
export PYTHONPATH="$SITE_PROJ:$PWD/tests:$SITE_ENGINE${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import pluggy' 2>/dev/null || die "pluggy is missing: rerun prepare.sh (it carries the test pins)"

# Settings of the machine, not of the product.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # no NVLink multicast here
if [ "$ENGINE" = sglang ]; then
  # The kit drops FlashAttention 3 (sgl_kernel/flash_ops; also the default of a VLM's vision attention on
  # Hopper) and flashinfer's sampling would JIT-compile.
  export GENENGINE_SGLANG_OPTIONS=${GENENGINE_SGLANG_OPTIONS:-'{"attention_backend": "triton", "mm_attention_backend": "triton_attn", "sampling_backend": "pytorch", "grammar_backend": "none"}'}
else
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ALLREDUCE_USE_SYMM_MEM=0
  # The kit carries no blake3 wheel; vLLM hashes image inputs with it by default (sha256 is its FIPS choice).
  python3 -c 'import blake3' 2>/dev/null || export VLLM_MM_HASHER_ALGORITHM=${VLLM_MM_HASHER_ALGORITHM:-sha256}
fi

save_jit() {
  if [ "${SAVE_JIT:-0}" = 1 ] && [ -n "${OUT:-}" ]; then
    tar -C ~ --ignore-failed-read -cJf "$OUT/jit-cache.tar.xz" .cache/tvm-ffi .triton/cache .cache/flashinfer .cache/vllm 2>/dev/null || true
  fi
}
trap save_jit EXIT

echo "run_tests.sh: $ENGINE from $SITE_ENGINE, project from $SITE_PROJ; $(python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count(), "GPU(s)")')"
case "${1:-}" in
  --tp2)
    shift
    python3 -m torch.distributed.run --nproc-per-node 2 "tests/gpu/tp2_$ENGINE.py" --json "$OUTDIR/tp2_$ENGINE.json" "$@" ;;
  --bench)
    shift
    python3 "benchmarks/bench_$ENGINE.py" --json "$OUTDIR/bench_$ENGINE.json" "$@" ;;
  --script)
    shift
    python3 "$@" ;;
  --torchrun2)
    shift
    python3 -m torch.distributed.run --nproc-per-node 2 "$@" ;;
  *)
    python3 -c 'import pytest' 2>/dev/null || die "pytest is missing: rerun prepare.sh (it carries the test pins)"
    paths=()
    for arg in "$@"; do case "$arg" in tests/*|*.py|*::*) paths+=("$arg") ;; esac; done
    [ ${#paths[@]} -gt 0 ] || set -- "tests/gpu/test_${ENGINE}_gpu.py" "$@"
    # faulthandler_timeout: a test that hangs prints every thread's stack after that many seconds (no output otherwise).
    python3 -m pytest -m gpu -p no:cacheprovider -q -s -o faulthandler_timeout="${GPU_TEST_HANG_S:-120}" --junitxml "$OUTDIR/${ENGINE}_gpu_junit.xml" "$@" ;;
esac
