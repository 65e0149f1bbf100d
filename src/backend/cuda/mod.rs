//! The CUDA backend: NCCL on dedicated streams (feature `cuda`).
