//! GPU tests of the CUDA backend's host-side ordering and bounds: host copies wait for the
//! rank's other streams, kernel tables go through pinned staging whose blocks are never reused
//! while a copy reads them, and teardown ends (leaking) when a stream never drains.
//!
//! They run only with `COLLSCHED_GPU=1` and a CUDA device (and NCCL: `COLLSCHED_NCCL_LIB`), by
//! `cargo nextest run --all-features --run-ignored only`; see `tests/support/gpu.rs`.
#![cfg(feature = "cuda")]

use std::time::Duration;

use collsched::backend::cuda::{comms, CudaBackend, CudaConfig, UniqueId};
use collsched::backend::{Backend, BackendEvent, Stream};
use collsched_kernels::{copy_in, CopySegment};

#[path = "support/gpu.rs"]
mod gpu;
#[path = "support/hold.rs"]
mod hold;
use hold::{block_stream, STALLED};

const WAIT: Duration = Duration::from_secs(60);

/// A one-rank backend on device 0 with the given timeout.
fn single(timeout: Duration) -> CudaBackend {
    let id = UniqueId::generate().expect("ncclGetUniqueId (is COLLSCHED_NCCL_LIB set?)");
    CudaBackend::new(CudaConfig { timeout, ..CudaConfig::new(0, 1, 0) }, &id).expect("one-rank CUDA backend")
}

#[test]
#[ignore = "needs a GPU: COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only (fails without a device)"]
fn gpu_host_copies_wait_for_the_rank_s_other_streams() {
    gpu::gpus("gpu_host_copies_wait_for_the_rank_s_other_streams", 1);
    // A short timeout: a host copy behind a held stream gives up instead of reading early.
    let b = single(Duration::from_secs(1));
    let n = 1 << 16;
    let mut buf = b.alloc(n).unwrap();
    b.write_from_host(&mut buf, 0, &vec![0xAB; n]).unwrap();
    for s in [Stream::AllGather, Stream::ReduceScatter, Stream::Compute] {
        let go = block_stream(&b, s);
        // Work queued on `s` that writes the buffer: a read must see it, not what was before.
        b.zero(s, &mut buf, 0, n).unwrap();
        let mut host = vec![0u8; n];
        let early = b.read_to_host(&buf, 0, &mut host);
        let e = early.expect_err("a host read went ahead of a stream still to write the buffer");
        assert!(e.to_string().contains(&format!("the {s} stream")), "{s}: {e}");
        let w = b.write_from_host(&mut buf, 0, &vec![0xCD; n]);
        assert!(w.is_err(), "{s}: a host write went ahead of a stream still to write the buffer");
        go.send(()).expect(STALLED);
        b.synchronize(s, WAIT).unwrap();
        b.read_to_host(&buf, 0, &mut host).unwrap();
        assert!(host.iter().all(|&x| x == 0), "{s}: the read does not see the stream's write");
        b.write_from_host(&mut buf, 0, &vec![0xAB; n]).unwrap();
    }
}

#[test]
#[ignore = "needs a GPU: COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only (fails without a device)"]
fn gpu_kernel_tables_go_through_pinned_staging_reused_only_after_their_copies() {
    gpu::gpus("gpu_kernel_tables_go_through_pinned_staging_reused_only_after_their_copies", 1);
    let b = single(WAIT);
    let n = 4099usize;
    let values: Vec<u8> = (0..n as u32).flat_map(|x| (x as f32).to_le_bytes()).collect();
    let mut src = b.alloc(n * 4).unwrap();
    b.write_from_host(&mut src, 0, &values).unwrap();
    let pieces = 64usize;
    // Copy-in `k` packs a different run of `src` (its table differs from every other's).
    let segment = |k: usize| CopySegment { buffer: 0, buffer_offset: k * 7, packed_offset: 0, len: 1000 + k };
    let want = |k: usize| {
        let mut out = vec![0u8; (1000 + k) * 4];
        copy_in(&mut out, &[&values], &[segment(k)], 4).unwrap();
        out
    };
    let run = |b: &CudaBackend, held: bool| {
        let outs: Vec<_> = (0..pieces).map(|k| b.alloc((1000 + k) * 4).unwrap()).collect();
        // With the stream held, every copy is pending at once: no staging block may be reused.
        let go = held.then(|| block_stream(b, Stream::Compute));
        let mut last = None;
        for (k, out) in outs.iter().enumerate() {
            last = Some(b.copy_in(Stream::Compute, out, &[&src], &[segment(k)], 4).unwrap());
        }
        if let Some(go) = go {
            go.send(()).expect(STALLED);
        }
        last.unwrap().wait(WAIT).unwrap();
        for (k, out) in outs.iter().enumerate() {
            let mut host = vec![0u8; out.len()];
            b.read_to_host(out, 0, &mut host).unwrap();
            assert_eq!(host, want(k), "copy-in {k} packed the wrong run: its table was overwritten");
        }
    };
    // Warm-up, before any stream is held: the first launch of a kernel may still do one-time
    // work in the driver (the kernels themselves were loaded when the backend was built).
    let warm_out = b.alloc(1000 * 4).unwrap();
    b.copy_in(Stream::Compute, &warm_out, &[&src], &[segment(0)], 4).unwrap().wait(WAIT).unwrap();
    let warm = b.staging_blocks();
    assert!(warm >= 1, "the warm-up's table went through no staging block");
    run(&b, true);
    let held = b.staging_blocks();
    // All pending at once: a block each, the warm-up's (idle again) reused, the rest new.
    let added = held - warm;
    assert!(
        held >= pieces as u64 && added <= pieces as u64,
        "{held} staging blocks ({added} new after the warm-up's {warm}) for {pieces} copies pending at once"
    );
    run(&b, true);
    assert_eq!(b.staging_blocks(), held, "the blocks of completed copies were not reused");
    run(&b, false);
    assert_eq!(b.staging_blocks(), held, "steady state allocated pinned memory");
}

#[test]
#[ignore = "needs a GPU: COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only (fails without a device)"]
fn gpu_teardown_with_a_stream_that_never_drains_ends_and_leaks() {
    gpu::gpus("gpu_teardown_with_a_stream_that_never_drains_ends_and_leaks", 1);
    let b = single(Duration::from_secs(1));
    let buf = b.alloc(1 << 20).unwrap();
    let go = block_stream(&b, Stream::AllGather);
    let pending = b.record(Stream::AllGather).unwrap();
    b.free(buf, Some(&pending));
    // Returns (after the timeout, the abort and its grace) instead of waiting for the stream.
    drop(b);
    assert!(!pending.query().unwrap_or(false), "the held stream drained by itself");
    // The gate is still closed: the drop returned by itself, not because the stream let go.
    go.send(()).expect(STALLED);
    // The aborts it started ran on threads of their own (ncclCommAbort may wait for the held
    // stream); they end once it let go, before the process exits.
    assert!(
        comms::wait_for_aborts(WAIT),
        "{} aborts still running after the stream let go",
        comms::aborts_running()
    );
}
