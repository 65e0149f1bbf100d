# Sourced by the CI scripts: where the things ci/setup.sh installs live.
# Anyone can `source ci/env.sh` to run single steps by hand.
export COLLSCHED_CI_CACHE="${COLLSCHED_CI_CACHE:-$HOME/.cache/collsched-ci}"
# The CUDA pip wheels (NVRTC, runtime headers, ptxas), installed with `pip install --target`.
export COLLSCHED_CUDA_WHEELS="${COLLSCHED_CUDA_WHEELS:-$COLLSCHED_CI_CACHE/cuda-wheels}"
export COLLSCHED_CUDA_HOME="$COLLSCHED_CUDA_WHEELS/nvidia/cuda_nvcc"
export COLLSCHED_NVRTC_LIB="$COLLSCHED_CUDA_WHEELS/nvidia/cuda_nvrtc/lib"
export COLLSCHED_CUDA_INCLUDE="$COLLSCHED_CUDA_WHEELS/nvidia/cuda_runtime/include"
export COLLSCHED_PTXAS="$COLLSCHED_CUDA_WHEELS/nvidia/cuda_nvcc/bin/ptxas"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# The Python virtual environment (torch, maturin, pytest, ruff): made by ci/python.sh, reused.
export COLLSCHED_VENV="${COLLSCHED_VENV:-$COLLSCHED_CI_CACHE/venv}"
