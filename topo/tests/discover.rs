//! Discovery of this machine through hwloc (feature `hwloc`).
//!
//! Expected values are read from Linux's sysfs, not from hwloc: every machine has at least one
//! PU and one NUMA node, hwloc sees no more PUs than are online nor more NUMA nodes than
//! `/sys/devices/system/node` lists, and the GPUs it reports are exactly the NVIDIA display/3D
//! PCI functions sysfs lists (none on the CI machines, which have no GPU).
#![cfg(feature = "hwloc")]

use std::path::Path;

fn online_cpus() -> Option<usize> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online").ok()?;
    let mut n = 0;
    for part in text.trim().split(',') {
        match part.split_once('-') {
            Some((a, b)) => n += b.parse::<usize>().ok()? - a.parse::<usize>().ok()? + 1,
            None => n += 1,
        }
    }
    Some(n)
}

fn sysfs_nvidia_gpus() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/bus/pci/devices").ok()?;
    let mut n = 0;
    for dev in dir.flatten() {
        let read = |f: &str| std::fs::read_to_string(dev.path().join(f)).unwrap_or_default();
        if read("vendor").trim() == "0x10de" && read("class").trim().starts_with("0x03") {
            n += 1;
        }
    }
    Some(n)
}

#[test]
fn discovers_this_machine() {
    let t = collsched_topo::discover().unwrap_or_else(|e| panic!("{e}"));
    assert!(t.machine.pus >= 1);
    assert!(!t.machine.numa_nodes.is_empty());
    if let Some(online) = online_cpus() {
        assert!(t.machine.pus as usize <= online, "{} PUs, {online} online", t.machine.pus);
    }
    if Path::new("/sys/devices/system/node").exists() {
        let listed = std::fs::read_dir("/sys/devices/system/node")
            .unwrap()
            .flatten()
            .filter(|e| {
                e.file_name().to_string_lossy().strip_prefix("node").is_some_and(|s| s.parse::<u32>().is_ok())
            })
            .count();
        assert!(t.machine.numa_nodes.len() <= listed.max(1));
    }
    if let Some(gpus) = sysfs_nvidia_gpus() {
        assert_eq!(t.machine.gpus.len(), gpus);
    }
    // What was discovered is a valid topology that survives JSON.
    assert_eq!(collsched_topo::Topology::from_json(&t.to_json()).unwrap(), t);
}
