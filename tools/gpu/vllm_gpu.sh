#!/bin/bash
# tools/gpu/vllm_gpu.sh tests|tp2|bench [extra args]   (runs on the GPU machine, from the repo root)
#
# Needs vLLM 0.26.0 unpacked in /tmp/site-vllm by shared/gpu/install.sh (the kit's chunk calls come
# first, back to back). Installs this project offline into /tmp/site-proj (entry points must resolve),
# then runs one of:
#   tests  the vllm GPU tests (conformance suite + extras) on one GPU        ~4 min
#   tp2    tests/gpu/tp2_vllm.py under torchrun, 2 GPUs (nvidia-h200-x2)      ~2 min
#   bench  benchmarks/bench_vllm.py at Qwen2-7B shape, one GPU                ~5 min
# Results land in $OUT when it is set (junit XML, tp2 JSON, bench JSON).
set -euo pipefail
cd "$(dirname "$0")/../.."
what=${1:?usage: tools/gpu/vllm_gpu.sh tests|tp2|bench [args]}; shift
SITE_ENGINE=${SITE_ENGINE:-/tmp/site-vllm}
SITE_PROJ=${SITE_PROJ:-/tmp/site-proj}
OUTDIR=${OUT:-/tmp}
[ -d "$SITE_ENGINE/vllm" ] || { echo "vllm_gpu.sh: no vLLM in $SITE_ENGINE: run the kit's install.sh calls first" >&2; exit 3; }

rm -rf "$SITE_PROJ"   # always this tree's copy: the entry points must match the code that runs
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE_PROJ" . \
  || { echo "vllm_gpu.sh: offline install of the project failed (setuptools missing?)" >&2; exit 3; }
export PYTHONPATH="$SITE_PROJ:$SITE_ENGINE${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import pluggy, yaml' 2>/dev/null || { echo "vllm_gpu.sh: pluggy/pyyaml missing on this machine" >&2; exit 3; }

# Settings of the machine, not of the product.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
export VLLM_USE_FLASHINFER_SAMPLER=0          # flashinfer is not carried by the kit
export VLLM_ALLREDUCE_USE_SYMM_MEM=0          # NVLink multicast is off on the shared multi-GPU hosts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

case "$what" in
  tests)
    python3 -c 'import pytest' 2>/dev/null || { echo "vllm_gpu.sh: pytest missing on this machine" >&2; exit 3; }
    exec python3 -m pytest -m gpu tests/gpu/test_vllm_gpu.py -q -p no:cacheprovider \
      --junitxml "$OUTDIR/vllm_gpu_junit.xml" "$@" ;;
  tp2)
    exec python3 -m torch.distributed.run --nproc-per-node 2 tests/gpu/tp2_vllm.py --json "$OUTDIR/tp2_vllm.json" "$@" ;;
  bench)
    exec python3 benchmarks/bench_vllm.py --json "$OUTDIR/bench_vllm.json" "$@" ;;
  *) echo "usage: tools/gpu/vllm_gpu.sh tests|tp2|bench [args]" >&2; exit 2 ;;
esac
