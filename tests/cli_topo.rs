//! `collsched topo`: every source prints the machine; bad input is one clear error line.

use std::process::{Command, Output};

use collsched_topo::{preset, Topology};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_collsched")).arg("topo").args(args).output().expect("the binary runs")
}

fn ok_stdout(args: &[&str]) -> String {
    let out = run(args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn data(file: &str) -> String {
    format!("{}/tests/data/topologies/{file}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn preset_summary_and_json() {
    let text = ok_stdout(&["--preset", "dgx-h100"]);
    let t = preset("dgx-h100").unwrap();
    assert!(text.contains(&format!("GPUs: {}", t.machine.gpus.len())), "{text}");
    for g in &t.machine.gpus {
        assert!(text.contains(&g.pci.unwrap().to_string()), "GPU PCI id missing: {text}");
    }
    assert!(text.contains("nv_link") && text.contains("infini_band"), "{text}");
    assert!(text.contains("intra-node groups") && text.contains("inter-node groups"), "{text}");
    assert!(text.contains("cost model") && text.contains("all_gather"), "{text}");

    let json = ok_stdout(&["--preset", "p4d", "--nodes", "4", "--json"]);
    let back = Topology::from_json(&json).unwrap();
    assert_eq!(back, preset("p4d").unwrap().with_nodes(4).unwrap());
}

#[test]
fn xml_and_synthetic_sources() {
    let json = ok_stdout(&["--xml", &data("nvidiaDGX2.xml"), "--json"]);
    let t = Topology::from_json(&json).unwrap();
    assert_eq!(t.machine.gpus.len(), 16);
    assert_eq!(t.name, "nvidiaDGX2");

    let json = ok_stdout(&["--synthetic", "pack:2 numa:2 core:4 pu:2", "--json"]);
    let t = Topology::from_json(&json).unwrap();
    assert_eq!(
        (t.machine.packages, t.machine.numa_nodes.len(), t.machine.cores, t.machine.pus),
        (2, 4, 16, 32)
    );
}

#[test]
fn bad_input_is_one_clear_error() {
    for (args, says) in [
        (vec!["--preset", "dgx-z"], "unknown preset machine `dgx-z`"),
        (vec!["--synthetic", "pack:0 pu:1"], "not a positive integer"),
        (vec!["--xml", "/nonexistent/x.xml"], "/nonexistent/x.xml"),
        (vec!["--preset", "p4d", "--nodes", "0"], "nodes"),
    ] {
        let out = run(&args);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("error: ") && err.contains(says), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    }
    let bad_xml = std::env::temp_dir().join(format!("collsched-cli-topo-{}.xml", std::process::id()));
    std::fs::write(&bad_xml, "<topology><object").unwrap();
    let out = run(&["--xml", bad_xml.to_str().unwrap()]);
    std::fs::remove_file(&bad_xml).ok();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not well-formed XML"));
    // Two sources at once is a usage error.
    assert!(!run(&["--preset", "p4d", "--synthetic", "pu:1"]).status.success());
}
