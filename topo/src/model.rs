//! The topology data model: one machine type, how many of them, and the two link levels
//! (inside a node, between nodes) that collectives cross.
//!
//! Units, everywhere in this crate: bandwidth in **GB/s = 10^9 bytes per second**, latency in
//! **microseconds**, memory in **bytes**, times returned by the cost model in **seconds**.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::TopoError;

/// The `format` tag of the project's JSON.
pub const JSON_FORMAT: &str = "collsched-topology";
/// The JSON version this library writes and reads.
pub const JSON_VERSION: u32 = 1;

/// The PCI vendor id of NVIDIA: GPUs are PCI display/3D controllers of this vendor.
pub const PCI_VENDOR_NVIDIA: u16 = 0x10de;
/// The PCI vendor id of Amazon (EFA network adapters).
pub const PCI_VENDOR_AMAZON: u16 = 0x1d0f;

/// A class of link a collective's bytes cross.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkClass {
    /// NVLink, directly or through NVSwitch.
    NvLink,
    /// PCI Express (through switches and, across sockets, the CPU interconnect).
    Pcie,
    /// Host shared memory between processes or threads (CPU ranks).
    SharedMemory,
    /// InfiniBand (RDMA).
    InfiniBand,
    /// RDMA over Converged Ethernet.
    Roce,
    /// AWS Elastic Fabric Adapter (SRD over AWS's network).
    Efa,
    /// Plain Ethernet through the kernel's TCP/IP stack.
    Ethernet,
}

impl LinkClass {
    /// The class of a network adapter from what hwloc shows of it (XML or live discovery): its
    /// PCI device's class id and vendor, and its OS devices as `(name, is_openfabrics)`. An
    /// Amazon adapter is EFA; PCI class 0x0207 or an OpenFabrics device without an Ethernet
    /// name (or beside an `ib*` one) is InfiniBand; an OpenFabrics device beside Ethernet names
    /// is RoCE; anything else is Ethernet.
    pub(crate) fn of_nic(class_id: u16, vendor: u16, devs: &[(String, bool)]) -> LinkClass {
        let has_of = devs.iter().any(|(_, of)| *of);
        let mut netdevs = devs.iter().filter(|(_, of)| !*of).map(|(n, _)| n.as_str()).peekable();
        let no_netdev = netdevs.peek().is_none();
        if vendor == PCI_VENDOR_AMAZON {
            LinkClass::Efa
        } else if class_id == 0x0207 || (has_of && (no_netdev || netdevs.any(|n| n.starts_with("ib")))) {
            LinkClass::InfiniBand
        } else if has_of {
            LinkClass::Roce
        } else {
            LinkClass::Ethernet
        }
    }
}

impl LinkClass {
    /// Every class, in declaration order.
    pub const ALL: [LinkClass; 7] = [
        LinkClass::NvLink,
        LinkClass::Pcie,
        LinkClass::SharedMemory,
        LinkClass::InfiniBand,
        LinkClass::Roce,
        LinkClass::Efa,
        LinkClass::Ethernet,
    ];

    /// The name used in JSON and on the command line (`nv_link`, `pcie`, ...).
    pub fn name(self) -> &'static str {
        match self {
            LinkClass::NvLink => "nv_link",
            LinkClass::Pcie => "pcie",
            LinkClass::SharedMemory => "shared_memory",
            LinkClass::InfiniBand => "infini_band",
            LinkClass::Roce => "roce",
            LinkClass::Efa => "efa",
            LinkClass::Ethernet => "ethernet",
        }
    }

    /// Whether this class connects nodes (a network) rather than devices inside one node.
    pub fn is_network(self) -> bool {
        matches!(self, LinkClass::InfiniBand | LinkClass::Roce | LinkClass::Efa | LinkClass::Ethernet)
    }

    /// A typical link of this class, used when a machine is loaded from hwloc (XML, synthetic,
    /// discovery), which does not say how fast its links are.
    ///
    /// For intra-node classes the bandwidth is the per-rank bus bandwidth a ring reaches; for
    /// network classes it is the bandwidth **of one adapter**. See [`crate::constants`] for each
    /// number and its source.
    pub fn typical_link(self) -> Link {
        use crate::constants as c;
        let (bandwidth_gbs, latency_us) = match self {
            LinkClass::NvLink => (c::NVLINK_A100_BUSBW_GBS, c::NVLINK_LATENCY_US),
            LinkClass::Pcie => (c::PCIE_GEN4_8GPU_BUSBW_GBS, c::PCIE_LATENCY_US),
            LinkClass::SharedMemory => (c::SHARED_MEMORY_BW_GBS, c::SHARED_MEMORY_LATENCY_US),
            LinkClass::InfiniBand => (c::IB_HDR_NIC_GBS, c::IB_LATENCY_US),
            LinkClass::Roce => (c::ROCE_100G_NIC_GBS, c::ROCE_LATENCY_US),
            LinkClass::Efa => (c::EFA_100G_NIC_GBS, c::EFA_LATENCY_US),
            LinkClass::Ethernet => (c::ETHERNET_25G_NIC_GBS, c::ETHERNET_LATENCY_US),
        };
        Link { class: self, bandwidth_gbs, latency_us }
    }
}

impl fmt::Display for LinkClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One level of links with its speed.
///
/// `bandwidth_gbs` is a **bus bandwidth** in the nccl-tests sense (GB/s = 10^9 B/s): for the
/// intra-node level, what one rank's ring link carries; for the inter-node level, what all network
/// adapters of one node carry together. `latency_us` is the latency of one algorithm step (one
/// hop of a ring or tree) over this level.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// The class of link.
    pub class: LinkClass,
    /// Bus bandwidth in GB/s (10^9 bytes per second); finite and > 0.
    pub bandwidth_gbs: f64,
    /// Latency of one step in microseconds; finite and >= 0.
    pub latency_us: f64,
}

impl Link {
    /// Bandwidth in bytes per second.
    pub fn bytes_per_second(&self) -> f64 {
        self.bandwidth_gbs * 1e9
    }

    /// Latency in seconds.
    pub fn latency_seconds(&self) -> f64 {
        self.latency_us * 1e-6
    }

    fn check(&self, topology: &str, field: &str) -> Result<(), TopoError> {
        if !(self.bandwidth_gbs.is_finite() && self.bandwidth_gbs > 0.0) {
            return Err(TopoError::Invalid {
                topology: topology.to_owned(),
                field: format!("{field}.bandwidth_gbs"),
                message: format!("is {}; give a finite bandwidth > 0 in GB/s", self.bandwidth_gbs),
            });
        }
        if !(self.latency_us.is_finite() && self.latency_us >= 0.0) {
            return Err(TopoError::Invalid {
                topology: topology.to_owned(),
                field: format!("{field}.latency_us"),
                message: format!("is {}; give a finite latency >= 0 in microseconds", self.latency_us),
            });
        }
        Ok(())
    }
}

/// A PCI address `domain:bus:device.function`, written as hwloc and `lspci -D` write it
/// (`0000:34:00.0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    /// PCI domain (segment).
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device number (0..32).
    pub device: u8,
    /// Function number (0..8).
    pub function: u8,
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}:{:02x}:{:02x}.{:x}", self.domain, self.bus, self.device, self.function)
    }
}

impl FromStr for PciAddress {
    type Err = String;

    /// Parses `dddd:bb:dd.f` (hexadecimal).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("`{s}` is not a PCI address of the form 0000:34:00.0");
        let (domain, rest) = s.split_once(':').ok_or_else(bad)?;
        let (bus, rest) = rest.split_once(':').ok_or_else(bad)?;
        let (device, function) = rest.split_once('.').ok_or_else(bad)?;
        let hex = |t: &str| {
            if t.is_empty() {
                Err(bad())
            } else {
                u32::from_str_radix(t, 16).map_err(|_| bad())
            }
        };
        let domain = hex(domain)?;
        let bus = u8::try_from(hex(bus)?).map_err(|_| bad())?;
        let device = u8::try_from(hex(device)?).map_err(|_| bad())?;
        let function = u8::try_from(hex(function)?).map_err(|_| bad())?;
        if device >= 32 || function >= 8 {
            return Err(bad());
        }
        Ok(PciAddress { domain, bus, device, function })
    }
}

impl Serialize for PciAddress {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PciAddress {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A NUMA node (memory domain) of a machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaNode {
    /// The OS index (`/sys/devices/system/node/nodeN`).
    pub os_index: u32,
    /// Local memory in bytes (0 when unknown).
    #[serde(default)]
    pub memory_bytes: u64,
    /// OS index of the package (socket) it belongs to, when it belongs to one.
    #[serde(default)]
    pub package: Option<u32>,
}

/// A GPU: a PCI device of a GPU vendor whose class is a display or 3D controller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    /// Where it sits on PCI, when known.
    #[serde(default)]
    pub pci: Option<PciAddress>,
    /// PCI vendor id (0x10de for NVIDIA).
    pub vendor_id: u16,
    /// PCI device id (0x2330 for H100 SXM5 80GB, ...).
    pub device_id: u16,
    /// OS index of the NUMA node it is attached to, when known.
    #[serde(default)]
    pub numa: Option<u32>,
    /// A model name, when the source gives one.
    #[serde(default)]
    pub model: Option<String>,
    /// Names of the OS devices hwloc attached to it (`cuda0`, `nvml0`, `card0`, ...).
    #[serde(default)]
    pub os_devices: Vec<String>,
}

/// A network adapter: one PCI device (or one OS device without PCI parent) that carries
/// network or OpenFabrics (RDMA) OS devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Nic {
    /// Where it sits on PCI, when known.
    #[serde(default)]
    pub pci: Option<PciAddress>,
    /// The kind of network it is (a network [`LinkClass`]).
    pub class: LinkClass,
    /// OS device names (`ib0`, `mlx5_0`, `eth0`, ...).
    #[serde(default)]
    pub names: Vec<String>,
    /// OS index of the NUMA node it is attached to, when known.
    #[serde(default)]
    pub numa: Option<u32>,
}

/// One machine (node) type: what hwloc would show of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    /// CPU packages (sockets).
    pub packages: u32,
    /// CPU cores.
    pub cores: u32,
    /// Hardware threads (processing units).
    pub pus: u32,
    /// NUMA nodes, in OS-index order.
    pub numa_nodes: Vec<NumaNode>,
    /// GPUs, in PCI order.
    #[serde(default)]
    pub gpus: Vec<Gpu>,
    /// Network adapters, in PCI order.
    #[serde(default)]
    pub nics: Vec<Nic>,
    /// NVSwitch chips seen as PCI devices (0 when none or not visible).
    #[serde(default)]
    pub nvswitches: u32,
}

impl Machine {
    /// Ranks on one node: one per GPU; on a machine without GPUs, one per NUMA node (at least 1).
    pub fn ranks(&self) -> usize {
        if self.gpus.is_empty() {
            self.numa_nodes.len().max(1)
        } else {
            self.gpus.len()
        }
    }
}

/// A cluster of identical nodes and the links collectives cross: what the library prices and
/// simulates.
///
/// Rank `r` lives on node `r / ranks_per_node()` with local index `r % ranks_per_node()`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    /// A short name (`dgx-h100`, a file stem, `synthetic`).
    pub name: String,
    /// Where the description comes from (a fixture's published sources, a file path, `hwloc`).
    #[serde(default)]
    pub source: String,
    /// How many identical nodes (>= 1).
    pub nodes: u32,
    /// One node.
    pub machine: Machine,
    /// The links between ranks of one node (per-rank bus bandwidth).
    pub intra_node: Link,
    /// The network between nodes (bandwidth of all adapters of one node together).
    pub inter_node: Link,
}

/// The on-disk JSON: the topology plus a format tag and version.
#[derive(Serialize, Deserialize)]
struct JsonFile {
    format: String,
    version: u32,
    #[serde(flatten)]
    topology: Topology,
}

/// Where rank `r` lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankLocation {
    /// The node (0-based).
    pub node: usize,
    /// The rank's index inside its node (its GPU, or NUMA node on a CPU machine).
    pub local: usize,
}

impl Topology {
    /// Ranks on one node ([`Machine::ranks`]).
    pub fn ranks_per_node(&self) -> usize {
        self.machine.ranks()
    }

    /// All ranks: `nodes * ranks_per_node()`.
    pub fn world_size(&self) -> usize {
        self.nodes as usize * self.ranks_per_node()
    }

    /// The same machine, `nodes` times.
    ///
    /// # Errors
    /// [`TopoError::Invalid`] when `nodes` is 0.
    pub fn with_nodes(mut self, nodes: u32) -> Result<Self, TopoError> {
        self.nodes = nodes;
        self.validate()?;
        Ok(self)
    }

    /// The world's shape (nodes x ranks per node), for rank groups and the cost model.
    pub fn world(&self) -> crate::WorldShape {
        crate::WorldShape { nodes: self.nodes as usize, ranks_per_node: self.ranks_per_node() }
    }

    /// Where `rank` lives, or `None` past the world.
    pub fn locate(&self, rank: usize) -> Option<RankLocation> {
        (rank < self.world_size())
            .then(|| RankLocation { node: rank / self.ranks_per_node(), local: rank % self.ranks_per_node() })
    }

    /// Checks every value the library relies on.
    ///
    /// # Errors
    /// [`TopoError::Invalid`] naming the field: zero nodes, a bandwidth that is not finite and
    /// positive, a negative latency, an intra-node level of a network class or an inter-node
    /// level of a non-network class, a NIC whose class is not a network, or a machine without
    /// processing units.
    pub fn validate(&self) -> Result<(), TopoError> {
        let invalid = |field: &str, message: String| TopoError::Invalid {
            topology: self.name.clone(),
            field: field.to_owned(),
            message,
        };
        if self.nodes == 0 {
            return Err(invalid("nodes", "is 0; a topology has at least one node".into()));
        }
        if self.machine.pus == 0 {
            return Err(invalid("machine.pus", "is 0; a machine has at least one processing unit".into()));
        }
        self.intra_node.check(&self.name, "intra_node")?;
        self.inter_node.check(&self.name, "inter_node")?;
        if self.intra_node.class.is_network() {
            return Err(invalid(
                "intra_node.class",
                format!(
                    "is the network class `{}`; use nv_link, pcie or shared_memory",
                    self.intra_node.class
                ),
            ));
        }
        if !self.inter_node.class.is_network() {
            return Err(invalid(
                "inter_node.class",
                format!(
                    "is `{}`, not a network; use infini_band, roce, efa or ethernet",
                    self.inter_node.class
                ),
            ));
        }
        for (i, nic) in self.machine.nics.iter().enumerate() {
            if !nic.class.is_network() {
                return Err(invalid(
                    &format!("machine.nics[{i}].class"),
                    format!("is `{}`, not a network class", nic.class),
                ));
            }
        }
        Ok(())
    }

    /// Writes the project's JSON (pretty-printed, with `format` and `version` keys).
    pub fn to_json(&self) -> String {
        let file = JsonFile { format: JSON_FORMAT.to_owned(), version: JSON_VERSION, topology: self.clone() };
        // Serializing plain data with string keys cannot fail.
        serde_json::to_string_pretty(&file).unwrap_or_default()
    }

    /// Reads the project's JSON, as [`Topology::to_json`] writes it, and validates it.
    ///
    /// # Errors
    /// [`TopoError::Json`] for malformed JSON, a missing field or a wrong `format`/`version`
    /// (with line and column); [`TopoError::Invalid`] for values [`Topology::validate`] rejects.
    pub fn from_json(text: &str) -> Result<Self, TopoError> {
        Self::from_json_named(text, "<string>")
    }

    pub(crate) fn from_json_named(text: &str, origin: &str) -> Result<Self, TopoError> {
        let json_err = |message: String| TopoError::Json { origin: origin.to_owned(), message };
        let file: JsonFile = serde_json::from_str(text).map_err(|e| json_err(e.to_string()))?;
        if file.format != JSON_FORMAT {
            return Err(json_err(format!("`format` is `{}`, expected `{JSON_FORMAT}`", file.format)));
        }
        if file.version != JSON_VERSION {
            return Err(json_err(format!(
                "`version` is {}, this library reads version {JSON_VERSION}",
                file.version
            )));
        }
        file.topology.validate()?;
        Ok(file.topology)
    }

    /// Reads a JSON file ([`Topology::from_json`]).
    ///
    /// # Errors
    /// [`TopoError::Io`] when the file cannot be read; otherwise as [`Topology::from_json`].
    pub fn load_json_file(path: impl AsRef<Path>) -> Result<Self, TopoError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| match source.kind() {
            std::io::ErrorKind::InvalidData => TopoError::NotText { path: path.to_owned() },
            _ => TopoError::Io { path: path.to_owned(), source },
        })?;
        Self::from_json_named(&text, &path.display().to_string())
    }

    /// Writes [`Topology::to_json`] to a file.
    ///
    /// # Errors
    /// [`TopoError::Io`] when the file cannot be written.
    pub fn save_json_file(&self, path: impl AsRef<Path>) -> Result<(), TopoError> {
        let path = path.as_ref();
        std::fs::write(path, self.to_json()).map_err(|source| TopoError::Io { path: path.to_owned(), source })
    }
}

impl fmt::Display for Topology {
    /// A human summary: nodes, CPUs, NUMA nodes, GPUs with PCI ids, NICs, link levels, groups.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.machine;
        writeln!(
            f,
            "topology {} ({} node{})",
            self.name,
            self.nodes,
            if self.nodes == 1 { "" } else { "s" }
        )?;
        if !self.source.is_empty() {
            writeln!(f, "  source: {}", self.source)?;
        }
        writeln!(
            f,
            "  per node: {} packages, {} cores, {} PUs, {} NUMA nodes",
            m.packages,
            m.cores,
            m.pus,
            m.numa_nodes.len()
        )?;
        if let Some(desc) = self.to_synthetic() {
            writeln!(f, "  hwloc synthetic: {desc}")?;
        }
        for n in &m.numa_nodes {
            let pkg = n.package.map_or_else(|| "-".to_owned(), |p| p.to_string());
            writeln!(f, "    numa {}: {} MiB, package {}", n.os_index, n.memory_bytes >> 20, pkg)?;
        }
        writeln!(
            f,
            "  GPUs: {}{}",
            m.gpus.len(),
            if m.nvswitches > 0 { format!(" ({} NVSwitch)", m.nvswitches) } else { String::new() }
        )?;
        for (i, g) in m.gpus.iter().enumerate() {
            let pci = g.pci.map_or_else(|| "-".to_owned(), |p| p.to_string());
            let numa = g.numa.map_or_else(|| "-".to_owned(), |n| n.to_string());
            write!(f, "    gpu {i}: pci {pci} [{:04x}:{:04x}] numa {numa}", g.vendor_id, g.device_id)?;
            if let Some(model) = &g.model {
                write!(f, " {model}")?;
            }
            if !g.os_devices.is_empty() {
                write!(f, " ({})", g.os_devices.join(", "))?;
            }
            writeln!(f)?;
        }
        writeln!(f, "  NICs: {}", m.nics.len())?;
        for (i, n) in m.nics.iter().enumerate() {
            let pci = n.pci.map_or_else(|| "-".to_owned(), |p| p.to_string());
            let numa = n.numa.map_or_else(|| "-".to_owned(), |x| x.to_string());
            writeln!(f, "    nic {i}: {} pci {pci} numa {numa} ({})", n.class, n.names.join(", "))?;
        }
        writeln!(
            f,
            "  links: intra-node {} {} GB/s per rank, {} us/step; inter-node {} {} GB/s per node, {} us/step",
            self.intra_node.class,
            self.intra_node.bandwidth_gbs,
            self.intra_node.latency_us,
            self.inter_node.class,
            self.inter_node.bandwidth_gbs,
            self.inter_node.latency_us
        )?;
        let w = self.world();
        writeln!(f, "  ranks: {} ({} per node)", self.world_size(), self.ranks_per_node())?;
        writeln!(f, "  intra-node groups: {}", fmt_groups(&w.intra_node_groups()))?;
        write!(f, "  inter-node groups: {}", fmt_groups(&w.inter_node_groups()))
    }
}

fn fmt_groups(groups: &[Vec<usize>]) -> String {
    const SHOWN: usize = 4;
    let mut parts: Vec<String> = groups.iter().take(SHOWN).map(|g| format!("{g:?}")).collect();
    if groups.len() > SHOWN {
        parts.push(format!("... ({} groups)", groups.len()));
    }
    parts.join(" ")
}
