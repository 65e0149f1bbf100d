//! The `zero3-2021` policy ([`Policy::Zero3_2021`](super::Policy::Zero3_2021)): a training step
//! as DeepSpeed ZeRO-3 ran it before its fetches were batched (v0.5.4, the code DeepSpeed PR
//! #1453 measured as "before"), each behaviour read from that code
//! (`docs/notes/deepspeed-zero3-2021.md`, behaviours B1-B17) and each cost a named constant of
//! [`collsched_topo::constants`] with its source.
//!
//! What the step does, per fetch unit (a layer of the workload):
//! - **B1, B8**: one all-gather per non-persistent parameter, launched when the layer is
//!   fetched, never ahead (the 2021 prefetch was disabled by its off-by-one step counter; a
//!   prefetch it did launch would also wait on the compute before it, B2). Under activation
//!   checkpointing the recompute fetches and releases the layer again, so a recomputed layer is
//!   gathered three times a step. Parameters under
//!   [`ZERO3_2021_PERSISTENCE_THRESHOLD`](k::ZERO3_2021_PERSISTENCE_THRESHOLD) elements are
//!   persistent: never gathered in a step, never released.
//! - **B2**: before each all-gather, `torch.cuda.synchronize()`: the host waits for every
//!   collective the rank launched, then pays the measured host time of `_allgather_param`
//!   ([`ZERO3_2021_GATHER_PRE_LAUNCH_S`](k::ZERO3_2021_GATHER_PRE_LAUNCH_S) +
//!   [`ZERO3_2021_LIST_LAUNCH_S`](k::ZERO3_2021_LIST_LAUNCH_S)).
//! - **B3, B4, B5**: the all-gather's stream also runs a memset of the gathered buffer, the
//!   shard's copy into its slot and the list form's copy of the gathered bytes back into the
//!   caller's tensors, at [`A100_HBM_COPY_GBS`](k::A100_HBM_COPY_GBS).
//! - **B7**: after the fetch, `_synchronize_communication` drains the device (two syncs).
//! - **B6**: `param.norm()` and its `.item()` for every parameter of the fetched layer,
//!   persistent ones included: two eager ops, a sync, a read of the parameter.
//! - **B9**: each released parameter is replaced by `torch.ones(1).to(device)`: an eager op
//!   and a blocking copy (a sync).
//! - **B11, B14**: each gradient is copied into the ipg bucket and its partition copied out; a
//!   bucket flush every [`ZERO3_2021_REDUCE_BUCKET_ELEMENTS`](k::ZERO3_2021_REDUCE_BUCKET_ELEMENTS)
//!   elements runs `div_` over the whole bucket and two stream syncs (B13).
//! - **B12**: one list-form reduce-scatter per gradient, its launch priced as the all-gather's
//!   and its stream also copying the gradient into c10d's flat input.
//! - **B16**: the optimizer step's grad norm and overflow check, one `.item()` each per
//!   parameter.
//!
//! Not modelled, for want of a published figure (each would only lengthen the step): per-hook
//! Python work beyond the above (B10), allocator churn and flushes (B15, B17).

use collsched_buckets::{ParamId, ParamSet};
use collsched_topo::constants as k;

use super::report::SpanKind;
use super::step::{Call, StepProgram};
use super::workload::Workload;

/// Host nanoseconds of one all-gather launch (B2: pre-launch + list-form launch).
pub(crate) fn gather_host_ns() -> u64 {
    ((k::ZERO3_2021_GATHER_PRE_LAUNCH_S + k::ZERO3_2021_LIST_LAUNCH_S) * 1e9).round() as u64
}

/// Host nanoseconds of one reduce-scatter launch (B12).
pub(crate) fn reduce_host_ns() -> u64 {
    (k::ZERO3_2021_LIST_LAUNCH_S * 1e9).round() as u64
}

/// Seconds to move `bytes` of device memory traffic.
fn hbm_s(bytes: f64) -> f64 {
    bytes / (k::A100_HBM_COPY_GBS * 1e9)
}

/// Device seconds an all-gather's stream spends besides the collective, for `full` gathered
/// bytes over `world` ranks: the memset (B3), the shard copy (B5) and the list form's copy
/// back (B4).
pub(crate) fn gather_device_s(full: f64, world: u32) -> f64 {
    hbm_s(full + 2.0 * full / f64::from(world.max(1)) + 2.0 * full)
}

/// Device seconds a reduce-scatter's stream spends besides the collective: the list form's
/// copy of the `full` gradient bytes into c10d's flat input (B12).
pub(crate) fn reduce_device_s(full: f64) -> f64 {
    hbm_s(2.0 * full)
}

/// Whether `p` is gathered at every fetch (not persistent).
pub(crate) fn fetched(set: &ParamSet, p: ParamId) -> bool {
    set.numel(p) as u64 >= k::ZERO3_2021_PERSISTENCE_THRESHOLD
}

/// The program of one step: `all` is every layer's parameters, `fetch` the non-persistent
/// ones; `fwd`/`bwd` the layer orders; `last_use[p]` the backward position after which `p`'s
/// gradient is ready.
pub(crate) fn step_program(
    workload: &Workload,
    set: &ParamSet,
    (all, fetch): (&[Vec<ParamId>], &[Vec<ParamId>]),
    (fwd, bwd): (&[u32], &[u32]),
    last_use: &[u32],
    ns_per_flop: f64,
    world: u32,
) -> StepProgram {
    // Device work the host waits for at once (a norm before its `.item()`, a copy or `div_`
    // that the next drain waits for) is priced on the host timeline: nothing runs beside it.
    const NS: f64 = 1e9;
    let op = k::PYTORCH_EAGER_OP_S * NS;
    let sync = k::HOST_DEVICE_SYNC_S * NS;
    let bytes = |p: ParamId| set.numel(p) as f64 * set.get(p).map_or(2, |s| s.dtype.size()) as f64;
    let mut s = StepProgram::default();
    // A layer's pre-forward hooks: the per-parameter gathers (B1, B2), the drain (B7), the
    // norms of every parameter (B6).
    let fetch_hooks = |s: &mut StepProgram, l: u32| {
        let li = l as usize;
        if !fetch[li].is_empty() {
            s.push(Call::Fetch(l), 0.0, 0);
            s.push(Call::Drain, 2.0 * sync, 2);
        }
        let n = all[li].len() as u32;
        if n > 0 {
            let read: f64 = all[li].iter().map(|&p| bytes(p)).sum();
            s.push(Call::Host(l), f64::from(n) * (2.0 * op + sync) + hbm_s(read) * NS, n);
        }
    };
    // A layer's release (B9).
    let release = |s: &mut StepProgram, l: u32| {
        let li = l as usize;
        if !fetch[li].is_empty() {
            s.push(Call::Release(l), 0.0, 0);
            let n = fetch[li].len() as u32;
            s.push(Call::Host(l), f64::from(n) * (op + sync), n);
        }
    };
    s.push(Call::Phase { backward: false }, 0.0, 0);
    for &l in fwd {
        fetch_hooks(&mut s, l);
        s.push(
            Call::Compute(l, SpanKind::Forward),
            workload.layers[l as usize].forward_flops * ns_per_flop,
            0,
        );
        release(&mut s, l);
    }
    s.outside(SpanKind::Loss, workload.loss_flops, ns_per_flop);
    s.push(Call::Phase { backward: true }, 0.0, 0);
    let world = f64::from(world.max(1));
    let mut in_bucket = 0u64;
    let bucket_traffic = 2.0 * k::ZERO3_2021_REDUCE_BUCKET_ELEMENTS as f64;
    let mut n_trainable = 0u32;
    for (pos, &l) in bwd.iter().enumerate() {
        let layer = &workload.layers[l as usize];
        if layer.recompute_flops > 0.0 {
            fetch_hooks(&mut s, l);
            s.push(Call::Compute(l, SpanKind::Recompute), layer.recompute_flops * ns_per_flop, 0);
            release(&mut s, l);
        }
        fetch_hooks(&mut s, l);
        s.push(Call::Compute(l, SpanKind::Backward), layer.backward_flops * ns_per_flop, 0);
        let ready: Vec<ParamId> = all[l as usize]
            .iter()
            .copied()
            .filter(|&p| last_use[p.index()] == pos as u32 && set.is_trainable(p))
            .collect();
        if !ready.is_empty() {
            // B11 copy into the ipg bucket, B14 copy of the rank's partition out of it, B13
            // flushes (each with `div_` over the whole bucket).
            let mut host = 0.0;
            let mut syncs = 0;
            for &p in &ready {
                let b = bytes(p);
                let elem = set.get(p).map_or(2, |s| s.dtype.size()) as f64;
                let numel = set.numel(p) as u64;
                if in_bucket > 0 && in_bucket + numel > k::ZERO3_2021_REDUCE_BUCKET_ELEMENTS {
                    host += 2.0 * sync + op + hbm_s(bucket_traffic * elem) * NS;
                    syncs += 2;
                    in_bucket = 0;
                }
                in_bucket += numel;
                host += 2.0 * op + hbm_s(2.0 * b + 2.0 * b / world) * NS;
                n_trainable += 1;
            }
            s.push(Call::Host(l), host, syncs);
            for p in ready {
                s.push(Call::Grad(p), 0.0, 0);
            }
        }
        release(&mut s, l);
    }
    // The epilogue's last flush (B13: its two syncs, its `div_`) and its stream sync, then the
    // optimizer's two `.item()`s per parameter (B16), each after two eager ops.
    let last = bwd.last().copied().unwrap_or(0);
    let elem = set.specs().first().map_or(2, |s| s.dtype.size()) as f64;
    s.push(
        Call::Host(last),
        3.0 * sync
            + op
            + hbm_s(bucket_traffic * elem) * NS
            + f64::from(n_trainable) * 2.0 * (2.0 * op + sync),
        3 + 2 * n_trainable,
    );
    s.push(Call::EndStep, 0.0, 0);
    s.outside(SpanKind::Update, workload.update_flops, ns_per_flop);
    s
}
