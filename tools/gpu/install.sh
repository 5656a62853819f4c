#!/bin/bash
# install.sh [--final]   (runs on the GPU machine, from a chunk folder made by prepare.sh)
#
# Every call: verifies the part carried in this chunk folder and stashes it in
# /tmp/gpu-parts/ENGINE (which survives between calls while the machine stays warm).
# Once all parts are there: reassembles them and unpacks into /tmp/site-ENGINE.
# --final: fail unless the install is complete (use it in the call that runs the smoke test).
set -euo pipefail
die() { echo "install.sh: ERROR: $*" >&2; exit 1; }
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck disable=SC1091
source "$HERE/MANIFEST.env"                      # ENGINE=...
STORE=/tmp/gpu-parts/$ENGINE; SITE=/tmp/site-$ENGINE
mkdir -p "$STORE"
cp "$HERE/SHA256SUMS" "$STORE/SHA256SUMS.new"
if [ -f "$STORE/SHA256SUMS" ] && ! cmp -s "$STORE/SHA256SUMS" "$STORE/SHA256SUMS.new"; then
  echo "install.sh: parts from another prepare.sh run found; discarding them"
  rm -f "$STORE"/part.*
fi
mv "$STORE/SHA256SUMS.new" "$STORE/SHA256SUMS"

for p in "$HERE"/part.*; do
  [ -e "$p" ] || continue
  name=$(basename "$p")
  want=$(awk -v n="$name" '$2 == n {print $1}' "$HERE/SHA256SUMS")
  got=$(sha256sum "$p" | cut -d' ' -f1)
  [ "$want" = "$got" ] || die "$name arrived corrupt (sha256 $got, expected $want)"
  mv -f "$p" "$STORE/$name"
  echo "install.sh: stashed $ENGINE/$name ($(du -m "$STORE/$name" | cut -f1) MiB)"
done

for cache in "$HERE"/jit-cache*.tar.xz; do   # optional: kernels compiled by earlier runs (README.md)
  [ -e "$cache" ] || continue
  tar -C "$HOME" -xJf "$cache" || die "could not unpack $(basename "$cache")"
  echo "install.sh: restored JIT/Triton caches from $(basename "$cache")"
done

missing=""
for name in $(awk '{print $2}' "$STORE/SHA256SUMS"); do
  [ -e "$STORE/$name" ] || missing="$missing $name"
done
if [ -n "$missing" ]; then
  echo "install.sh: $ENGINE parts still missing:$missing"
  [ "${1:-}" = --final ] && die "cannot install $ENGINE: parts missing (did the machine go cold between calls? send those chunks again)"
  exit 0
fi
# The image sets PYTHONDONTWRITEBYTECODE=1 and ships no bytecode, neither for its own site-packages (torch, numpy,
# sympy, ...) nor does the kit's site carry any: every process would compile its imports from source. Measured on
# the H200 (2026-12-02): importing SGLang's scheduler 35 s, `import torch` 6.8 s; with the bytecode written once
# (~17 s on 16 cores, both sites) 18 s and 2.3 s. Python reads bytecode under PYTHONDONTWRITEBYTECODE, it only
# never writes it. Once per machine and site (NO_BYTECODE=1 skips it).
write_bytecode() {
  [ "${NO_BYTECODE:-0}" = 1 ] && return 0
  local dirs=() d t0 t1
  [ -f "$SITE/.bytecode" ] || dirs+=("$SITE")
  for d in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))'); do
    [ -d "$d" ] && [ -w "$d" ] && [ ! -f "/tmp/gpu-parts/.bytecode-$(echo "$d" | tr / _)" ] && dirs+=("$d")
  done
  [ ${#dirs[@]} -gt 0 ] || return 0
  t0=$(date +%s.%N)
  python3 -m compileall -q -j 0 "${dirs[@]}" > /tmp/gpu-parts/compileall.log 2>&1 \
    || echo "install.sh: compileall reported errors (modules that do not compile on this Python; see /tmp/gpu-parts/compileall.log)"
  t1=$(date +%s.%N)
  for d in "${dirs[@]}"; do
    if [ "$d" = "$SITE" ]; then touch "$SITE/.bytecode"; else touch "/tmp/gpu-parts/.bytecode-$(echo "$d" | tr / _)"; fi
  done
  echo "install.sh: bytecode written for ${dirs[*]} in $(python3 -c "print(f'{$t1 - $t0:.1f}')") s"
}

if [ -f "$SITE/.installed" ] && cmp -s "$SITE/.installed" "$STORE/SHA256SUMS"; then
  echo "install.sh: $ENGINE already installed in $SITE"; write_bytecode; exit 0
fi

t0=$(date +%s.%N)
rm -rf "$SITE.tmp"; mkdir -p "$SITE.tmp"
if command -v xz >/dev/null; then
  cat "$STORE"/part.* | xz -d -T0 | tar -x -C "$SITE.tmp" || die "unpacking failed"
else
  cat "$STORE"/part.* | python3 -c 'import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1], filter="tar")' "$SITE.tmp" || die "unpacking failed"
fi
cp "$STORE/SHA256SUMS" "$SITE.tmp/.installed"
rm -rf "$SITE"; mv "$SITE.tmp" "$SITE"
t1=$(date +%s.%N)
echo "install.sh: $ENGINE installed in $SITE ($(du -sm "$SITE" | cut -f1) MiB) in $(python3 -c "print(f'{$t1 - $t0:.1f}')") s"
write_bytecode
echo "install.sh: use it with PYTHONPATH=$SITE"
