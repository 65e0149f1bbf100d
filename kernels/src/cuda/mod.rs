//! CUDA C twins of the CPU kernels, compiled by NVRTC (feature `cuda`).
