//! Every number the fixtures and the cost model use, named, with its source.
//!
//! Bandwidths are **bus bandwidths** in the nccl-tests sense, in GB/s (10^9 B/s): the bandwidth
//! a rank's link carries, independent of the number of ranks (`busbw = algbw * (n-1)/n` for
//! all-gather and reduce-scatter, `algbw * 2(n-1)/n` for all-reduce, `algbw` for broadcast).
//! Latencies are per algorithm step (one ring or tree hop) in microseconds.
//!
//! Published measurements used (the cross-check test `published_bus_bandwidths` in
//! `tests/cost_model.rs` re-derives each one from the model):
//! - NVIDIA/nccl-tests issue #212 (S. Jeaugey, NVIDIA): H100 NVLink4 line rate 450 GB/s per
//!   direction; "NCCL can get an effective NVLink bandwidth of 370GB/s", seen as busbw of
//!   non-allreduce collectives or of all-reduce with `NCCL_ALGO=RING`, 8 GPUs.
//! - NVIDIA/nccl-tests issue #290 (D. Addison, NVIDIA): "For NDR @ 400Gbps you should see
//!   46-48GB/s per NIC".
//! - NVIDIA/nccl issue #527: p4dn.24xlarge (8 A100 on NVSwitch, 4x100 Gb/s EFA), 1 GiB float
//!   all-reduce: busbw 230.8 GB/s on one node, 57.2 GB/s on two nodes.
//! - NVIDIA/nccl-tests issue #119: 8 A100 + 4x200 Gb/s HDR per node, 3 nodes: "theoretical
//!   100GB/s", measured peak busbw about 96 GB/s (evidence that the network level carries the
//!   node's summed adapter bandwidth).
//! - NVIDIA/nccl issue #1639 (S. Jeaugey): 8 PCIe Gen5 GPUs on two sockets reach an all-reduce
//!   busbw of 28 GB/s, limited by what the CPUs and memory deliver.
//! - NCCL `src/graph/tuning` (older releases): hardware latencies per step of about 0.5-3.4 us
//!   over NVLink depending on protocol, and base latencies of several microseconds per
//!   collective; our step latencies sit in that range.

/// H100 SXM NVLink4 effective bus bandwidth, 8 GPUs on NVSwitch, ring (nccl-tests #212).
pub const NVLINK_H100_BUSBW_GBS: f64 = 370.0;
/// A100 SXM NVLink3 bus bandwidth, 8 GPUs on NVSwitch (nccl #527: 230.8 GB/s on a p4dn).
pub const NVLINK_A100_BUSBW_GBS: f64 = 230.0;
/// NVLink step latency (microseconds), within NCCL's tuning range for NVLink.
pub const NVLINK_LATENCY_US: f64 = 1.0;

/// PCIe Gen4 x16 line rate per direction: 16 GT/s x 16 lanes x 128/130 / 8 = 31.5 GB/s.
pub const PCIE_GEN4_X16_LINE_GBS: f64 = 31.5;
/// PCIe Gen5 x16 line rate per direction (63 GB/s).
pub const PCIE_GEN5_X16_LINE_GBS: f64 = 63.0;
/// Ring bus bandwidth of 8 PCIe Gen4 GPUs behind two sockets. Derived, not measured: nccl #1639
/// reports 28 GB/s for 8 PCIe Gen5 GPUs on two sockets, i.e. 28/63 = 0.44 of the Gen5 line
/// rate; the same fraction of the Gen4 line rate is 14 GB/s.
pub const PCIE_GEN4_8GPU_BUSBW_GBS: f64 = 14.0;
/// PCIe step latency (microseconds).
pub const PCIE_LATENCY_US: f64 = 2.0;

/// Per-rank bandwidth of shared-memory collectives between CPU ranks on a 2-socket server
/// (GB/s). An estimate (no nccl-tests number exists): a single core's memcpy bandwidth on a
/// current server is 10-20 GB/s and the socket interconnect is shared by all ranks.
pub const SHARED_MEMORY_BW_GBS: f64 = 10.0;
/// Shared-memory step latency (microseconds): a cache-line handoff plus a flag poll.
pub const SHARED_MEMORY_LATENCY_US: f64 = 0.5;

/// One ConnectX-7 NDR 400 Gb/s InfiniBand adapter, achieved (nccl-tests #290: 46-48 GB/s).
pub const IB_NDR_NIC_GBS: f64 = 47.0;
/// One HDR 200 Gb/s InfiniBand adapter: 25 GB/s line rate, 24 GB/s achieved (nccl-tests #119
/// measured 96 of a theoretical 100 GB/s for four of them).
pub const IB_HDR_NIC_GBS: f64 = 24.0;
/// InfiniBand step latency (microseconds).
pub const IB_LATENCY_US: f64 = 3.0;
/// One 100 Gb/s RoCE adapter, at 90% of its 12.5 GB/s line rate.
pub const ROCE_100G_NIC_GBS: f64 = 11.25;
/// RoCE step latency (microseconds).
pub const ROCE_LATENCY_US: f64 = 4.0;
/// One 100 Gb/s EFA adapter of a p4d, at 90% of its 12.5 GB/s line rate.
pub const EFA_100G_NIC_GBS: f64 = 11.25;
/// EFA step latency (microseconds): EFA's SRD adds latency over InfiniBand.
pub const EFA_LATENCY_US: f64 = 10.0;
/// One 25 Gb/s Ethernet adapter under TCP, at 90% of its 3.125 GB/s line rate.
pub const ETHERNET_25G_NIC_GBS: f64 = 2.8;
/// One 100 Gb/s Ethernet adapter under TCP, at 90% of its 12.5 GB/s line rate.
pub const ETHERNET_100G_NIC_GBS: f64 = 11.25;
/// Ethernet (TCP) step latency (microseconds).
pub const ETHERNET_LATENCY_US: f64 = 20.0;

/// Host cost of launching one collective (enqueue + kernel launch), seconds. A knob of
/// [`crate::CostModel`] (`launch_overhead_s`).
pub const DEFAULT_LAUNCH_OVERHEAD_S: f64 = 4e-6;
/// Host cost of one group call (`ncclGroupStart`/`ncclGroupEnd` pair; a collective issued
/// alone is a group of one), seconds. A knob of [`crate::CostModel`] (`group_call_overhead_s`).
pub const DEFAULT_GROUP_CALL_OVERHEAD_S: f64 = 2e-6;

// Costs of the host and the device that DeepSpeed ZeRO-3's 2021 code paid per parameter (the
// simulator's `zero3-2021` policy, `docs/notes/deepspeed-zero3-2021.md`). Each is a published
// measurement or a default of that code; none is fitted to the step times the policy is
// compared with.

/// Host time of DeepSpeed v0.5.4's `_allgather_param` before its collective (`torch.zeros` of
/// the gathered size, `torch.cuda.synchronize()`, the shard copy, the debug f-strings), seconds:
/// "The pre_launch typically takes 130us" (DeepSpeed issue #1069, zarzen, 2021-06-21; 8 A100 of
/// a p4d, DeepSpeed 0.3.16, PyTorch 1.8, all-gathers of a few hundred elements per rank).
pub const ZERO3_2021_GATHER_PRE_LAUNCH_S: f64 = 130e-6;
/// Host time of launching one list-form `torch.distributed.all_gather` from that code, seconds:
/// "the launch takes 250us about" (same source as [`ZERO3_2021_GATHER_PRE_LAUNCH_S`]). Also the
/// price of the list-form `reduce_scatter` launch of `_reduce_scatter_gradient`, the same path
/// (world `narrow` views, one list-form c10d call), for which no figure was published.
pub const ZERO3_2021_LIST_LAUNCH_S: f64 = 250e-6;
/// Parameters with fewer elements are "persistent" in ZeRO-3: gathered once, never released
/// (`stage3_param_persistence_threshold`, default 1e5 in DeepSpeed v0.5.4
/// `deepspeed/runtime/zero/constants.py` l.112).
pub const ZERO3_2021_PERSISTENCE_THRESHOLD: u64 = 100_000;
/// Gradient elements the ipg bucket holds before a flush (`reduce_bucket_size`, default 5e8 in
/// DeepSpeed v0.5.4 `constants.py` l.68); each flush runs `div_` over the whole buffer.
pub const ZERO3_2021_REDUCE_BUCKET_ELEMENTS: u64 = 500_000_000;

/// Host time of one eager PyTorch operation on a small tensor, seconds: "an overhead of ~7
/// microseconds for the simplest tensor operations" (pytorch/pytorch issue #41383, 2020, an
/// operation with `requires_grad` on a one-element CPU tensor; 5 us without). A CUDA operation
/// also launches a kernel, so this is a lower bound of its host time.
pub const PYTORCH_EAGER_OP_S: f64 = 7e-6;
/// One host-device round trip (a synchronous small copy, or a synchronize of a device with no
/// work queued), seconds: a 4-byte device-to-host `cudaMemcpy` with its
/// `cudaStreamSynchronize` took 9.67 us at least and 32 us in the median of 2000
/// (kekzl/imp issue #1654, an RTX 5090). No A100 figure was found; the minimum, rounded to 10 us,
/// is used, so a sync costs about that measurement's best case.
pub const HOST_DEVICE_SYNC_S: f64 = 10e-6;
/// A100 40GB device memory throughput of a copy, read and write bytes summed, GB/s: 1355, the
/// measured memory-copy throughput of an A100 that PTsolvers/gpu-workshop-JuliaCon23 takes as
/// its reference (issue #7, luraess, 2023-07-25: "the memcopy measured BW"; data sheet 1555). A
/// copy of `n` bytes moves `2n`, a memset or a reduction that reads `n` bytes moves `n`.
pub const A100_HBM_COPY_GBS: f64 = 1355.0;
