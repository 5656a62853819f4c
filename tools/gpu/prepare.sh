#!/bin/bash
# prepare.sh ENGINE OUTDIR [VERSION]   (ENGINE = vllm | sglang; VERSION: default the pinned one, 0.26.0 / 0.5.17)
#
# Runs on a CPU dev machine with pip access. Downloads the pinned wheels that the
# GPU machine lacks, drops the parts that are not needed on an H200 (Hopper, sm90),
# packs the result as one xz-compressed tar split into chunk folders OUTDIR/ENGINE/cNN
# (each small enough for one GPU-runner call) and prints the call sequence.
# OUTDIR must be a git-ignored folder inside the repo whose tree the GPU runner sends.
#
# Env: CHUNK_MB (default: 63 MiB minus what the repo itself sends), XZ_LEVEL (default 6),
#      WHEEL_CACHE (default ~/.cache/gpu-kit-wheels), KEEP_FA2=1 (vLLM: keep the FA2 library),
#      JIT_CACHE=a.tar.xz[:b.tar.xz...] (compiled kernels of earlier runs, unpacked into $HOME),
#      TEST_PINS (what genengine and its GPU tests import that the image lacks; "" to carry none),
#      WITH_RAY=1 (also carry Ray 2.60.0 and its missing requirements, for genengine.ray's GPU test),
#      WITH_TRL=1 (also carry TRL 1.16.0 and its missing requirements, for verify.sh's trl part),
#      PINS_ONLY=1 (print the pins for ENGINE and VERSION, and stop).
#
# Copy of shared/gpu/prepare.sh, adapted for this repo: carries genengine's test pins, several JIT
# caches, and only the kit files present in this folder (install.sh, smoke.py).
set -euo pipefail
die() { echo "prepare.sh: ERROR: $*" >&2; exit 1; }
[ $# -eq 2 ] || [ $# -eq 3 ] || die "usage: prepare.sh vllm|sglang OUTDIR [VERSION]"
ENGINE=$1; OUTDIR=$2; VERSION=${3:-}
KIT=$(cd "$(dirname "$0")" && pwd)
[ "${PINS_ONLY:-0}" = 1 ] || for t in python3 tar xz split sha256sum git; do command -v $t >/dev/null || die "missing tool: $t"; done

# --- pins: what the GPU image (python 3.12, torch 2.11.0+cu130, transformers 5.17.0) lacks ---
# One row per engine release, from that release's Requires-Dist (each pins torch==2.11.0): the engine, and the
# versions it pins exactly of what is carried (SGLang: sglang-kernel, flashinfer-python, sgl-deep-gemm,
# transformers, apache-tvm-ffi, xgrammar; vLLM: apache-tvm-ffi). The rest is the same for every release
# (a release's lower bounds are all met by these; checked for vLLM 0.24.0-0.26.0 and SGLang 0.5.12-0.5.17).
COMMON="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
 msgspec==0.23.0 pyzmq==27.3.0 pybase64==1.5.1 jiter==0.19.0 sniffio==1.3.1
 distro==1.9.0 partial-json-parser==0.2.1.1.post7 fastapi==0.136.3 starlette==1.10.0"
XGRAMMAR=xgrammar==0.2.1
case "$ENGINE" in
  vllm)
    VERSION=${VERSION:-0.26.0}
    case "$VERSION" in
      0.24.0|0.25.0|0.25.1) TVM=0.1.9 ;;
      0.26.0) TVM=0.1.10 ;;
      *) die "no pins for vllm $VERSION (known: 0.24.0 0.25.0 0.25.1 0.26.0)" ;;
    esac
    PINS="vllm==$VERSION openai==2.54.0 apache-tvm-ffi==$TVM cachetools==8.0.2 cbor2==6.3.0
 openai-harmony==0.0.8 llguidance==1.7.6" ;;
  sglang)
    VERSION=${VERSION:-0.5.17}
    # kernel, flashinfer, deep-gemm, transformers, tvm-ffi, xgrammar: as the release's METADATA pins them.
    case "$VERSION" in
      0.5.12|0.5.12.post1) REL="0.4.2.post2 0.6.11.post1 0.1.0 5.6.0 0.1.9 0.2.0" ;;
      0.5.13|0.5.13.post1) REL="0.4.3 0.6.12 0.1.2 5.8.1 0.1.9 0.2.1" ;;
      0.5.14) REL="0.4.4 0.6.12 0.1.3 5.8.1 0.1.9 0.2.1" ;;
      0.5.15|0.5.15.post1) REL="0.4.4 0.6.12 0.1.4 5.12.1 0.1.11 0.2.1" ;;
      0.5.16) REL="0.4.5 0.6.14 0.1.4.post1 5.12.1 0.1.11 0.2.1" ;;
      0.5.17) REL="0.4.5 0.6.15.post1 0.1.5.post1 5.12.1 0.1.11 0.2.1" ;;
      *) die "no pins for sglang $VERSION (known: 0.5.12 0.5.12.post1 0.5.13 0.5.13.post1 0.5.14 0.5.15 0.5.15.post1 0.5.16 0.5.17)" ;;
    esac
    read -r KERNEL FLASHINFER DEEPGEMM TRANSFORMERS TVM XGR <<< "$REL"
    XGRAMMAR=xgrammar==$XGR
    # SGLang registers configs that the image's transformers 5.17 already has ('qwen3_asr'), so it gets the
    # transformers its release pins (5.6.0-5.12.1 all need tokenizers<=0.23.0; 0.23.0 is not on PyPI: 0.22.2).
    PINS="sglang==$VERSION openai==2.6.1 sglang-kernel==$KERNEL flashinfer-python==$FLASHINFER
 torch-memory-saver==0.0.10 sgl-deep-gemm==$DEEPGEMM transformers==$TRANSFORMERS tokenizers==0.22.2
 apache-tvm-ffi==$TVM orjson==3.13.0 setproctitle==1.3.8 dill==0.4.1 compressed-tensors==0.20.1
 loguru==0.7.3 gguf==0.19.0 uvicorn==0.54.0 ipython==9.18.1 asttokens==3.0.2 executing==2.3.0
 ipython-pygments-lexers==1.1.1 jedi==0.20.1 matplotlib-inline==0.2.2 parso==0.8.7 pexpect==4.9.0
 prompt-toolkit==3.0.53 ptyprocess==0.7.0 pure-eval==0.2.4 stack-data==0.6.3 traitlets==5.16.1
 wcwidth==0.9.4" ;;
  *) die "ENGINE must be vllm or sglang" ;;
esac
PINS="$PINS $COMMON $XGRAMMAR"
# genengine imports pluggy; its GPU tests run under pytest (tools/gpu/run_tests.sh). Pure-Python wheels.
PINS="$PINS ${TEST_PINS-pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0}"
# WITH_RAY=1: also Ray 2.60.0 for genengine.ray (tests/gpu/test_ray_gpu.py) and what the image lacks of its
# requirements (it has click, filelock, msgpack, protobuf, PyYAML, requests: checked on the H200 image).
if [ "${WITH_RAY:-0}" = 1 ]; then
  PINS="$PINS ray==2.60.0 jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 attrs==26.1.0"
fi
# WITH_TRL=1: also TRL 1.16.0 for genengine.integrations.trl (verify.sh's trl part) and what neither the image nor
# the engine's site has of its requirements: datasets (TRL's), multiprocess and dill (datasets'; SGLang's site
# already pins dill 0.4.1). The image has the rest: accelerate 1.15.0, huggingface-hub 1.33.0, pandas, pyarrow,
# psutil, jinja2, xxhash, fsspec (datasets 5.2.0 wants pyarrow>=24, fsspec<=2026.9.0: verify.sh's trl row checks).
# All pure Python, 0.9 MiB packed. TRL 1.16 needs transformers>=4.56.2: both sites' (5.12.1, 5.17.0) pass
# tests/integrations/test_trl.py.
if [ "${WITH_TRL:-0}" = 1 ]; then
  PINS="$PINS trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19"
  case " $PINS " in *" dill=="*) ;; *) PINS="$PINS dill==0.4.1" ;; esac
fi
# WITH_VERL=1: also verl 0.9.1 for genengine.integrations.verl (examples/verl_grpo.sh, docs/verl.md) and what the
# image and the engine's site lack of what verl's trainer imports (main_ppo, ray_trainer, the FSDP engine, the agent and
# reward loops, its dataset): tensordict, torchdata, hydra-core with omegaconf 2.3 and antlr4 4.9.3 (an sdist only:
# built here into the cache as a pure-Python wheel, found through PIP_FIND_LINKS), peft, codetiming, pyvers,
# cloudpickle, cachetools, orjson, uvicorn, datasets (as WITH_TRL carries it), and TransferQueue with msgspec (verl's
# default trainer, main_ppo's TaskRunnerV1, imports transfer_queue: its "verl-core" extra; pyzmq is the engine's). Needs WITH_RAY=1 (verl runs on
# Ray). Not carried: wandb, tensorboard, ray[default]'s extras, pylatexenc, math-verify (console logger, our rule
# reward); aiohttp (verl's reward loop) is assumed in the image: check with python3 -c 'import aiohttp'. verl pins
# transformers<5.11 but imports with 5.12.1 (SGLang's site) and 5.17.0 (the image): installed without its pins.
# About 3.6 MiB of wheels (tensordict and orjson the only compiled ones).
if [ "${WITH_VERL:-0}" = 1 ]; then
  [ "${WITH_RAY:-0}" = 1 ] || die "WITH_VERL=1 needs WITH_RAY=1 (verl runs on Ray)"
  VERL_CACHE=${WHEEL_CACHE:-$HOME/.cache/gpu-kit-wheels}; mkdir -p "$VERL_CACHE"
  ls "$VERL_CACHE"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 ||
    python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w "$VERL_CACHE" || die "cannot build antlr4 4.9.3"
  export PIP_FIND_LINKS="$VERL_CACHE"
  PINS="$PINS verl==0.9.1 tensordict==0.10.0 pyvers==0.2.3 cloudpickle==3.1.3 codetiming==1.4.0 cachetools==8.0.2
 hydra-core==1.3.8 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 torchdata==0.11.0 peft==0.21.2
 transferqueue==0.1.11 msgspec==0.23.0"
  for pin in orjson==3.13.0 uvicorn==0.54.0 datasets==5.2.0 multiprocess==0.70.19 dill==0.4.1; do
    case " $PINS " in *" ${pin%%==*}=="*) ;; *) PINS="$PINS $pin" ;; esac
  done
  # verl's own vllm rollout (the verl_base comparison) runs vLLM's OpenAI server, which imports these and the image
  # lacks them (found on the H200, 2026-12-04: the first two runs stopped on watchfiles, then on the instrumentator;
  # importing every vllm.entrypoints module with this kit then missed only the multipart parser and optional gRPC).
  if [ "$ENGINE" = vllm ]; then
    PINS="$PINS watchfiles==1.1.1 model-hosting-container-standards==0.1.16 supervisor==4.3.0 jmespath==1.1.0
 prometheus-fastapi-instrumentator==7.1.0 python-multipart==0.0.20"
  fi
fi

# PINS_ONLY=1: print the wheels this kit would carry, one pin a line, and stop (nothing downloaded or written).
if [ "${PINS_ONLY:-0}" = 1 ]; then printf '%s\n' $PINS; exit 0; fi

# --- files dropped (see README.md "What is dropped and why") ---
DROP='^xgrammar/lib/libxgrammar\.a$'                                  # static lib, only for C++ linking
if [ "$ENGINE" = vllm ]; then
  DROP="$DROP|^vllm/vllm-rs$"                                         # Rust API-server frontend binary
  DROP="$DROP|^vllm/third_party/deep_gemm/_C\.cpython-31[0134]-"      # builds for other Pythons
  DROP="$DROP|^vllm/third_party/fmha_sm100/"                          # Blackwell-only sources
  [ "${KEEP_FA2:-0}" = 1 ] || DROP="$DROP|^vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$"  # FA2; sm90 uses FA3
else
  DROP="$DROP|^sgl_kernel/flash_ops\.abi3\.so$"                       # FA3 for attention_backend=fa3 only
  DROP="$DROP|^sgl_kernel/sm100/"                                     # loaded only when capability != 9.0
  DROP="$DROP|^sgl_kernel/infllm_ops"                                 # InfLLM-V2 sparse attention only
fi

# --- output location: inside a git repo, ignored ---
mkdir -p "$OUTDIR"; OUTDIR=$(cd "$OUTDIR" && pwd)
ROOT=$(git -C "$OUTDIR" rev-parse --show-toplevel 2>/dev/null) || die "$OUTDIR is not inside a git repo"
git -C "$ROOT" check-ignore -q "$OUTDIR" || die "$OUTDIR is not git-ignored (add it to .git/info/exclude)"
REL=$(python3 -c 'import os,sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' "$OUTDIR" "$ROOT")
MiB=1048576
if [ -n "${CHUNK_MB:-}" ]; then CHUNK_B=$((CHUNK_MB * MiB))
else   # a call sends at most 64 MiB: keep 1 MiB spare, minus what the repo sends anyway
  repo_b=$(cd "$ROOT" && git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1) || true
  CHUNK_B=$((63 * MiB - ${repo_b:-0}))
fi
JIT_FILES=()
if [ -n "${JIT_CACHE:-}" ]; then   # optional caches of compiled kernels, travel in the last chunk
  IFS=: read -r -a JIT_FILES <<< "$JIT_CACHE"
  for f in "${JIT_FILES[@]}"; do
    [ -f "$f" ] || die "JIT_CACHE file $f not found"
    CHUNK_B=$((CHUNK_B - $(stat -c %s "$f")))
  done
fi
[ "$CHUNK_B" -ge $((8 * MiB)) ] || die "repo too large to leave room for chunks ($CHUNK_B bytes)"

# --- download ---
CACHE=${WHEEL_CACHE:-$HOME/.cache/gpu-kit-wheels}; mkdir -p "$CACHE"
PLAT="--platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
 --platform manylinux1_x86_64"
echo "== downloading $(echo $PINS | wc -w) wheels into $CACHE"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLAT -d "$CACHE" $PINS || die "pip download failed"

# --- stage: unpack the wheels (like pip install --target), minus DROP ---
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
python3 - "$CACHE" "$WORK/site" "$DROP" $PINS <<'EOF' || die "staging failed"
import re, sys, zipfile, glob, os
cache, site, drop, pins = sys.argv[1], sys.argv[2], re.compile(sys.argv[3]), sys.argv[4:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
files = glob.glob(os.path.join(cache, "*.whl"))
kept, drops = 0, {}
for pin in pins:
    name, ver = pin.split("==")
    hits = [f for f in files if norm(os.path.basename(f).split("-")[0]) == norm(name)
            and os.path.basename(f).split("-")[1] == ver]
    if len(hits) != 1:
        sys.exit(f"expected one wheel for {pin}, found {hits}")
    with zipfile.ZipFile(hits[0]) as z:
        for info in z.infolist():
            path = info.filename
            m = re.match(r"[^/]+\.data/(purelib|platlib)/(.*)", path)
            if m: path = m.group(2)
            elif re.match(r"[^/]+\.data/", path): continue    # scripts/headers/data: not needed
            if info.is_dir(): continue
            m = drop.search(path)
            if m:
                n, b = drops.get(m.group(0), (0, 0)); drops[m.group(0)] = (n + 1, b + info.file_size)
                continue
            dst = os.path.join(site, path)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with z.open(info) as src, open(dst, "wb") as out: out.write(src.read())
            if info.external_attr >> 16 & 0o111: os.chmod(dst, 0o755)
            kept += info.file_size
for k, (n, b) in drops.items():
    print(f"   dropped {k}: {n} file(s), {b / 2**20:.1f} MiB")
print(f"   staged {kept / 2**20:.0f} MiB")
EOF

# --- pack and split ---
echo "== packing (xz -${XZ_LEVEL:-6})"
tar -C "$WORK/site" -cf - . | xz -T0 -"${XZ_LEVEL:-6}" > "$WORK/payload.tar.xz"
rm -rf "${OUTDIR:?}/$ENGINE"; mkdir -p "$OUTDIR/$ENGINE"
(cd "$WORK" && split -b "$CHUNK_B" -d -a 2 payload.tar.xz part.)
(cd "$WORK" && sha256sum part.* > SHA256SUMS)
N=$(ls "$WORK"/part.* | wc -l)
i=0
for p in "$WORK"/part.*; do
  d="$OUTDIR/$ENGINE/c$(printf %02d $i)"; mkdir -p "$d"
  mv "$p" "$d/"; cp "$WORK/SHA256SUMS" "$KIT/install.sh" "$d/"
  for f in smoke.py tp2_smoke.py anchor_bench.py; do [ ! -f "$KIT/$f" ] || cp "$KIT/$f" "$d/"; done
  printf 'ENGINE=%s\nENGINE_VERSION=%s\n' "$ENGINE" "$VERSION" > "$d/MANIFEST.env"; i=$((i + 1))
done
j=0
for f in "${JIT_FILES[@]}"; do cp "$f" "$d/jit-cache-$j.tar.xz"; j=$((j + 1)); done
echo "== $ENGINE $VERSION: $(du -m "$WORK/payload.tar.xz" | cut -f1) MiB in $N chunk(s) of <= $((CHUNK_B / MiB)) MiB under $OUTDIR/$ENGINE"
echo
echo "Make these GPU-runner calls back to back (the machine stays warm only briefly between calls):"
for ((i = 0; i < N; i++)); do
  c="$REL/$ENGINE/c$(printf %02d $i)"
  if [ $i -lt $((N - 1)) ]; then
    echo "  call $((i + 1)): carry [\"$c\"]  command: bash $c/install.sh"
  else
    echo "  call $((i + 1)): carry [\"$c\"]  command: bash $c/install.sh --final && PYTHONPATH=/tmp/site-$ENGINE\${PYTHONPATH:+:\$PYTHONPATH} python3 $c/smoke.py --engine $ENGINE"
  fi
done
echo
echo "Then, in the last call (or any later one on the same warm machine), run genengine's GPU tests with"
echo "  bash tools/gpu/run_tests.sh $ENGINE [tests/gpu/...]   |   --tp2   |   --bench"
echo "To keep the kernels compiled on the GPU machine for later runs, set SAVE_JIT=1 for run_tests.sh (or end"
echo "the last command with ; tar -C ~ --ignore-failed-read -cJf \$OUT/jit-cache.tar.xz .cache/tvm-ffi .triton/cache .cache/flashinfer .cache/vllm)"
echo "and rerun prepare.sh with JIT_CACHE=<that file>."
