//! Synthetic descriptions, the project's JSON, presets, and clear errors for bad input.

use collsched_topo::{
    from_hwloc_xml, from_synthetic, load_hwloc_xml_file, preset, LinkClass, TopoError, Topology, PRESETS,
};
use proptest::prelude::*;

/// Expected counts of a description, computed here from the numbers in it.
fn expected(levels: &[(&str, u64)]) -> (u64, u64, u64, u64) {
    let mut total = 1;
    let (mut pack, mut numa, mut core) = (0, 1, 0);
    for (ty, n) in levels {
        total *= n;
        match *ty {
            "pack" | "package" | "socket" => pack = total,
            "numa" | "node" | "numanode" => numa = total,
            "core" => core = total,
            _ => {}
        }
    }
    (pack, numa, core, total)
}

fn counts(t: &Topology) -> (u64, u64, u64, u64) {
    let m = &t.machine;
    (u64::from(m.packages), m.numa_nodes.len() as u64, u64::from(m.cores), u64::from(m.pus))
}

#[test]
fn synthetic_descriptions_give_the_expected_counts() {
    let cases: &[&[(&str, u64)]] = &[
        &[("pack", 2), ("numa", 1), ("core", 8), ("pu", 2)],
        &[("numa", 4), ("pack", 1), ("l3", 1), ("core", 6), ("pu", 1)],
        &[("socket", 2), ("l3cache", 2), ("l2", 4), ("l1i", 1), ("core", 1), ("pu", 2)],
        &[("core", 3), ("pu", 5)],
        &[("group", 2), ("package", 3), ("die", 2), ("node", 2), ("core", 2), ("pu", 4)],
    ];
    for levels in cases {
        let desc: Vec<String> = levels.iter().map(|(t, n)| format!("{t}:{n}")).collect();
        let desc = desc.join(" ");
        let t = from_synthetic(&desc).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(counts(&t), expected(levels), "{desc}");
        assert!(t.machine.gpus.is_empty() && t.machine.nics.is_empty());
        assert_eq!(t.intra_node.class, LinkClass::SharedMemory);
    }
    // Upper-case aliases work, as in hwloc.
    assert_eq!(counts(&from_synthetic("Package:2 Core:2 PU:2").unwrap()), (2, 1, 4, 8));
    // NUMA nodes below packages know their package.
    let t = from_synthetic("pack:2 numa:2 core:1 pu:1").unwrap();
    let pkgs: Vec<_> = t.machine.numa_nodes.iter().map(|n| n.package).collect();
    assert_eq!(pkgs, vec![Some(0), Some(0), Some(1), Some(1)]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn synthetic_counts_are_products(p in 1u64..5, n in 1u64..4, c in 1u64..9, u in 1u64..4) {
        let levels = [("pack", p), ("numa", n), ("core", c), ("pu", u)];
        let t = from_synthetic(&format!("pack:{p} numa:{n} core:{c} pu:{u}")).unwrap();
        prop_assert_eq!(counts(&t), expected(&levels));
        prop_assert_eq!(t.ranks_per_node() as u64, p * n);
    }
}

#[test]
fn bad_synthetic_descriptions_are_clear_errors() {
    for (desc, level, says) in [
        ("", "", "empty"),
        ("pack:0 pu:2", "pack:0", "positive"),
        ("pack:x pu:2", "pack:x", "positive"),
        ("core:2 pack:2 pu:1", "pack:2", "after"),
        ("pack:2 core:4", "core:4", "last level must be pu"),
        ("blob:2 pu:2", "blob:2", "unknown type"),
        ("numa:2(memory=1GB) pu:2", "numa:2(memory=1GB)", "not supported"),
        ("pack:2 pu", "pu", "type:count"),
        ("core:2 numa:2 pu:2", "numa:2", "above core"),
        ("pack:1024 core:1024 pu:1024", "pu:1024", "more than"),
    ] {
        match from_synthetic(desc) {
            Err(TopoError::Synthetic { level: l, message, .. }) => {
                assert_eq!(l, level, "{desc}");
                assert!(message.contains(says), "{desc}: {message}");
            }
            other => panic!("{desc}: expected a synthetic error, got {other:?}"),
        }
    }
}

#[test]
fn every_preset_round_trips_through_json() {
    for name in PRESETS {
        for nodes in [1, 3] {
            let t = preset(name).unwrap().with_nodes(nodes).unwrap();
            let json = t.to_json();
            assert!(json.contains("\"format\": \"collsched-topology\""), "{json}");
            let back = Topology::from_json(&json).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(back, t, "{name} x{nodes}");
            assert_eq!(back.to_json(), json, "{name}: writing again gives the same text");
        }
    }
    // Through a file, too.
    let path = std::env::temp_dir().join(format!("collsched-topo-{}.json", std::process::id()));
    let t = preset("dgx-h100").unwrap();
    t.save_json_file(&path).unwrap();
    let back = Topology::load_json_file(&path).unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(back, t);
}

#[test]
fn presets_hold_what_their_docs_say() {
    let h = preset("dgx-h100").unwrap();
    assert_eq!((h.machine.gpus.len(), h.machine.nics.len()), (8, 8));
    assert!(h.machine.nics.iter().all(|n| n.class == LinkClass::InfiniBand));
    assert_eq!(h.intra_node.class, LinkClass::NvLink);
    let p = preset("p4d").unwrap();
    assert_eq!((p.machine.gpus.len(), p.machine.nics.len(), p.inter_node.class), (8, 4, LinkClass::Efa));
    let q = preset("pcie-8gpu").unwrap();
    assert_eq!((q.machine.gpus.len(), q.intra_node.class, q.machine.packages), (8, LinkClass::Pcie, 2));
    // GPUs behind two sockets: four on each NUMA node.
    assert_eq!(q.machine.gpus.iter().filter(|g| g.numa == Some(1)).count(), 4);
    let c = preset("cpu-2socket").unwrap();
    assert!(c.machine.gpus.is_empty());
    assert_eq!((c.ranks_per_node(), c.intra_node.class), (2, LinkClass::SharedMemory));
    match preset("dgx-a100") {
        Err(e @ TopoError::UnknownPreset { .. }) => {
            assert!(e.to_string().contains("dgx-h100, p4d, pcie-8gpu, cpu-2socket"))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_json_is_a_clear_error() {
    let good = preset("p4d").unwrap().to_json();
    // Not JSON at all: the message carries a line and column.
    match Topology::from_json("{\"format\": ") {
        Err(TopoError::Json { message, .. }) => assert!(message.contains("line"), "{message}"),
        other => panic!("{other:?}"),
    }
    // A missing field is named.
    let missing = good.replacen("\"nodes\": 1,", "", 1);
    match Topology::from_json(&missing) {
        Err(TopoError::Json { message, .. }) => assert!(message.contains("nodes"), "{message}"),
        other => panic!("{other:?}"),
    }
    // Wrong format tag and version.
    let other_format = good.replacen("collsched-topology", "something-else", 1);
    assert!(
        matches!(Topology::from_json(&other_format), Err(TopoError::Json { message, .. }) if message.contains("format"))
    );
    let other_version = good.replacen("\"version\": 1", "\"version\": 7", 1);
    assert!(
        matches!(Topology::from_json(&other_version), Err(TopoError::Json { message, .. }) if message.contains("version"))
    );
    // Values the model cannot use name their field.
    let mut t = preset("p4d").unwrap();
    t.intra_node.bandwidth_gbs = -1.0;
    match Topology::from_json(&t.to_json()) {
        Err(TopoError::Invalid { field, .. }) => assert_eq!(field, "intra_node.bandwidth_gbs"),
        other => panic!("{other:?}"),
    }
    let zero_nodes = good.replacen("\"nodes\": 1", "\"nodes\": 0", 1);
    assert!(
        matches!(Topology::from_json(&zero_nodes), Err(TopoError::Invalid { field, .. }) if field == "nodes")
    );
    let mut t = preset("p4d").unwrap();
    t.inter_node.class = LinkClass::NvLink;
    assert!(
        matches!(Topology::from_json(&t.to_json()), Err(TopoError::Invalid { field, .. }) if field == "inter_node.class")
    );
    let bad_pci = good.replacen("0000:10:00.0", "0000:zz:00.0", 1);
    assert!(
        matches!(Topology::from_json(&bad_pci), Err(TopoError::Json { message, .. }) if message.contains("PCI address"))
    );
    // A missing file names its path.
    match Topology::load_json_file("/nonexistent/topo.json") {
        Err(e @ TopoError::Io { .. }) => assert!(e.to_string().contains("/nonexistent/topo.json")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_xml_is_a_clear_error() {
    match from_hwloc_xml("<topology><object type=\"Machine\">") {
        Err(e @ TopoError::Xml { .. }) => assert!(e.to_string().contains("not well-formed"), "{e}"),
        other => panic!("{other:?}"),
    }
    match from_hwloc_xml("<system version=\"1\"><cpu/></system>") {
        Err(TopoError::HwlocXml { message, .. }) => assert!(message.contains("<system>"), "{message}"),
        other => panic!("{other:?}"),
    }
    match from_hwloc_xml("<topology version=\"2.0\"></topology>") {
        Err(TopoError::HwlocXml { message, .. }) => assert!(message.contains("no <object>"), "{message}"),
        other => panic!("{other:?}"),
    }
    let bad_pci = r#"<topology version="2.0"><object type="Machine"><object type="PU" os_index="0"/>
<object type="PCIDev" id="obj9" pci_busid="0000:01:00.0" pci_type="garbage"/></object></topology>"#;
    match from_hwloc_xml(bad_pci) {
        Err(TopoError::HwlocXml { message, .. }) => {
            assert!(
                message.contains("pci_type=\"garbage\"")
                    && message.contains("obj9")
                    && message.contains("line 2"),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }
    let bad_number = r#"<topology><object type="Machine"><object type="NUMANode" os_index="x"/><object type="PU"/></object></topology>"#;
    assert!(
        matches!(from_hwloc_xml(bad_number), Err(TopoError::HwlocXml { message, .. }) if message.contains("os_index=\"x\""))
    );
    let no_pu = r#"<topology><object type="Machine"/></topology>"#;
    assert!(
        matches!(from_hwloc_xml(no_pu), Err(TopoError::HwlocXml { message, .. }) if message.contains("no PU"))
    );
    match load_hwloc_xml_file("/nonexistent/machine.xml") {
        Err(e @ TopoError::Io { .. }) => assert!(e.to_string().contains("/nonexistent/machine.xml")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn hwloc_2_enumerated_osdev_types_are_read() {
    // Before hwloc 3.0, osdev_type is an enumeration: 2 network, 3 OpenFabrics.
    let xml = r#"<topology version="2.0"><object type="Machine" nodeset="0x1">
  <object type="Package" os_index="0" nodeset="0x1"><object type="NUMANode" os_index="0" nodeset="0x1"/>
    <object type="Core"><object type="PU" os_index="0"/></object>
    <object type="Bridge"><object type="PCIDev" pci_busid="0000:05:00.0" pci_type="0207 [15b3:1017] [15b3:0020] 00 00">
      <object type="OSDev" name="ib0" osdev_type="2"/><object type="OSDev" name="mlx5_0" osdev_type="3"/></object>
    <object type="PCIDev" pci_busid="0000:06:00.0" pci_type="0300 [10de:2330] [10de:16c1] a1 00">
      <object type="OSDev" name="cuda0" osdev_type="5"/></object></object>
  </object></object></topology>"#;
    let t = from_hwloc_xml(xml).unwrap();
    assert_eq!(t.machine.nics.len(), 1);
    assert_eq!(t.machine.nics[0].class, LinkClass::InfiniBand);
    assert_eq!(t.machine.nics[0].names, vec!["ib0".to_owned(), "mlx5_0".to_owned()]);
    assert_eq!(t.machine.gpus.len(), 1);
    assert_eq!((t.machine.gpus[0].numa, t.machine.gpus[0].device_id), (Some(0), 0x2330));
}

#[test]
fn machines_write_back_as_synthetic_descriptions() {
    let mut machines: Vec<Topology> = PRESETS.iter().map(|n| preset(n).unwrap()).collect();
    for f in [
        "nvidiaDGX2.xml",
        "power8gpudistances.xml",
        "32em64t-2n8c2t-pci-normalio.xml",
        "192em64t-24n8c2t.xml",
    ] {
        machines.push(
            load_hwloc_xml_file(format!("{}/../tests/data/topologies/{f}", env!("CARGO_MANIFEST_DIR")))
                .unwrap(),
        );
    }
    for desc in
        ["pack:2 numa:2 core:3 pu:2", "numa:4 pack:1 core:6 pu:1", "core:3 pu:5", "numa:2 pack:2 core:2 pu:1"]
    {
        machines.push(from_synthetic(desc).unwrap());
    }
    for t in machines {
        let desc = t.to_synthetic().unwrap_or_else(|| panic!("{}: symmetric machine", t.name));
        let back = from_synthetic(&desc).unwrap_or_else(|e| panic!("{}: {e}", t.name));
        assert_eq!(counts(&back), counts(&t), "{}: {desc}", t.name);
    }
    // An asymmetric machine has no synthetic description.
    let mut odd = preset("cpu-2socket").unwrap();
    odd.machine.cores = 31;
    assert_eq!(odd.to_synthetic(), None);
}

/// A binary file given as a topology says it is not text, not "check the permissions".
#[test]
fn a_binary_file_is_not_text() {
    let path = std::env::temp_dir().join(format!("collsched-binary-{}.xml", std::process::id()));
    std::fs::write(&path, [0xffu8, 0xfe, 0x00, 0x80, 0x81]).expect("write");
    let e = collsched_topo::load_hwloc_xml_file(&path).unwrap_err();
    assert!(e.to_string().contains("not text"), "{e}");
    let e = collsched_topo::Topology::load_json_file(&path).unwrap_err();
    assert!(e.to_string().contains("not text"), "{e}");
    let _ = std::fs::remove_file(&path);
}
