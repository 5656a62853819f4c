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
if [ -f "$SITE/.installed" ] && cmp -s "$SITE/.installed" "$STORE/SHA256SUMS"; then
  echo "install.sh: $ENGINE already installed in $SITE"; exit 0
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
echo "install.sh: use it with PYTHONPATH=$SITE"
