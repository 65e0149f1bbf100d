#!/usr/bin/env bash
# Installs what a fresh machine lacks: Debian packages for hwloc and Open MPI, the CUDA pip wheels for the
# NVRTC/ptxas checks. Idempotent; quick when everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh

need_apt=()
# openmpi-bin: mpirun launches the shm backend tests as Open MPI would.
for pkg in libhwloc-dev libudev-dev pkg-config openmpi-bin; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "ci/setup: apt-get install ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x "$COLLSCHED_PTXAS" ] || [ ! -d "$COLLSCHED_NVRTC_LIB" ] || [ ! -d "$COLLSCHED_CUDA_INCLUDE" ]; then
  echo "ci/setup: pip install --target $COLLSCHED_CUDA_WHEELS (NVRTC, CUDA runtime headers, ptxas)"
  mkdir -p "$COLLSCHED_CUDA_WHEELS"
  python3 -m pip install -q --disable-pip-version-check --no-deps --upgrade --target "$COLLSCHED_CUDA_WHEELS" \
    'nvidia-cuda-nvrtc-cu12==12.9.*' 'nvidia-cuda-runtime-cu12==12.9.*' 'nvidia-cuda-nvcc-cu12==12.9.*'
  chmod +x "$COLLSCHED_PTXAS" || true
fi
echo "ci/setup: ok"
