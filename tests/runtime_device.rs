//! A fetch on a device backend does not wait on the host: the compute stream waits for the
//! gathers (and any unpack), and the views are handed out while the all-gather may still run;
//! host reads of them wait first; a gather that fails after the fetch is reported by the next
//! call. Run on `OnDevice`, the local backend seen as a device, with the all-gather stream held
//! behind a gate the test opens (or fails) after the fetch returned.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use collsched::backend::local::{LocalConfig, LocalRank, LocalWorld};
use collsched::backend::{BackendError, Stream};
use collsched::buckets::{DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding};
use collsched::runtime::{ModelState, RuntimeError};
use collsched::schedule::{Plan, PolicyKind, SchedulerConfig};

#[path = "support/device.rs"]
mod device;
use device::OnDevice;

const SIZES: [usize; 3] = [37, 20, 11];

fn values() -> Vec<Vec<f32>> {
    SIZES
        .iter()
        .enumerate()
        .map(|(k, &n)| (0..n).map(|i| (k * 100 + i) as f32 * 0.25 - 3.0).collect())
        .collect()
}

fn plan(sharding: Sharding, world: u32) -> Plan {
    let specs =
        SIZES.iter().enumerate().map(|(k, &n)| ParamSpec::new(format!("p{k}"), [n], DType::F32)).collect();
    let set = ParamSet::new(specs).expect("params");
    Plan::new(LayoutBuilder::new(&set, sharding, world).bucket_bytes(4096).build().expect("layout"))
}

/// Holds `rank`'s all-gather stream until the test sends `true` (go) or `false` (fail).
fn gate(rank: &LocalRank) -> mpsc::Sender<bool> {
    let (tx, rx) = mpsc::channel::<bool>();
    rank.enqueue_host(Stream::AllGather, move || match rx.recv() {
        Ok(false) => Err(BackendError::Unsupported { what: "injected failure before the all-gather".into() }),
        _ => Ok(()),
    })
    .expect("gate");
    tx
}

fn world(n: usize) -> LocalWorld {
    // A short timeout: a fetch that waited on the host for the gated gather would fail.
    LocalWorld::with_config(n, LocalConfig { timeout: Duration::from_secs(2), ..LocalConfig::default() })
        .expect("world")
}

fn no_prefetch() -> SchedulerConfig {
    SchedulerConfig { policy: PolicyKind::None, ..SchedulerConfig::default() }
}

#[test]
fn a_fetch_on_a_device_hands_out_views_before_the_gather_completed() {
    let init = values();
    let ids: Vec<ParamId> = (0..SIZES.len() as u32).map(ParamId).collect();
    // Even: an unpack follows the gather on its stream; flat: views into the gathered buffer.
    for sharding in [Sharding::EvenSplit, Sharding::Flat] {
        let plan = plan(sharding, 2);
        let out = world(2)
            .run(|rank| -> Result<Vec<Vec<f32>>, RuntimeError> {
                let rank = Arc::new(OnDevice(rank));
                let state = ModelState::from_f32(Arc::clone(&rank), &plan, &init)?;
                let mut c = state.coordinator(no_prefetch())?;
                // Held once the shards are in (host copies wait for every stream, as CUDA's do).
                let go = gate(&rank.0);
                let got = {
                    let v = c.fetch(&ids)?;
                    // Returned with the all-gather held: the host did not wait for it.
                    go.send(true).expect("gate");
                    let mut got = Vec::new();
                    for &p in &ids {
                        got.push(v.read_f32(p)?.into_owned());
                    }
                    got
                };
                c.release(&ids)?;
                c.end_step()?;
                Ok(got)
            })
            .expect("ranks");
        for (r, got) in out.into_iter().enumerate() {
            let got = got.expect("rank thread").unwrap_or_else(|e| panic!("{sharding}, rank {r}: {e}"));
            assert_eq!(got, init, "{sharding}, rank {r}: the views do not hold the full parameters");
        }
    }
}

#[test]
fn a_gather_that_fails_after_the_fetch_is_reported_naming_it() {
    let init = values();
    let ids: Vec<ParamId> = (0..SIZES.len() as u32).map(ParamId).collect();
    let plan = plan(Sharding::Flat, 2);
    let out = world(2)
        .run(|rank| -> Result<(String, String), RuntimeError> {
            let rank = Arc::new(OnDevice(rank));
            let state = ModelState::from_f32(Arc::clone(&rank), &plan, &init)?;
            let mut c = state.coordinator(no_prefetch())?;
            let fail = gate(&rank.0);
            let v = c.fetch(&ids)?;
            fail.send(false).expect("gate");
            let read = v.read_f32(ids[0]).map(|_| ()).expect_err("a read of a failed gather").to_string();
            drop(v);
            // The next calls report it: the release (its poll), or the end of the step.
            let later = c.release(&ids).and_then(|()| c.end_step().map(|_| ()));
            Ok((read, later.expect_err("the failed gather is reported").to_string()))
        })
        .expect("ranks");
    for (r, o) in out.into_iter().enumerate() {
        let (read, later) = o.expect("rank thread").unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(read.contains("injected failure"), "rank {r}: {read}");
        assert!(later.contains("all_gather") && later.contains("bucket"), "rank {r}: {later}");
    }
}
