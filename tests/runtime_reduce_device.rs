//! Gradients given in a device backend's memory (`grad_ready_on_device`, one a call or all in
//! one call), reduced and kept there (`take_grad_shards`, `release_grad_shards`), against the
//! same unsharded reference as `tests/runtime_reduce.rs`: on `OnDevice` (the local backend seen
//! as a device) and, ignored without one, on GPUs; and the device gradients refused.

use std::sync::Arc;

use collsched::backend::local::LocalRank;
use collsched::backend::Stream;
use collsched::buckets::{DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding};
use collsched::kernels::ElemType;
use collsched::runtime::{GradRegion, ModelState, RuntimeError};
use collsched::schedule::Plan;

#[path = "support/reduce.rs"]
mod reduce;
use reduce::*;

#[path = "support/device.rs"]
mod device;
use collsched::backend::Backend;
use device::OnDevice;

/// `sharded` with the gradients in the memory of a device backend, one rank of it on `be`: the
/// engine accumulates the micro-batches itself (in the reduction dtype, as the reference does)
/// and hands the sum over in the last one (`grad_ready_on_device`). Step 0's optimizer reads
/// the gradients through `update_shards` (copied to the host), later steps' through
/// `take_grad_shards` (where they are; `read` copies a region to the host; step 1 then
/// gives their memory back, `release_grad_shards`) and write the shards with `write_shard`.
/// `batched`: the last micro-batch fetches every parameter and hands all their gradients in
/// one `grad_ready_many_on_device` call (one pack a bucket).
fn device_rank<B: Backend>(
    case: &Case,
    plan: &Plan,
    refs: &[&[u8]],
    be: B,
    read: &dyn Fn(&B, &GradRegion) -> Vec<u8>,
    batched: bool,
) -> Result<Seen, RuntimeError> {
    let (p, r) = (elem(case.dtype), elem(case.reduce));
    let state = ModelState::new(Arc::new(be), plan, refs)?;
    let be = Arc::clone(state.backend());
    let me = be.rank();
    let mut c = state.coordinator(case.config())?;
    let mut steps = Vec::new();
    for step in 0..STEPS {
        for _ in 0..MICRO - 1 {
            let mut g = c.no_sync()?;
            for k in (0..SIZES.len()).rev() {
                g.fetch(&[ParamId(k as u32)])?;
                g.release(&[ParamId(k as u32)])?;
            }
            g.end_step()?;
        }
        let mut held = Vec::new();
        for k in (0..SIZES.len()).rev() {
            let id = ParamId(k as u32);
            c.fetch(&[id])?;
            if has_grad(case, step, k) {
                let g = |m: usize, i: usize| round(p, grad_value(step, m, me, k, i));
                let sum: Vec<f32> = (0..SIZES[k])
                    .map(|i| (1..MICRO).fold(round(r, g(0, i)), |acc, m| round(r, acc + g(m, i))))
                    .collect();
                let mut buf = be.alloc(SIZES[k] * r.size()).map_err(backend)?;
                be.write_from_host(&mut buf, 0, &encode(r, &sum)).map_err(backend)?;
                if batched {
                    held.push((id, buf));
                    continue;
                }
                c.grad_ready_on_device(id, &buf)?;
                be.free(buf, Some(&be.record(Stream::Compute).map_err(backend)?));
            }
            if !batched {
                c.release(&[id])?;
            }
        }
        if batched {
            let lent: Vec<(ParamId, &B::Buffer)> = held.iter().map(|(id, b)| (*id, b)).collect();
            c.grad_ready_many_on_device(&lent)?;
            let after = be.record(Stream::Compute).map_err(backend)?;
            for (_, b) in held {
                be.free(b, Some(&after));
            }
            let all: Vec<ParamId> = (0..SIZES.len() as u32).rev().map(ParamId).collect();
            c.release(&all)?;
        }
        c.end_step()?;
        let mut seen = Vec::new();
        if step == 0 {
            c.update_shards(sgd_hook(&mut seen))?;
        } else {
            c.take_grad_shards(|g| {
                assert_eq!(g.device, be.device(), "a gradient given on the device left it");
                seen.push((g.param.index(), g.param_offset, decode(g.elem, &read(&be, &g))));
            })?;
            if step == 1 {
                // Their memory back to the pool now: the next step's reductions land elsewhere.
                c.release_grad_shards()?;
            }
            for (k, off, g) in &seen {
                state.write_shard(ParamId(*k as u32), |at, w| {
                    assert_eq!(at, *off);
                    let new: Vec<f32> = decode(p, w).iter().zip(g).map(|(x, g)| x - LR * g).collect();
                    w.copy_from_slice(&encode(p, &new));
                })?;
            }
        }
        steps.push(seen);
    }
    let all: Vec<ParamId> = (0..SIZES.len() as u32).map(ParamId).collect();
    let v = c.fetch(&all)?;
    let mut fin = Vec::new();
    for &id in &all {
        let mut host = vec![0; SIZES[id.index()] * p.size()];
        v.copy_to_host(id, &mut host)?;
        fin.push(decode(p, &host));
    }
    drop(v);
    c.release(&all)?;
    c.end_step()?;
    Ok((steps, fin))
}

#[test]
fn device_gradients_given_back_unread_are_not_handed_out() {
    let case = Case::f32_even(2);
    let plan = case.plan();
    let bytes = case.init_bytes();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let out = world(2)
        .run(|rank| -> Result<(usize, usize), RuntimeError> {
            let state = ModelState::new(Arc::new(OnDevice(rank)), &plan, &refs)?;
            let be = Arc::clone(state.backend());
            let mut c = state.coordinator(case.config())?;
            for k in (0..SIZES.len()).rev() {
                let id = ParamId(k as u32);
                c.fetch(&[id])?;
                let g: Vec<f32> = (0..SIZES[k]).map(|i| grad_value(0, 0, be.rank(), k, i)).collect();
                let mut buf = be.alloc(SIZES[k] * 4).map_err(backend)?;
                be.write_from_host(&mut buf, 0, &encode(ElemType::F32, &g)).map_err(backend)?;
                c.grad_ready_on_device(id, &buf)?;
                be.free(buf, Some(&be.record(Stream::Compute).map_err(backend)?));
                c.release(&[id])?;
            }
            c.end_step()?;
            c.release_grad_shards()?;
            let taken = c.take_grad_shards(|_| ())?;
            let updated = c.update_shards(|_| ())?;
            Ok((taken, updated))
        })
        .expect("ranks");
    for (r, res) in out.into_iter().enumerate() {
        let (taken, updated) = res.expect("rank thread").unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!((taken, updated), (0, 0), "rank {r}: gradients given back were handed out again");
    }
}

/// [`device_rank`] on every rank of `case`'s world of `OnDevice` local ranks.
fn sharded_on_device(case: &Case, batched: bool) -> Vec<Seen> {
    let plan = case.plan();
    let bytes = case.init_bytes();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let read = |_: &OnDevice<LocalRank>, g: &GradRegion| {
        // SAFETY: OnDevice's device addresses are the local backend's host addresses; the
        // region is valid until the next call into the coordinator.
        unsafe { std::slice::from_raw_parts(g.ptr, g.numel * g.elem.size()) }.to_vec()
    };
    let results = world(case.world)
        .run(|rank| device_rank(case, &plan, &refs, OnDevice(rank), &read, batched))
        .expect("ranks");
    each_rank(case, results, " on a device backend")
}

#[test]
fn gradients_given_on_a_device_match_the_reference_and_stay_there() {
    // Every strategy; f32, and bf16 parameters reduced in f32; a parameter without a gradient.
    for world in [1, 2, 3, 4] {
        for (k, sharding) in strategies(world).into_iter().enumerate() {
            let (dtype, reduce) = [(DType::F32, DType::F32), (DType::BF16, DType::F32)][k % 2];
            let case = Case { dtype, reduce, world, sharding, pre: None, post: None, missing: world == 3 };
            check_runs(&case, &sharded_on_device(&case, false));
        }
    }
}

#[test]
fn gradients_given_on_a_device_in_one_call_match_the_reference() {
    // As above, every gradient of the step in one call: buckets fill during the call (their
    // packs go before their reductions) and after it.
    for world in [1, 2, 3, 4] {
        for (k, sharding) in strategies(world).into_iter().enumerate() {
            let (dtype, reduce) = [(DType::F32, DType::F32), (DType::BF16, DType::F32)][k % 2];
            let case = Case { dtype, reduce, world, sharding, pre: None, post: None, missing: world == 3 };
            check_runs(&case, &sharded_on_device(&case, true));
        }
    }
}

/// The same on GPUs (one per rank, NCCL): exact at 1 and 2 ranks, where NCCL's f32 sum is one
/// addition (see `tests/gpu_demo.rs`).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only (fails without a device)"]
fn gradients_given_on_gpus_match_the_reference_and_stay_there() {
    use collsched::backend::cuda::{CudaBackend, CudaBuffer, CudaWorld};
    let n = gpu::gpus("gradients_given_on_gpus_match_the_reference_and_stay_there", 2);
    // One gradient a call, and every gradient of a step in one call (one pack a bucket).
    for (world, batched) in (1..=n).flat_map(|w| [(w, false), (w, true)]) {
        for (k, sharding) in [Sharding::EvenSplit, Sharding::Flat, Sharding::Greedy].into_iter().enumerate() {
            let (dtype, reduce) = [(DType::F32, DType::F32), (DType::BF16, DType::F32)][k % 2];
            let case = Case { dtype, reduce, world, sharding, pre: None, post: None, missing: k == 2 };
            let plan = case.plan();
            let bytes = case.init_bytes();
            let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
            let read = |be: &CudaBackend, g: &GradRegion| {
                let mut host = vec![0; g.numel * g.elem.size()];
                // SAFETY: the region is device memory of this rank, valid until the next call
                // into the coordinator; the view is dropped before that.
                let view = unsafe { CudaBuffer::from_raw(g.ptr as u64, host.len()) };
                be.read_to_host(&view, 0, &mut host).expect("gradient region to the host");
                host
            };
            let results = CudaWorld::new(world)
                .expect("CUDA world")
                .run(|be| device_rank(&case, &plan, &refs, be, &read, batched))
                .expect("ranks");
            let ranks = each_rank(&case, results, &format!(" on a GPU (batched: {batched})"));
            check_runs(&case, &ranks);
        }
    }
}

#[cfg(feature = "cuda")]
#[path = "support/gpu.rs"]
mod gpu;

#[test]
fn device_gradients_under_no_sync_mixed_with_host_ones_or_short_are_refused() {
    let case = Case {
        dtype: DType::F32,
        reduce: DType::F32,
        world: 2,
        sharding: Sharding::Flat,
        pre: None,
        post: None,
        missing: false,
    };
    // One bucket for every parameter.
    let specs =
        SIZES.iter().enumerate().map(|(k, &n)| ParamSpec::new(format!("p{k}"), [n], DType::F32)).collect();
    let set = ParamSet::new(specs).expect("params");
    let plan =
        Plan::new(LayoutBuilder::new(&set, Sharding::Flat, 2).bucket_bytes(4096).build().expect("layout"));
    let bytes: Vec<Vec<u8>> = case.init().iter().map(|v| encode(ElemType::F32, v)).collect();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let out = world(2)
        .run(|rank| -> Result<Vec<String>, RuntimeError> {
            let state = ModelState::new(Arc::new(OnDevice(rank)), &plan, &refs)?;
            let be = Arc::clone(state.backend());
            let mut c = state.coordinator(case.config())?;
            let mut errors = Vec::new();
            let (a, b) = (ParamId(0), ParamId(1));
            let buf = |n: usize| -> Result<_, RuntimeError> {
                let mut x = be.alloc(n * 4).map_err(backend)?;
                be.write_from_host(&mut x, 0, &vec![0; n * 4]).map_err(backend)?;
                Ok(x)
            };
            let (ga, short) = (buf(SIZES[0])?, buf(SIZES[0] - 1)?);
            {
                let mut g = c.no_sync()?;
                g.fetch(&[a])?;
                errors.push(g.grad_ready_on_device(a, &ga).expect_err("under no_sync").to_string());
                g.release(&[a])?;
                g.end_step()?;
            }
            c.fetch(&[a, b])?;
            errors.push(c.grad_ready_on_device(a, &short).expect_err("short").to_string());
            c.grad_ready(a, &vec![0; SIZES[0] * 4])?;
            let gb = buf(SIZES[1])?;
            errors.push(c.grad_ready_on_device(b, &gb).expect_err("mixed").to_string());
            // Refused before anything changed: the same gradient given on the host is taken
            // (a gradient counted and then dropped would make this a second one).
            c.grad_ready(b, &vec![0; SIZES[1] * 4])?;
            c.release(&[a, b])?;
            c.end_step()?;
            for x in [ga, short, gb] {
                be.free(x, None);
            }
            Ok(errors)
        })
        .expect("ranks");
    for r in out {
        let errors = r.expect("rank thread").expect("rank");
        assert!(errors[0].contains("no_sync") && errors[0].contains("p0"), "{}", errors[0]);
        assert!(errors[1].contains("p0") && errors[1].contains("expected"), "{}", errors[1]);
        assert!(errors[2].contains("other kind") && errors[2].contains("bucket"), "{}", errors[2]);
    }
}
