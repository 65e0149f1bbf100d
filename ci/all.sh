#!/usr/bin/env bash
# Everything CI checks, in order; what `.ci/run` calls. Each step is a script of its own.
# Benches are type-checked by clippy --all-targets, not built in release (that would double CI).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
step() { echo "== ci: $1 ($(( $(date +%s) - start ))s)"; bash "ci/$1.sh"; }
step setup
step fmt
step clippy
step test
for extra in doc ptx fuzz; do
  [ -f "ci/$extra.sh" ] && step "$extra"
done
echo "== ci: all green in $(( $(date +%s) - start ))s"
