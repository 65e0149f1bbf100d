//! A one-rank loopback `Backend` for tests and benches of the driver and coordinator: collectives
//! of a group of one run synchronously at launch (a copy, or a reduction of one input), buffers
//! are pooled by exact capacity, and nothing allocates in steady state, so what a test or bench
//! measures is the driver, the coordinator and the scheduler. Included with `#[path]` by
//! `tests/runtime_alloc.rs` and `benches/coordinator.rs` (files under `tests/support/` are not
//! test targets of their own).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use collsched::backend::CollectiveKind;
use collsched::backend::{
    Backend, BackendBuffer, BackendError, BackendEvent, Collective, InFlight, LaunchError, OnDrop, Stream,
};
use collsched::kernels::{reduce, ReduceOp};

/// A host buffer.
#[derive(Debug)]
pub struct Buf(pub Vec<u8>);

impl BackendBuffer for Buf {
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// An event that is always complete.
#[derive(Clone, Debug)]
pub struct Done;

impl BackendEvent for Done {
    fn query(&self) -> Result<bool, BackendError> {
        Ok(true)
    }
    fn wait(&self, _: Duration) -> Result<(), BackendError> {
        Ok(())
    }
}

/// One rank, collectives run at launch, buffers pooled by exact capacity (like the local
/// backend's size classes).
pub struct Loopback {
    pool: Arc<Mutex<Vec<Vec<u8>>>>,
    on_drop: OnDrop<Loopback>,
}

impl Loopback {
    /// A fresh rank with an empty pool.
    pub fn new() -> Self {
        let pool = Arc::new(Mutex::new(Vec::with_capacity(1024)));
        let p = Arc::clone(&pool);
        let on_drop: OnDrop<Loopback> = Arc::new(move |ops: Vec<Collective<Buf>>, _: &Done| {
            let mut p = p.lock().unwrap();
            for c in ops {
                p.extend(c.input.map(|b| b.0));
                p.push(c.output.0);
            }
        });
        Loopback { pool, on_drop }
    }
}

impl Backend for Loopback {
    type Buffer = Buf;
    type Event = Done;

    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn timeout(&self) -> Duration {
        Duration::from_secs(5)
    }
    fn alloc(&self, bytes: usize) -> Result<Buf, BackendError> {
        let mut p = self.pool.lock().unwrap();
        let mut v = match p.iter().position(|v| v.capacity() == bytes) {
            Some(i) => p.swap_remove(i),
            None => Vec::with_capacity(bytes),
        };
        v.clear();
        v.resize(bytes, 0);
        Ok(Buf(v))
    }
    fn free(&self, buffer: Buf, _: Option<&Done>) {
        self.pool.lock().unwrap().push(buffer.0);
    }
    fn write_from_host(&self, buffer: &mut Buf, offset: usize, src: &[u8]) -> Result<(), BackendError> {
        buffer.0[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }
    fn read_to_host(&self, buffer: &Buf, offset: usize, dst: &mut [u8]) -> Result<(), BackendError> {
        dst.copy_from_slice(&buffer.0[offset..offset + dst.len()]);
        Ok(())
    }
    fn host_bytes<'a>(&self, buffer: &'a Buf) -> Option<&'a [u8]> {
        Some(&buffer.0)
    }
    fn record(&self, _: Stream) -> Result<Done, BackendError> {
        Ok(Done)
    }
    fn wait_event(&self, _: Stream, _: &Done) -> Result<(), BackendError> {
        Ok(())
    }
    fn launch_group(
        &self,
        _: Stream,
        _: &[Done],
        mut ops: Vec<Collective<Buf>>,
    ) -> Result<InFlight<Self>, LaunchError<Buf>> {
        for c in &mut ops {
            let d = &c.desc;
            let n = d.count * d.elem.size();
            let input = c.input.as_ref().map_or(&[][..], |b| &b.0[..n]);
            match d.kind {
                CollectiveKind::ReduceScatter | CollectiveKind::AllReduce => {
                    reduce(d.elem, ReduceOp::Sum, d.scaling, &mut c.output.0[..n], &[input]).unwrap();
                }
                _ => c.output.0[..n].copy_from_slice(input),
            }
        }
        Ok(InFlight::new(ops, Done, Arc::clone(&self.on_drop)))
    }
}

impl collsched::backend::ondevice::HostStreams for Loopback {
    /// Everything here completes at once: the work runs now.
    fn run_on(&self, _: Stream, work: collsched::backend::ondevice::HostWork) -> Result<Done, BackendError> {
        work().map(|()| Done)
    }
}
