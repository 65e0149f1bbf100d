#!/usr/bin/env bash
# Compiles every CUDA C kernel source to PTX with NVRTC (through the kernels crate's test, which
# writes the PTX when COLLSCHED_PTX_OUT is set) and assembles each PTX with ptxas for sm_80 and
# sm_90; twice, with CUDA 12's NVRTC and ptxas, then with CUDA 13's. Needs no GPU: NVRTC, the
# fp16/bf16 headers and ptxas come from the pip wheels that ci/setup.sh installs (paths in
# ci/env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
out="${COLLSCHED_PTX_OUT:-${CARGO_TARGET_DIR:-target}/collsched-ptx}"
# The test runs in the kernels crate's folder: hand it an absolute path.
case "$out" in /*) ;; *) out="$(pwd)/$out" ;; esac
rm -rf "$out"
mkdir -p "$out"

# nvrtc_test CUDA_MAJOR DIR NVRTC_LIB INCLUDE: runs the NVRTC compile test, writing PTX to DIR.
nvrtc_test() {
  local major="$1" dir="$2" log="$2/nvrtc-test.log"
  mkdir -p "$dir"
  # Same features as ci/test.sh, so nothing is rebuilt. The test's own summary stays in a log
  # (the suite's summary is ci/test.sh's); shown on failure.
  if ! COLLSCHED_PTX_OUT="$dir" COLLSCHED_NVRTC_LIB="$3" COLLSCHED_CUDA_INCLUDE="$4" \
    cargo nextest run --workspace --all-features --no-capture -E 'binary(cuda_ptx)' >"$log" 2>&1; then
    cat "$log"; echo "ci/ptx: the NVRTC compile test failed with CUDA $major"; exit 1
  fi
  if grep -q "skipped: NVRTC not found" "$log"; then
    cat "$log"; echo "ci/ptx: NVRTC $major not found; run ci/setup.sh"; exit 1
  fi
  # The test prints the NVRTC it loaded: make sure it is the one meant.
  if ! grep -q "^NVRTC $major\." "$log"; then
    cat "$log"; echo "ci/ptx: the test did not load NVRTC $major from $3"; exit 1
  fi
  echo "ci/ptx: $(grep -m1 "^NVRTC $major\." "$log" | cut -d, -f1)"
}

# assemble PTXAS DIR: assembles DIR's PTX for sm_80 and sm_90.
count=0
assemble() {
  local ptxas="$1" dir="$2" arch ptx
  for arch in 80 90; do
    for ptx in "$dir"/*.sm_"$arch".ptx; do
      [ -e "$ptx" ] || { echo "ci/ptx: no PTX for sm_$arch in $dir (did the NVRTC test skip?)"; exit 1; }
      "$ptxas" -arch="sm_$arch" -O3 "$ptx" -o "${ptx%.ptx}.cubin"
      echo "ci/ptx: $(basename "$(dirname "$(dirname "$ptxas")")")/ptxas -arch=sm_$arch $(basename "$ptx") ok"
      count=$((count + 1))
    done
  done
}

nvrtc_test 12 "$out" "$COLLSCHED_NVRTC_LIB" "$COLLSCHED_CUDA_INCLUDE"
assemble "$COLLSCHED_PTXAS" "$out"
nvrtc_test 13 "$out/cuda13" "$COLLSCHED_CUDA13_NVRTC_LIB" "$COLLSCHED_CUDA13_INCLUDE"
assemble "$COLLSCHED_CUDA13_PTXAS" "$out/cuda13"
echo "ci/ptx: $count PTX files assembled (CUDA 12 and CUDA 13)"
