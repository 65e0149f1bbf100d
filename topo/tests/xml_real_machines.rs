//! Every real machine in `tests/data/topologies/` loads with the GPUs, NICs, NUMA nodes and PCI
//! placement it holds.
//!
//! The expected values come from a deliberately simple, independent scan of the XML text (the
//! files are written by hwloc one element per line): it counts `<object type="...">` lines, reads
//! `pci_type`/`pci_busid` with string searches, attributes each OS device to the PCI device line
//! just above it, and each PCI device to the NUMA node line last seen before it (hwloc writes a
//! package's memory children before its I/O children). Where the file's own description (its
//! README) states a number, that number is asserted too.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use collsched_topo::{load_hwloc_xml_file, LinkClass, PciAddress, Topology};

fn data(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/topologies").join(file)
}

fn attr<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let key = format!(" {name}=\"");
    let start = line.find(&key)? + key.len();
    let len = line[start..].find('"')?;
    Some(&line[start..start + len])
}

/// What the text scan finds.
#[derive(Debug, Default)]
struct Scan {
    packages: usize,
    cores: usize,
    pus: usize,
    numa: usize,
    /// GPU bus id -> NUMA node os_index last seen before it.
    gpus: BTreeMap<String, u32>,
    nvswitches: usize,
    /// NIC bus id -> (NUMA node, has an OpenFabrics device).
    nics: BTreeMap<String, (u32, bool)>,
}

fn scan(file: &str) -> Scan {
    let text = std::fs::read_to_string(data(file)).expect("test data file is present");
    let v3 = text.contains("<topology version=\"3.");
    let (net_bits, of_bits) = if v3 { (16u32, 32u32) } else { (0, 0) };
    let mut s = Scan::default();
    let mut numa_now = 0u32;
    let mut pci_above: Option<String> = None;
    for line in text.lines() {
        let line = line.trim_start();
        if !line.starts_with("<object ") {
            continue;
        }
        match attr(line, "type").unwrap_or("") {
            "Package" => s.packages += 1,
            "Core" => s.cores += 1,
            "PU" => s.pus += 1,
            "NUMANode" => {
                s.numa += 1;
                numa_now = attr(line, "os_index").unwrap().parse().unwrap();
            }
            "PCIDev" => {
                let busid = attr(line, "pci_busid").unwrap().to_owned();
                let ty = attr(line, "pci_type").unwrap();
                let class = &ty[0..4];
                let vendor = &ty[6..10];
                if attr(line, "subtype") == Some("NVSwitch") || (vendor == "10de" && class == "0680") {
                    s.nvswitches += 1;
                } else if vendor == "10de" && class.starts_with("03") {
                    s.gpus.insert(busid.clone(), numa_now);
                }
                pci_above = Some(busid);
            }
            "OSDev" => {
                let t: u32 = attr(line, "osdev_type").unwrap().parse().unwrap();
                let (net, of) = if v3 { (t & net_bits != 0, t & of_bits != 0) } else { (t == 2, t == 3) };
                if net || of {
                    let bus = pci_above.clone().expect("these files' NICs are PCI devices");
                    let e = s.nics.entry(bus).or_insert((numa_now, false));
                    e.1 |= of;
                }
            }
            "Bridge" => pci_above = None,
            _ => {}
        }
    }
    s
}

fn check_against_scan(file: &str) -> (Topology, Scan) {
    let t = load_hwloc_xml_file(data(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
    let s = scan(file);
    let m = &t.machine;
    assert_eq!(m.packages as usize, s.packages, "{file}: packages");
    assert_eq!(m.cores as usize, s.cores, "{file}: cores");
    assert_eq!(m.pus as usize, s.pus, "{file}: PUs");
    assert_eq!(m.numa_nodes.len(), s.numa, "{file}: NUMA nodes");
    assert_eq!(m.nvswitches as usize, s.nvswitches, "{file}: NVSwitches");
    let gpus: BTreeMap<String, u32> = m
        .gpus
        .iter()
        .map(|g| (g.pci.expect("GPU has a PCI address").to_string(), g.numa.expect("GPU has a NUMA node")))
        .collect();
    assert_eq!(gpus, s.gpus, "{file}: GPUs (bus id -> NUMA node)");
    for g in &m.gpus {
        assert_eq!(g.vendor_id, 0x10de, "{file}: GPU vendor");
    }
    let nics: BTreeMap<String, u32> = m
        .nics
        .iter()
        .map(|n| (n.pci.expect("NIC has a PCI address").to_string(), n.numa.expect("NIC has a NUMA node")))
        .collect();
    let expected_nics: BTreeMap<String, u32> =
        s.nics.iter().map(|(b, (numa, _))| (b.clone(), *numa)).collect();
    assert_eq!(nics, expected_nics, "{file}: NICs (bus id -> NUMA node)");
    for n in &m.nics {
        let of = s.nics[&n.pci.unwrap().to_string()].1;
        assert_eq!(
            matches!(n.class, LinkClass::InfiniBand | LinkClass::Roce),
            of,
            "{file}: NIC {:?} RDMA class",
            n.names
        );
    }
    // Every NUMA node the file names is listed once.
    let ids: BTreeSet<u32> = m.numa_nodes.iter().map(|n| n.os_index).collect();
    assert_eq!(ids.len(), m.numa_nodes.len(), "{file}: distinct NUMA os indexes");
    // And the whole thing survives JSON.
    assert_eq!(Topology::from_json(&t.to_json()).expect("round trip"), t, "{file}: JSON round trip");
    (t, s)
}

#[test]
fn dgx2_has_16_v100_and_12_nvswitches_split_over_two_sockets() {
    let (t, _) = check_against_scan("nvidiaDGX2.xml");
    // Stated by the file's description.
    assert_eq!(t.machine.gpus.len(), 16);
    assert_eq!(t.machine.nvswitches, 12);
    assert_eq!(t.machine.packages, 2);
    let per_numa = |n| t.machine.gpus.iter().filter(|g| g.numa == Some(n)).count();
    assert_eq!((per_numa(0), per_numa(1)), (8, 8));
    assert!(t
        .machine
        .gpus
        .iter()
        .all(|g| g.device_id == 0x1db8 && g.os_devices.iter().any(|d| d.starts_with("nvml"))));
    assert_eq!(t.intra_node.class, LinkClass::NvLink, "NVSwitches mean NVLink");
    assert!(t.source.contains("DGX-2H"), "{}", t.source);
}

#[test]
fn power8_p100_gpus_with_cuda_devices() {
    let (t, s) = check_against_scan("power8gpudistances.xml");
    assert!(!s.gpus.is_empty());
    assert!(t
        .machine
        .gpus
        .iter()
        .all(|g| g.device_id == 0x15f9 && g.os_devices.iter().any(|d| d.starts_with("cuda"))));
    assert_eq!(t.intra_node.class, LinkClass::NvLink, "the NVLinkBandwidth matrix means NVLink");
    // PCI domains above 0 (0002, 0003, 000a, 000b) survive.
    assert!(t.machine.gpus.iter().any(|g| g.pci.is_some_and(|p: PciAddress| p.domain == 0xa)));
}

#[test]
fn two_socket_server_with_gpu_and_infiniband_port() {
    let (t, _) = check_against_scan("32em64t-2n8c2t-pci-normalio.xml");
    // Stated: 2 sockets x 8 cores x 2 threads, a CUDA GPU, an InfiniBand port ib0, Ethernet.
    assert_eq!((t.machine.packages, t.machine.cores, t.machine.pus), (2, 16, 32));
    assert!(t.machine.gpus.iter().any(|g| g.os_devices.iter().any(|d| d == "cuda0")));
    let ib: Vec<_> = t.machine.nics.iter().filter(|n| n.class == LinkClass::InfiniBand).collect();
    assert_eq!(ib.len(), 1);
    assert!(ib[0].names.iter().any(|n| n == "ib0"));
    assert!(t.machine.nics.iter().any(|n| n.class == LinkClass::Ethernet));
    assert_eq!(t.inter_node.class, LinkClass::InfiniBand, "the best network present");
    assert_eq!(t.intra_node.class, LinkClass::Pcie, "GPUs without NVSwitch or NVLink matrix");
}

#[test]
fn machine_with_24_numa_nodes() {
    let (t, _) = check_against_scan("192em64t-24n8c2t.xml");
    assert_eq!(t.machine.numa_nodes.len(), 24, "stated by the file's description");
    assert!(t.machine.gpus.is_empty());
    assert_eq!(t.ranks_per_node(), 24, "a CPU machine has one rank per NUMA node");
    assert_eq!(t.intra_node.class, LinkClass::SharedMemory);
    assert!(t.machine.numa_nodes.iter().all(|n| n.memory_bytes > 0));
}
