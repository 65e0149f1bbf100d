//! Host reads and writes of the shards a device backend keeps are ordered against every
//! stream that touches them: a write (and the read of a read-modify-write) waits for the
//! compute stream (the optimizer writes shards there) and for the all-gather stream (a gather
//! copies shards in there); a read waits for the compute stream. Run on `OnDevice` (the local
//! backend seen as a device), logged (`Logged`) to see which fences come before the copies.

use std::sync::Arc;
use std::time::Duration;

use collsched::backend::local::{LocalConfig, LocalWorld};
use collsched::backend::Stream;
use collsched::buckets::{DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding};
use collsched::runtime::{ModelState, RuntimeError};
use collsched::schedule::{Plan, PolicyKind, SchedulerConfig};

#[path = "support/device.rs"]
mod device;
use device::{Call, Logged, OnDevice};

const SIZES: [usize; 3] = [37, 20, 11];

fn values() -> Vec<Vec<f32>> {
    SIZES
        .iter()
        .enumerate()
        .map(|(k, &n)| (0..n).map(|i| (k * 100 + i) as f32 * 0.25 - 3.0).collect())
        .collect()
}

fn ids() -> Vec<ParamId> {
    (0..SIZES.len() as u32).map(ParamId).collect()
}

fn plan(world: u32) -> Plan {
    let specs =
        SIZES.iter().enumerate().map(|(k, &n)| ParamSpec::new(format!("p{k}"), [n], DType::F32)).collect();
    let set = ParamSet::new(specs).expect("params");
    Plan::new(
        LayoutBuilder::new(&set, Sharding::EvenSplit, world).bucket_bytes(4096).build().expect("layout"),
    )
}

fn world(n: usize, timeout: Duration) -> LocalWorld {
    LocalWorld::with_config(n, LocalConfig { timeout, ..LocalConfig::default() }).expect("world")
}

fn no_prefetch() -> SchedulerConfig {
    SchedulerConfig { policy: PolicyKind::None, ..SchedulerConfig::default() }
}

/// What `write_shard`, `read_shard` and `update_shards` each asked of the backend.
type Logs = (Vec<Call>, Vec<Call>, Vec<Call>);

/// The calls before the first host write in `log` (there must be one).
fn before_first_write(log: &[Call]) -> &[Call] {
    let at = log.iter().position(|c| matches!(c, Call::Write(_))).expect("no host write in the log");
    &log[..at]
}

#[test]
fn a_host_write_of_a_device_shard_is_fenced_on_every_stream_that_touches_it() {
    let init = values();
    let ids = ids();
    let plan = plan(2);
    let out = world(2, Duration::from_secs(30))
        .run(|rank| -> Result<Logs, RuntimeError> {
            let state = ModelState::from_f32(Arc::new(Logged::new(OnDevice(rank))), &plan, &init)?;
            let mut c = state.coordinator(no_prefetch())?;
            // One step: the gathers copy the shards in on the all-gather stream; a host
            // gradient for every parameter, so that the optimizer hook has work.
            c.fetch(&ids)?;
            for (&p, &n) in ids.iter().zip(&SIZES) {
                c.grad_ready(p, &vec![0; n * 4])?;
            }
            c.release(&ids)?;
            c.end_step()?;
            let be = Arc::clone(state.backend());
            let _ = be.take();
            state.write_shard(ids[0], |_, b| b.fill(0))?;
            let write = be.take();
            state.read_shard(ids[1], |_, b| b.len())?;
            let read = be.take();
            c.update_shards_f32(|_, _, values, _| values.fill(1.0))?;
            let update = be.take();
            Ok((write, read, update))
        })
        .expect("ranks");
    for (r, o) in out.into_iter().enumerate() {
        let (write, read, update) = o.expect("rank thread").unwrap_or_else(|e| panic!("rank {r}: {e}"));
        for (what, log) in [("write_shard", &write), ("update_shards", &update)] {
            let fences = before_first_write(log);
            for s in [Stream::Compute, Stream::AllGather] {
                assert!(
                    fences.contains(&Call::Record(s)),
                    "rank {r}: {what} wrote a shard back without waiting for the {s} stream (it copies shards \
                     in or writes them): {log:?}"
                );
            }
            let first_read = log.iter().position(|c| matches!(c, Call::Read(_)));
            let last_fence = log.iter().rposition(|c| matches!(c, Call::Record(_)));
            assert!(
                first_read.is_some_and(|fr| last_fence.is_some_and(|lf| lf < fr)),
                "rank {r}: {what}: the device shard was read back before the fences: {log:?}"
            );
        }
        let at = read.iter().position(|c| matches!(c, Call::Read(_))).expect("read_shard read nothing");
        assert!(
            read[..at].contains(&Call::Record(Stream::Compute)),
            "rank {r}: read_shard read a shard without waiting for the compute stream: {read:?}"
        );
    }
}
