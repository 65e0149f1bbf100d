//! Built-in machines, for tests, the simulator and `collsched topo --preset NAME`.
//!
//! | name | machine | sources |
//! |---|---|---|
//! | `dgx-h100` | NVIDIA DGX H100: 2x Xeon Platinum 8480C (56 cores), 2 TiB, 8 H100 SXM5 80GB on 4 NVSwitch chips, 8 ConnectX-7 400 Gb/s InfiniBand | NVIDIA DGX H100 user guide (hardware overview); link speeds from nccl-tests #212 and #290 ([`crate::constants`]) |
//! | `p4d` | AWS p4d.24xlarge: 2x Xeon Platinum 8275CL (24 cores), 1152 GiB, 8 A100 SXM4 40GB on 6 NVSwitch chips, 4x100 Gb/s EFA | AWS EC2 P4 instance page; link speeds from nccl #527 |
//! | `pcie-8gpu` | a generic 2-socket PCIe Gen4 server: 2x 32 cores, 512 GiB, 8 A100 PCIe 80GB (4 per socket, no NVLink), one 100 Gb/s Ethernet | illustrative; PCIe bus bandwidth derived from nccl #1639 |
//! | `cpu-2socket` | a 2-socket CPU server: 2x 16 cores x 2 threads, 256 GiB, one 25 Gb/s Ethernet, no GPU (ranks are NUMA nodes) | illustrative; shared-memory bandwidth is an estimate |
//!
//! PCI bus numbers are illustrative (laid out like the real machines: GPUs and NICs split
//! evenly over the two sockets), not copied from a real `lspci`.

use crate::constants as c;
use crate::{
    Gpu, Link, LinkClass, Machine, Nic, NumaNode, PciAddress, TopoError, Topology, PCI_VENDOR_NVIDIA,
};

/// The names of the built-in machines.
pub const PRESETS: [&str; 4] = ["dgx-h100", "p4d", "pcie-8gpu", "cpu-2socket"];

const GIB: u64 = 1 << 30;

fn pci(bus: u8) -> Option<PciAddress> {
    Some(PciAddress { domain: 0, bus, device: 0, function: 0 })
}

fn two_numa(memory_each: u64) -> Vec<NumaNode> {
    (0..2).map(|i| NumaNode { os_index: i, memory_bytes: memory_each, package: Some(i) }).collect()
}

fn gpus(device_id: u16, model: &str, buses: [u8; 8]) -> Vec<Gpu> {
    buses
        .iter()
        .enumerate()
        .map(|(i, &bus)| Gpu {
            pci: pci(bus),
            vendor_id: PCI_VENDOR_NVIDIA,
            device_id,
            numa: Some(u32::from(i >= 4)),
            model: Some(model.to_owned()),
            os_devices: vec![format!("cuda{i}")],
        })
        .collect()
}

fn nics(class: LinkClass, prefix: &str, buses: &[u8]) -> Vec<Nic> {
    let half = buses.len().div_ceil(2);
    buses
        .iter()
        .enumerate()
        .map(|(i, &bus)| Nic {
            pci: pci(bus),
            class,
            names: vec![format!("{prefix}{i}")],
            numa: Some(u32::from(i >= half)),
        })
        .collect()
}

/// A built-in machine by name (one node; use [`Topology::with_nodes`] for a cluster).
///
/// # Errors
/// [`TopoError::UnknownPreset`] listing the known names.
///
/// # Examples
/// ```
/// let t = collsched_topo::preset("dgx-h100")?.with_nodes(4)?;
/// assert_eq!(t.world_size(), 32);
/// # Ok::<(), collsched_topo::TopoError>(())
/// ```
pub fn preset(name: &str) -> Result<Topology, TopoError> {
    let t = match name {
        "dgx-h100" => Topology {
            name: name.to_owned(),
            source: "NVIDIA DGX H100 user guide; NVLink busbw 370 GB/s (nccl-tests #212), 46-48 GB/s per NDR NIC (nccl-tests #290)".to_owned(),
            nodes: 1,
            machine: Machine {
                packages: 2,
                cores: 112,
                pus: 224,
                numa_nodes: two_numa(1024 * GIB),
                gpus: gpus(0x2330, "H100 SXM5 80GB", [0x1b, 0x43, 0x52, 0x61, 0x9d, 0xc3, 0xd1, 0xdf]),
                nics: nics(LinkClass::InfiniBand, "mlx5_", &[0x1a, 0x40, 0x4f, 0x5e, 0x9c, 0xc0, 0xce, 0xdc])
                    .into_iter()
                    .map(|mut n| {
                        n.names.insert(0, format!("ib{}", n.names[0].trim_start_matches("mlx5_")));
                        n
                    })
                    .collect(),
                nvswitches: 4,
            },
            intra_node: Link { class: LinkClass::NvLink, bandwidth_gbs: c::NVLINK_H100_BUSBW_GBS, latency_us: c::NVLINK_LATENCY_US },
            inter_node: Link { class: LinkClass::InfiniBand, bandwidth_gbs: 8.0 * c::IB_NDR_NIC_GBS, latency_us: c::IB_LATENCY_US },
        },
        "p4d" => Topology {
            name: name.to_owned(),
            source: "AWS EC2 p4d.24xlarge; NVLink busbw 230.8 GB/s and 2-node busbw 57.2 GB/s (nccl #527)".to_owned(),
            nodes: 1,
            machine: Machine {
                packages: 2,
                cores: 48,
                pus: 96,
                numa_nodes: two_numa(576 * GIB),
                gpus: gpus(0x20b0, "A100 SXM4 40GB", [0x10, 0x20, 0x30, 0x40, 0x90, 0xa0, 0xb0, 0xc0]),
                nics: nics(LinkClass::Efa, "rdmap", &[0x11, 0x31, 0x91, 0xb1]),
                nvswitches: 6,
            },
            intra_node: Link { class: LinkClass::NvLink, bandwidth_gbs: c::NVLINK_A100_BUSBW_GBS, latency_us: c::NVLINK_LATENCY_US },
            inter_node: Link { class: LinkClass::Efa, bandwidth_gbs: 4.0 * c::EFA_100G_NIC_GBS, latency_us: c::EFA_LATENCY_US },
        },
        "pcie-8gpu" => Topology {
            name: name.to_owned(),
            source: "illustrative 2-socket PCIe Gen4 server; busbw derived from nccl #1639 (see constants)".to_owned(),
            nodes: 1,
            machine: Machine {
                packages: 2,
                cores: 64,
                pus: 128,
                numa_nodes: two_numa(256 * GIB),
                gpus: gpus(0x20b5, "A100 PCIe 80GB", [0x01, 0x21, 0x41, 0x61, 0x81, 0xa1, 0xc1, 0xe1]),
                nics: nics(LinkClass::Ethernet, "eth", &[0x11]),
                nvswitches: 0,
            },
            intra_node: Link { class: LinkClass::Pcie, bandwidth_gbs: c::PCIE_GEN4_8GPU_BUSBW_GBS, latency_us: c::PCIE_LATENCY_US },
            inter_node: Link { class: LinkClass::Ethernet, bandwidth_gbs: c::ETHERNET_100G_NIC_GBS, latency_us: c::ETHERNET_LATENCY_US },
        },
        "cpu-2socket" => Topology {
            name: name.to_owned(),
            source: "illustrative 2-socket CPU server; shared-memory bandwidth is an estimate (see constants)".to_owned(),
            nodes: 1,
            machine: Machine {
                packages: 2,
                cores: 32,
                pus: 64,
                numa_nodes: two_numa(128 * GIB),
                gpus: Vec::new(),
                nics: nics(LinkClass::Ethernet, "eth", &[0x03]),
                nvswitches: 0,
            },
            intra_node: LinkClass::SharedMemory.typical_link(),
            inter_node: LinkClass::Ethernet.typical_link(),
        },
        _ => {
            return Err(TopoError::UnknownPreset { name: name.to_owned(), known: PRESETS.join(", ") });
        }
    };
    Ok(t)
}
