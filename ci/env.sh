# Sourced by the CI scripts: where the things ci/setup.sh installs live.
# Anyone can `source ci/env.sh` to run single steps by hand.
export COLLSCHED_CI_CACHE="${COLLSCHED_CI_CACHE:-$HOME/.cache/collsched-ci}"
# The CUDA pip wheels (NVRTC, runtime headers, ptxas), installed with `pip install --target`.
export COLLSCHED_CUDA_WHEELS="${COLLSCHED_CUDA_WHEELS:-$COLLSCHED_CI_CACHE/cuda-wheels}"
export COLLSCHED_CUDA_HOME="$COLLSCHED_CUDA_WHEELS/nvidia/cuda_nvcc"
export COLLSCHED_NVRTC_LIB="$COLLSCHED_CUDA_WHEELS/nvidia/cuda_nvrtc/lib"
export COLLSCHED_CUDA_INCLUDE="$COLLSCHED_CUDA_WHEELS/nvidia/cuda_runtime/include"
export COLLSCHED_PTXAS="$COLLSCHED_CUDA_WHEELS/nvidia/cuda_nvcc/bin/ptxas"
# CUDA 13's NVRTC, headers (with CCCL) and ptxas, for ci/ptx.sh's second run; CUDA 13 wheels
# put everything under nvidia/cu13. Not exported as the knobs: the CUDA 12 ones above stay the
# default of every other step.
export COLLSCHED_CUDA13_WHEELS="${COLLSCHED_CUDA13_WHEELS:-$COLLSCHED_CI_CACHE/cuda13-wheels}"
export COLLSCHED_CUDA13_NVRTC_LIB="$COLLSCHED_CUDA13_WHEELS/nvidia/cu13/lib"
export COLLSCHED_CUDA13_INCLUDE="$COLLSCHED_CUDA13_WHEELS/nvidia/cu13/include"
export COLLSCHED_CUDA13_PTXAS="$COLLSCHED_CUDA13_WHEELS/nvidia/cu13/bin/ptxas"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# The Python virtual environment (torch, maturin, pytest, ruff): made by ci/python.sh, reused.
export COLLSCHED_VENV="${COLLSCHED_VENV:-$COLLSCHED_CI_CACHE/venv}"
