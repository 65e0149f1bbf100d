//! hwloc XML, read with our own small parser on top of `roxmltree`: works in every build, with or
//! without the hwloc library.
//!
//! Reads the XML that `lstopo --of xml` / `hwloc_topology_export_xml` write, versions 1.x, 2.x
//! and 3.x (the `osdev_type` attribute is an enumeration before 3.0 and a bit mask from 3.0 on).
//! What it takes from the file:
//! - packages (`Package`, or `Socket` in 1.x), cores, PUs, NUMA nodes with their local memory
//!   and package;
//! - **GPUs**: PCI devices of vendor 0x10de (NVIDIA) whose class is a display or 3D controller
//!   (class 0x03xx), with their PCI address, device id, OS devices (`cuda0`, `nvml0`, ...) and
//!   NUMA node;
//! - **NVSwitches**: PCI devices with subtype `NVSwitch`, or of vendor 0x10de and class 0x0680;
//! - **NICs**: network or OpenFabrics OS devices, one NIC per parent PCI device; the class is
//!   EFA for vendor 0x1d0f, InfiniBand for an InfiniBand controller (class 0x0207) or an
//!   OpenFabrics device with an `ib*` or no network interface, RoCE for an OpenFabrics device
//!   beside another network interface, Ethernet otherwise;
//! - **PCI placement**: a device's NUMA node is the nodeset of its first non-I/O ancestor when
//!   that nodeset is exactly one node (otherwise unknown).
//!
//! hwloc does not record link speeds usable for collectives, so the links are typical ones
//! ([`LinkClass::typical_link`]): NVLink when the machine has NVSwitches or an `NVLinkBandwidth`
//! distance matrix, PCIe for other GPU machines, shared memory without GPUs; the network is the
//! best NIC class present (InfiniBand, RoCE, EFA, Ethernet) times the number of such NICs, or one
//! typical Ethernet adapter when there is none.

use std::collections::BTreeMap;
use std::path::Path;

use roxmltree::{Document, Node, ParsingOptions};

use crate::{
    Gpu, Link, LinkClass, Machine, Nic, NumaNode, PciAddress, TopoError, Topology, PCI_VENDOR_NVIDIA,
};

/// Object types that are I/O or misc objects (not part of the CPU/memory tree).
const IO_TYPES: [&str; 4] = ["Bridge", "PCIDev", "OSDev", "Misc"];

/// Loads an hwloc XML file; the topology is named after the file stem.
///
/// # Errors
/// [`TopoError::Io`] when the file cannot be read; otherwise as [`from_hwloc_xml`].
pub fn load_hwloc_xml_file(path: impl AsRef<Path>) -> Result<Topology, TopoError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::InvalidData => TopoError::NotText { path: path.to_owned() },
        _ => TopoError::Io { path: path.to_owned(), source },
    })?;
    let name = path.file_stem().map_or_else(|| "hwloc-xml".to_owned(), |s| s.to_string_lossy().into_owned());
    parse(&text, &path.display().to_string(), &name)
}

/// Reads hwloc XML text into a one-node [`Topology`] named `hwloc-xml`.
///
/// # Errors
/// [`TopoError::Xml`] when the text is not well-formed XML (with line and column);
/// [`TopoError::HwlocXml`] when the root is not `<topology>`, there is no `Machine`-level
/// object, or an object carries a malformed attribute (named, with its position).
///
/// # Examples
/// ```
/// let xml = r#"<topology version="2.0"><object type="Machine" os_index="0">
///   <object type="Package" os_index="0"><object type="NUMANode" os_index="0" local_memory="1024"/>
///   <object type="Core" os_index="0"><object type="PU" os_index="0"/></object></object>
/// </object></topology>"#;
/// let t = collsched_topo::from_hwloc_xml(xml)?;
/// assert_eq!((t.machine.packages, t.machine.pus, t.machine.numa_nodes.len()), (1, 1, 1));
/// # Ok::<(), collsched_topo::TopoError>(())
/// ```
pub fn from_hwloc_xml(text: &str) -> Result<Topology, TopoError> {
    parse(text, "<string>", "hwloc-xml")
}

struct XmlDoc<'a> {
    origin: &'a str,
    doc: &'a Document<'a>,
    /// osdev_type is a bit mask (hwloc 3.x) rather than an enumeration.
    bitmask_osdev: bool,
}

impl XmlDoc<'_> {
    fn err(&self, node: Node<'_, '_>, message: String) -> TopoError {
        let pos = self.doc.text_pos_at(node.range().start);
        let id = node.attribute("id").or_else(|| node.attribute("gp_index")).unwrap_or("?");
        TopoError::HwlocXml {
            origin: self.origin.to_owned(),
            message: format!(
                "line {}, object {} (id {id}): {message}",
                pos.row,
                node.attribute("type").unwrap_or("?")
            ),
        }
    }

    fn num<T: std::str::FromStr>(&self, node: Node<'_, '_>, attr: &str) -> Result<Option<T>, TopoError> {
        match node.attribute(attr) {
            None => Ok(None),
            Some(v) => v
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| self.err(node, format!("attribute {attr}=\"{v}\" is not a number"))),
        }
    }
}

fn parse(text: &str, origin: &str, name: &str) -> Result<Topology, TopoError> {
    let opts = ParsingOptions { allow_dtd: true, ..ParsingOptions::default() };
    let doc = Document::parse_with_options(text, opts)
        .map_err(|e| TopoError::Xml { origin: origin.to_owned(), message: e.to_string() })?;
    let root = doc.root_element();
    if root.tag_name().name() != "topology" {
        return Err(TopoError::HwlocXml {
            origin: origin.to_owned(),
            message: format!("root element is <{}>, expected hwloc's <topology>", root.tag_name().name()),
        });
    }
    let major: u32 =
        root.attribute("version").and_then(|v| v.split('.').next()).and_then(|v| v.parse().ok()).unwrap_or(1);
    let cx = XmlDoc { origin, doc: &doc, bitmask_osdev: major >= 3 };
    let Some(top) = root.children().find(|n| n.has_tag_name("object")) else {
        return Err(TopoError::HwlocXml {
            origin: origin.to_owned(),
            message: "no <object> under <topology>: not an hwloc topology export".to_owned(),
        });
    };
    if !matches!(top.attribute("type"), Some("Machine" | "System")) {
        return Err(cx.err(top, "the first object must be the Machine (or 1.x System)".to_owned()));
    }

    let mut machine = Machine {
        packages: 0,
        cores: 0,
        pus: 0,
        numa_nodes: Vec::new(),
        gpus: Vec::new(),
        nics: Vec::new(),
        nvswitches: 0,
    };
    // NIC OS devices grouped by their parent PCI device (keyed by document position).
    let mut nic_groups: BTreeMap<usize, NicGroup<'_, '_>> = BTreeMap::new();

    for node in top.descendants().filter(|n| n.has_tag_name("object")) {
        match node.attribute("type").unwrap_or("") {
            "Package" | "Socket" => machine.packages += 1,
            "Core" => machine.cores += 1,
            "PU" => machine.pus += 1,
            "NUMANode" => {
                let os_index = cx.num(node, "os_index")?.unwrap_or(machine.numa_nodes.len() as u32);
                let memory_bytes = cx.num(node, "local_memory")?.unwrap_or(0);
                let package = match ancestor_of_type(node, &["Package", "Socket"]) {
                    Some(p) => cx.num(p, "os_index")?,
                    None => None,
                };
                machine.numa_nodes.push(NumaNode { os_index, memory_bytes, package });
            }
            "PCIDev" => {
                let (class, vendor, device) = pci_type(&cx, node)?;
                if node.attribute("subtype") == Some("NVSwitch")
                    || (vendor == PCI_VENDOR_NVIDIA && class == 0x0680)
                {
                    machine.nvswitches += 1;
                } else if vendor == PCI_VENDOR_NVIDIA && class >> 8 == 0x03 {
                    let os_devices: Vec<String> = node
                        .children()
                        .filter(|c| c.has_tag_name("object") && c.attribute("type") == Some("OSDev"))
                        .filter_map(|c| c.attribute("name").map(str::to_owned))
                        .collect();
                    let model = info(node, "GPUModel")
                        .or_else(|| node.children().find_map(|c| info(c, "GPUModel")))
                        .or_else(|| info(node, "PCIDevice"));
                    machine.gpus.push(Gpu {
                        pci: pci_address(&cx, node)?,
                        vendor_id: vendor,
                        device_id: device,
                        numa: numa_of(&cx, node)?,
                        model,
                        os_devices,
                    });
                }
            }
            "OSDev" => {
                let ty: u32 = cx.num(node, "osdev_type")?.unwrap_or(u32::MAX);
                let (network, openfabrics) = if cx.bitmask_osdev {
                    (ty != u32::MAX && ty & (1 << 4) != 0, ty != u32::MAX && ty & (1 << 5) != 0)
                } else {
                    (ty == 2, ty == 3)
                };
                if network || openfabrics {
                    let parent = node.parent().filter(|p| p.attribute("type") == Some("PCIDev"));
                    let key = parent.map_or(node.range().start, |p| p.range().start);
                    let name = node.attribute("name").unwrap_or("").to_owned();
                    nic_groups.entry(key).or_insert((parent, Vec::new())).1.push((name, openfabrics));
                }
            }
            _ => {}
        }
    }

    for (_, (parent, devs)) in nic_groups {
        let (class_id, vendor) = match parent {
            Some(p) => {
                let (c, v, _) = pci_type(&cx, p)?;
                (c, v)
            }
            None => (0, 0),
        };
        let class = LinkClass::of_nic(class_id, vendor, &devs);
        let (pci, numa) = match parent {
            Some(p) => (pci_address(&cx, p)?, numa_of(&cx, p)?),
            None => (None, None),
        };
        machine.nics.push(Nic { pci, class, names: devs.into_iter().map(|(n, _)| n).collect(), numa });
    }
    machine.gpus.sort_by_key(|g| g.pci);
    machine.nics.sort_by_key(|n| n.pci);

    if machine.pus == 0 {
        return Err(TopoError::HwlocXml {
            origin: origin.to_owned(),
            message: "the topology has no PU object; an hwloc export always has at least one".to_owned(),
        });
    }
    let has_nvlink_matrix = root.children().any(|n| {
        n.attribute("name") == Some("NVLinkBandwidth") && n.tag_name().name().starts_with("distances")
    });
    let intra_class = if machine.gpus.is_empty() {
        LinkClass::SharedMemory
    } else if machine.nvswitches > 0 || has_nvlink_matrix {
        LinkClass::NvLink
    } else {
        LinkClass::Pcie
    };
    let inter_node = network_link(&machine.nics);
    let product = info(top, "DMIProductName");
    let t = Topology {
        name: name.to_owned(),
        source: match product {
            Some(p) => format!("hwloc XML {origin} ({p})"),
            None => format!("hwloc XML {origin}"),
        },
        nodes: 1,
        machine,
        intra_node: intra_class.typical_link(),
        inter_node,
    };
    t.validate()?;
    tracing::debug!(
        target: "collsched::topo",
        origin,
        gpus = t.machine.gpus.len(),
        nics = t.machine.nics.len(),
        numa = t.machine.numa_nodes.len(),
        "loaded hwloc XML"
    );
    Ok(t)
}

/// A NIC's parent PCI device and its OS devices (name, is-OpenFabrics).
type NicGroup<'a, 'i> = (Option<Node<'a, 'i>>, Vec<(String, bool)>);

/// The network level of a machine: its best NIC class, times the number of such NICs.
pub(crate) fn network_link(nics: &[Nic]) -> Link {
    const PRIORITY: [LinkClass; 4] =
        [LinkClass::InfiniBand, LinkClass::Roce, LinkClass::Efa, LinkClass::Ethernet];
    for class in PRIORITY {
        let count = nics.iter().filter(|n| n.class == class).count();
        if count > 0 {
            let one = class.typical_link();
            return Link { bandwidth_gbs: one.bandwidth_gbs * count as f64, ..one };
        }
    }
    LinkClass::Ethernet.typical_link()
}

fn info(node: Node<'_, '_>, name: &str) -> Option<String> {
    node.children()
        .find(|c| c.has_tag_name("info") && c.attribute("name") == Some(name))
        .and_then(|c| c.attribute("value"))
        .map(str::to_owned)
}

fn ancestor_of_type<'a, 'i>(node: Node<'a, 'i>, types: &[&str]) -> Option<Node<'a, 'i>> {
    node.ancestors()
        .skip(1)
        .find(|a| a.has_tag_name("object") && a.attribute("type").is_some_and(|t| types.contains(&t)))
}

/// `pci_type="0302 [10de:1db8] [10de:131d] a1 00"` -> (class, vendor, device).
fn pci_type(cx: &XmlDoc<'_>, node: Node<'_, '_>) -> Result<(u16, u16, u16), TopoError> {
    let Some(v) = node.attribute("pci_type") else {
        return Err(cx.err(node, "PCI device without a pci_type attribute".to_owned()));
    };
    let bad = || cx.err(node, format!("pci_type=\"{v}\" is not of the form \"0302 [10de:1db8] ...\""));
    let mut words = v.split_whitespace();
    let class = words.next().and_then(|w| u16::from_str_radix(w, 16).ok()).ok_or_else(bad)?;
    let ids =
        words.next().and_then(|w| w.strip_prefix('[')).and_then(|w| w.strip_suffix(']')).ok_or_else(bad)?;
    let (vendor, device) = ids.split_once(':').ok_or_else(bad)?;
    let vendor = u16::from_str_radix(vendor, 16).map_err(|_| bad())?;
    let device = u16::from_str_radix(device, 16).map_err(|_| bad())?;
    Ok((class, vendor, device))
}

fn pci_address(cx: &XmlDoc<'_>, node: Node<'_, '_>) -> Result<Option<PciAddress>, TopoError> {
    match node.attribute("pci_busid") {
        None => Ok(None),
        Some(v) => v.parse().map(Some).map_err(|e: String| cx.err(node, format!("pci_busid: {e}"))),
    }
}

/// The single NUMA node in the nodeset of the first non-I/O ancestor, if it is exactly one.
fn numa_of(cx: &XmlDoc<'_>, node: Node<'_, '_>) -> Result<Option<u32>, TopoError> {
    let Some(anc) = node
        .ancestors()
        .skip(1)
        .find(|a| a.has_tag_name("object") && a.attribute("type").is_some_and(|t| !IO_TYPES.contains(&t)))
    else {
        return Ok(None);
    };
    match anc.attribute("nodeset") {
        None => Ok(None),
        Some(set) => {
            let bits = parse_bitmap(set)
                .map_err(|()| cx.err(anc, format!("nodeset=\"{set}\" is not an hwloc bitmap")))?;
            Ok(match bits.as_deref() {
                Some([one]) => Some(*one),
                _ => None,
            })
        }
    }
}

/// hwloc's bitmap text: comma-separated 32-bit hex words, most significant first; an empty word
/// is 0; `0xf...f` as the first word means "and every higher bit". Returns the set bits of a
/// finite set, `Ok(None)` for an infinite one, `Err(())` for text that is not a bitmap.
pub(crate) fn parse_bitmap(text: &str) -> Result<Option<Vec<u32>>, ()> {
    /// Words looked at (32 Ki bits): far more NUMA nodes than any machine has.
    const MAX_WORDS: usize = 1024;
    let words: Vec<&str> = text.split(',').map(str::trim).collect();
    if words.len() > MAX_WORDS {
        return Err(());
    }
    if words.first() == Some(&"0xf...f") {
        return Ok(None);
    }
    let mut bits = Vec::new();
    for (i, w) in words.iter().rev().enumerate() {
        let value = if w.is_empty() {
            0
        } else {
            u32::from_str_radix(w.strip_prefix("0x").unwrap_or(w), 16).map_err(|_| ())?
        };
        for b in 0..32 {
            if value & (1 << b) != 0 {
                bits.push(i as u32 * 32 + b);
            }
        }
    }
    bits.sort_unstable();
    Ok(Some(bits))
}

#[cfg(test)]
mod tests {
    use super::parse_bitmap;

    #[test]
    fn bitmaps() {
        assert_eq!(parse_bitmap("0x00000001"), Ok(Some(vec![0])));
        assert_eq!(parse_bitmap("0x0"), Ok(Some(vec![])));
        assert_eq!(parse_bitmap("0x00000100,,0x00000003"), Ok(Some(vec![0, 1, 72])));
        assert_eq!(parse_bitmap("0xf...f,0x1"), Ok(None));
        assert_eq!(parse_bitmap("0xzz"), Err(()));
    }
}
