#!/usr/bin/env bash
# Compiles every CUDA C kernel source to PTX with NVRTC (through the kernels crate's test, which
# writes the PTX when COLLSCHED_PTX_OUT is set) and assembles each PTX with ptxas for sm_80 and
# sm_90. Needs no GPU: NVRTC, the fp16/bf16 headers and ptxas come from the pip wheels that
# ci/setup.sh installs (paths in ci/env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
out="${COLLSCHED_PTX_OUT:-${CARGO_TARGET_DIR:-target}/collsched-ptx}"
# The test runs in the kernels crate's folder: hand it an absolute path.
case "$out" in /*) ;; *) out="$(pwd)/$out" ;; esac
rm -rf "$out"
mkdir -p "$out"
export COLLSCHED_PTX_OUT="$out"
# Same features as ci/test.sh, so nothing is rebuilt. The test's own summary stays in a log (the suite's summary is ci/test.sh's); shown on failure.
log="$out/nvrtc-test.log"
if ! cargo nextest run --workspace --all-features --no-capture -E 'binary(cuda_ptx)' >"$log" 2>&1; then
  cat "$log"; echo "ci/ptx: the NVRTC compile test failed"; exit 1
fi
if grep -q "skipped: NVRTC not found" "$log"; then
  cat "$log"; echo "ci/ptx: NVRTC not found; run ci/setup.sh"; exit 1
fi
count=0
for arch in 80 90; do
  for ptx in "$out"/*.sm_"$arch".ptx; do
    [ -e "$ptx" ] || { echo "ci/ptx: no PTX for sm_$arch in $out (did the NVRTC test skip?)"; exit 1; }
    "$COLLSCHED_PTXAS" -arch="sm_$arch" -O3 "$ptx" -o "${ptx%.ptx}.cubin"
    echo "ci/ptx: ptxas -arch=sm_$arch $(basename "$ptx") ok"
    count=$((count + 1))
  done
done
echo "ci/ptx: $count PTX files assembled"
