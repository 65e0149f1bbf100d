//! The flight recorder inside a local world: a failed kernel named by the verdict (the fault
//! injection of `local::moves` exists only in the crate's unit tests), and the ring's bounds.

use std::time::Duration;

use collsched_kernels::ElemType;

use super::verdict::{analyze, Finding};
use super::{FlightConfig, FlightState};
use crate::backend::local::moves::FAIL_TAG;
use crate::backend::local::{LocalConfig, LocalWorld};
use crate::backend::{Backend, CollDesc, Collective, RankGroup, Stream};

#[test]
fn a_failed_kernel_is_the_first_failure_and_names_its_rank() {
    let wait = Duration::from_secs(20);
    let dir = std::env::temp_dir().join(format!("collsched-flight-kernel-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let flight = FlightConfig { entries: 16, dir: Some(dir.clone()) };
    let config = LocalConfig { timeout: wait, piece_bytes: 64, flight, ..LocalConfig::default() };
    let world = LocalWorld::with_config(3, config).expect("world");
    let out = world
        .run(|rank| {
            let (n, count) = (rank.world_size(), 1000);
            // One good all-gather first, then the reduce-scatter whose piece 0 fails.
            let desc = CollDesc::all_gather(RankGroup::world(n), ElemType::F32, 4).with_tag(1);
            let ok = Collective {
                desc,
                input: Some(rank.alloc(16).expect("alloc")),
                output: rank.alloc(16 * n).expect("alloc"),
            };
            rank.launch(Stream::ReduceScatter, &[], ok)
                .map_err(|e| e.error)
                .expect("launch")
                .wait(wait)
                .expect("ok");
            let desc = CollDesc::reduce_scatter(RankGroup::world(n), ElemType::F32, count).with_tag(FAIL_TAG);
            let bad = Collective {
                desc,
                input: Some(rank.alloc(n * count * 4).expect("alloc")),
                output: rank.alloc(count * 4).expect("alloc"),
            };
            let f = rank.launch(Stream::ReduceScatter, &[], bad).map_err(|e| e.error).expect("launch");
            let error = f.wait(wait).err().map(|e| e.into_error()).expect("the reduction failed");
            (error, rank.flight_record("test"))
        })
        .expect("ranks");
    let out: Vec<_> = out.into_iter().map(|r| r.expect("no rank panicked")).collect();
    let culprit = out
        .iter()
        .position(|(e, _)| !e.is_peers() && e.to_string().contains("injected failure"))
        .expect("one rank's own failure");
    let dumps: Vec<_> = out.iter().map(|(_, d)| d.clone()).collect();
    for d in &dumps {
        assert_eq!(d.entries.len(), 2, "rank {}: {:?}", d.rank, d.entries);
        assert_eq!((d.entries[0].seq, d.entries[0].state), (0, FlightState::Completed));
        assert_eq!((d.entries[1].seq, d.entries[1].state), (1, FlightState::Failed));
        assert!(
            d.entries[1].launched_ns <= d.entries[1].started_ns
                && d.entries[1].started_ns <= d.entries[1].ended_ns
        );
    }
    let v = analyze(&dumps);
    match &v.finding {
        Finding::FirstFailure { rank, seq, error, .. } => {
            assert_eq!((*rank, *seq), (culprit, 1), "{v}");
            assert!(error.contains("injected failure"), "{v}");
        }
        other => panic!("expected the failed kernel, got {other:?}"),
    }
    assert!(v.no_record.is_empty());
    // Every rank wrote its record on the failure.
    for r in 0..3 {
        let text =
            std::fs::read_to_string(dir.join(format!("rank-{r}.json"))).expect("rank's record written");
        let d: super::FlightDump = serde_json::from_str(&text).expect("a record");
        assert_eq!(d.rank, r);
        assert_eq!(d.entries.last().map(|e| e.state), Some(FlightState::Failed));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_ring_keeps_the_last_entries_and_counts_the_dropped() {
    let flight = FlightConfig { entries: 4, dir: None };
    let world = LocalWorld::with_config(2, LocalConfig { flight, ..LocalConfig::default() }).expect("world");
    let dumps = world
        .run(|rank| {
            for k in 0..10u64 {
                let desc = CollDesc::all_gather(RankGroup::world(2), ElemType::BF16, 3).with_tag(k);
                let c = Collective {
                    desc,
                    input: Some(rank.alloc(6).expect("alloc")),
                    output: rank.alloc(12).expect("alloc"),
                };
                let f = rank.launch(Stream::AllGather, &[], c).map_err(|e| e.error).expect("launch");
                f.wait(Duration::from_secs(20)).expect("done");
            }
            rank.flight_record("asked")
        })
        .expect("ranks");
    for d in dumps {
        let d = d.expect("no rank panicked");
        assert_eq!(d.dropped, 6);
        let seqs: Vec<u64> = d.entries.iter().map(|e| e.seq).collect();
        let tags: Vec<u64> = d.entries.iter().map(|e| e.tag).collect();
        assert_eq!(seqs, [6, 7, 8, 9]);
        assert_eq!(tags, [6, 7, 8, 9]);
        assert!(d
            .entries
            .iter()
            .all(|e| e.state == FlightState::Completed && e.dtype == "bf16" && e.bytes == 12));
        assert_eq!(d.reason, "asked");
    }
}
