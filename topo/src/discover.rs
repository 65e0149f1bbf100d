//! Discovery of the live machine through hwloc (`hwlocality`), feature `hwloc`.
//!
//! The only module of this crate that talks to hwloc. It keeps the I/O objects hwloc deems
//! important (GPUs, NICs, storage) and maps them with the same rules as the XML loader
//! ([`crate::xml`](crate::from_hwloc_xml)): GPUs are NVIDIA display/3D PCI devices, NICs are
//! network/OpenFabrics OS devices grouped by PCI device, NUMA placement is the single NUMA node
//! of a device's first non-I/O ancestor.

use std::collections::BTreeMap;

use hwlocality::object::attributes::ObjectAttributes;
use hwlocality::object::types::{OSDeviceType, ObjectType};
use hwlocality::object::TopologyObject;
use hwlocality::topology::builder::TypeFilter;

use crate::{Gpu, LinkClass, Machine, Nic, NumaNode, PciAddress, TopoError, Topology, PCI_VENDOR_NVIDIA};

/// Discovers this machine with hwloc: one node, links as [`crate::from_hwloc_xml`] chooses them.
///
/// # Errors
/// [`TopoError::Discovery`] naming the hwloc call that failed.
pub fn discover() -> Result<Topology, TopoError> {
    let topo = hwlocality::Topology::builder()
        .with_io_type_filter(TypeFilter::KeepImportant)
        .map_err(|e| TopoError::Discovery {
            api: "hwloc_topology_set_io_types_filter",
            message: e.to_string(),
        })?
        .build()
        .map_err(|e| TopoError::Discovery { api: "hwloc_topology_load", message: e.to_string() })?;

    let count = |ty| u32::try_from(topo.objects_with_type(ty).len()).unwrap_or(u32::MAX);
    let mut numa_nodes: Vec<NumaNode> = topo
        .objects_with_type(ObjectType::NUMANode)
        .map(|n| NumaNode {
            os_index: n.os_index().and_then(|i| u32::try_from(i).ok()).unwrap_or(0),
            memory_bytes: match n.attributes() {
                Some(ObjectAttributes::NUMANode(a)) => a.local_memory().map_or(0, |m| m.get()),
                _ => 0,
            },
            package: n
                .ancestors()
                .find(|a| a.object_type() == ObjectType::Package)
                .and_then(|p| p.os_index())
                .and_then(|i| u32::try_from(i).ok()),
        })
        .collect();
    numa_nodes.sort_by_key(|n| n.os_index);

    let mut gpus = Vec::new();
    let mut nvswitches = 0;
    for dev in topo.objects_with_type(ObjectType::PCIDevice) {
        let Some(ObjectAttributes::PCIDevice(pci)) = dev.attributes() else { continue };
        let nvswitch = dev.subtype().is_some_and(|s| s.to_bytes() == b"NVSwitch");
        if nvswitch || (pci.vendor_id() == PCI_VENDOR_NVIDIA && pci.class_id() == 0x0680) {
            nvswitches += 1;
        } else if pci.vendor_id() == PCI_VENDOR_NVIDIA && pci.class_id() >> 8 == 0x03 {
            gpus.push(Gpu {
                pci: Some(address(pci)),
                vendor_id: pci.vendor_id(),
                device_id: pci.device_id(),
                numa: numa_of(dev),
                model: None,
                os_devices: dev
                    .io_children()
                    .filter(|c| c.object_type() == ObjectType::OSDevice)
                    .filter_map(|c| c.name().map(|n| n.to_string_lossy().into_owned()))
                    .collect(),
            });
        }
    }

    // NIC OS devices grouped by parent PCI address (or alone when not on PCI).
    let mut groups: BTreeMap<NicKey, NicGroup<'_>> = BTreeMap::new();
    for os in topo.objects_with_type(ObjectType::OSDevice) {
        let Some(ObjectAttributes::OSDevice(attr)) = os.attributes() else { continue };
        let (network, openfabrics) = match attr.device_type() {
            OSDeviceType::Network => (true, false),
            OSDeviceType::OpenFabrics => (false, true),
            _ => (false, false),
        };
        if !(network || openfabrics) {
            continue;
        }
        let name = os.name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let parent = os.parent().filter(|p| p.object_type() == ObjectType::PCIDevice);
        let key = match parent.and_then(|p| p.attributes()) {
            Some(ObjectAttributes::PCIDevice(pci)) => (Some(address(pci)), String::new()),
            _ => (None, name.clone()),
        };
        groups.entry(key).or_insert((parent, Vec::new())).1.push((name, openfabrics));
    }
    let mut nics = Vec::new();
    for ((pci, _), (parent, devs)) in groups {
        let (class_id, vendor) = match parent.and_then(|p| p.attributes()) {
            Some(ObjectAttributes::PCIDevice(a)) => (a.class_id(), a.vendor_id()),
            _ => (0, 0),
        };
        let class = LinkClass::of_nic(class_id, vendor, &devs);
        nics.push(Nic {
            pci,
            class,
            names: devs.into_iter().map(|(n, _)| n).collect(),
            numa: parent.and_then(numa_of),
        });
    }

    let machine = Machine {
        packages: count(ObjectType::Package),
        cores: count(ObjectType::Core),
        pus: count(ObjectType::PU),
        numa_nodes,
        gpus,
        nics,
        nvswitches,
    };
    let intra = if machine.gpus.is_empty() {
        LinkClass::SharedMemory
    } else if machine.nvswitches > 0 {
        LinkClass::NvLink
    } else {
        LinkClass::Pcie
    };
    let inter_node = crate::xml::network_link(&machine.nics);
    let t = Topology {
        name: "local".to_owned(),
        source: "hwloc discovery of this machine".to_owned(),
        nodes: 1,
        machine,
        intra_node: intra.typical_link(),
        inter_node,
    };
    t.validate()?;
    tracing::debug!(
        target: "collsched::topo",
        gpus = t.machine.gpus.len(),
        nics = t.machine.nics.len(),
        numa = t.machine.numa_nodes.len(),
        "discovered this machine with hwloc"
    );
    Ok(t)
}

/// A NIC's grouping key: its PCI address, or its OS device name when it is not on PCI.
type NicKey = (Option<PciAddress>, String);
/// A NIC's parent PCI device and its OS devices (name, is-OpenFabrics).
type NicGroup<'t> = (Option<&'t TopologyObject>, Vec<(String, bool)>);

fn address(pci: &hwlocality::object::attributes::PCIDeviceAttributes) -> PciAddress {
    PciAddress {
        domain: u32::from(pci.domain()),
        bus: pci.bus_id(),
        device: pci.bus_device(),
        function: pci.function(),
    }
}

fn numa_of(obj: &TopologyObject) -> Option<u32> {
    let set = obj.first_non_io_ancestor()?.nodeset()?;
    if set.weight() != Some(1) {
        return None;
    }
    set.first_set().and_then(|i| u32::try_from(usize::from(i)).ok())
}
