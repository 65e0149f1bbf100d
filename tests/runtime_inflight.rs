//! The coordinator's in-flight tracking on a local world: two coordinators on one model, eval
//! after train, a module skipped on one step, an error in the middle of a step, a parameter
//! released twice, ranks that disagree on the plan, collective counts.

use std::sync::Arc;
use std::time::Duration;

use collsched::backend::local::{LocalConfig, LocalRank, LocalWorld};
use collsched::buckets::{DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding};
use collsched::runtime::{ModelState, RuntimeError};
use collsched::schedule::{ParamState, Plan, PolicyKind, ScheduleError, SchedulerConfig};

const SIZES: [usize; 6] = [37, 5, 41, 7, 29, 3];

fn plan(world: u32, sharding: Sharding, bucket_bytes: usize) -> Plan {
    let specs =
        SIZES.iter().enumerate().map(|(k, &n)| ParamSpec::new(format!("p{k}"), [n], DType::F32)).collect();
    let set = ParamSet::new(specs).expect("params");
    Plan::new(
        LayoutBuilder::new(&set, sharding, world)
            .bucket_bytes(bucket_bytes)
            .align(16)
            .build()
            .expect("layout"),
    )
}

fn init() -> Vec<Vec<f32>> {
    SIZES.iter().enumerate().map(|(k, &n)| (0..n).map(|i| (100 * k + i) as f32).collect()).collect()
}

fn ids() -> Vec<ParamId> {
    (0..SIZES.len() as u32).map(ParamId).collect()
}

fn modules() -> [[ParamId; 2]; 3] {
    [[ParamId(0), ParamId(1)], [ParamId(2), ParamId(3)], [ParamId(4), ParamId(5)]]
}

fn config(policy: PolicyKind) -> SchedulerConfig {
    SchedulerConfig { policy, ..SchedulerConfig::default() }
}

/// Runs `f` on every rank of a world of `n` and unwraps every rank's result.
fn on_world<T: Send>(n: usize, f: impl Fn(LocalRank) -> Result<T, RuntimeError> + Sync) -> Vec<T> {
    let world = LocalWorld::with_config(
        n,
        LocalConfig { timeout: Duration::from_secs(30), ..LocalConfig::default() },
    )
    .expect("world");
    world
        .run(f)
        .expect("ranks")
        .into_iter()
        .enumerate()
        .map(|(r, x)| {
            x.unwrap_or_else(|_| panic!("rank {r} panicked")).unwrap_or_else(|e| panic!("rank {r}: {e}"))
        })
        .collect()
}

fn fetch_all(c: &mut collsched::Coordinator<LocalRank>) -> Result<Vec<Vec<f32>>, RuntimeError> {
    let all = ids();
    let v = c.fetch(&all)?;
    let out = all.iter().map(|&p| v.f32(p).map(<[f32]>::to_vec)).collect::<Result<Vec<_>, _>>()?;
    drop(v);
    c.release(&all)?;
    Ok(out)
}

/// One training step: every module fetched and released, gradient `rank + 1` for every
/// element of every parameter, SGD with lr 0.5 on the shards.
fn train_step(c: &mut collsched::Coordinator<LocalRank>, rank: usize) -> Result<(), RuntimeError> {
    for m in modules() {
        c.fetch(&m)?;
        c.release(&m)?;
    }
    for m in modules().iter().rev() {
        c.fetch(m)?;
        for &p in m {
            c.grad_ready_f32(p, &vec![(rank + 1) as f32; SIZES[p.index()]])?;
        }
        c.release(m)?;
    }
    c.end_step()?;
    c.update_shards_f32(|_, _, w, g| w.iter_mut().zip(g).for_each(|(w, g)| *w -= 0.5 * g))?;
    Ok(())
}

/// Expected parameters after `steps` train steps on `world` ranks: each step subtracts
/// 0.5 x the mean of 1..=world.
fn expected(world: usize, steps: usize) -> Vec<Vec<f32>> {
    let mean = (1..=world).map(|r| r as f32).sum::<f32>() / world as f32;
    let mut p = init();
    for _ in 0..steps {
        p.iter_mut().flatten().for_each(|w| *w -= 0.5 * mean);
    }
    p
}

#[test]
fn two_coordinators_share_gathered_buckets() {
    let plan = plan(3, Sharding::EvenSplit, 1 << 20);
    on_world(3, |rank| {
        let state = ModelState::from_f32(Arc::new(rank), &plan, &init())?;
        let mut train = state.coordinator(config(PolicyKind::None))?;
        let mut eval = state.coordinator(config(PolicyKind::None))?;
        let [p0, p1] = modules()[0];
        let a = train.fetch(&[p0])?.f32(p0)?.to_vec();
        assert_eq!(train.counters().all_gathers, 1);
        // The evaluation coordinator uses the bucket the training one gathered.
        let b = eval.fetch(&[p0, p1])?.f32(p0)?.to_vec();
        assert_eq!(a, b);
        assert_eq!(a, init()[0]);
        assert_eq!(eval.counters().all_gathers, 0, "eval gathered a bucket train already had");
        assert_eq!(eval.counters().already_gathered, 1);
        // Train's release does not free what eval still uses.
        train.release(&[p0])?;
        assert_eq!(state.param_state(p0), ParamState::Available { users: 1 });
        assert_eq!(eval.fetch(&[p1])?.f32(p1)?, &init()[1][..]);
        eval.release(&[p0, p1, p1])?;
        assert_eq!(state.param_state(p0), ParamState::NotAvailable);
        assert_eq!(state.live_bytes(), 0);
        train.end_step()?;
        eval.end_step()?;
        Ok(())
    });
}

#[test]
fn eval_after_train_sees_the_updated_parameters() {
    for sharding in [Sharding::EvenSplit, Sharding::Flat, Sharding::Greedy, Sharding::Hybrid(2)] {
        let plan = plan(4, sharding, 256);
        let got = on_world(4, |rank| {
            let r = collsched::backend::Backend::rank(&rank);
            let state = ModelState::from_f32(Arc::new(rank), &plan, &init())?;
            let mut train = state.coordinator(config(PolicyKind::TraceReplay))?;
            let mut eval = state.coordinator(config(PolicyKind::TraceReplay))?;
            let mut evals = Vec::new();
            for _ in 0..3 {
                train_step(&mut train, r)?;
                evals.push(fetch_all(&mut eval)?);
                let stats = eval.end_step()?;
                assert_eq!(stats.schedule.reduce_scatters, 0, "eval reduced");
                assert_eq!(state.live_bytes(), 0);
            }
            Ok(evals)
        });
        for evals in got {
            for (s, e) in evals.iter().enumerate() {
                assert_eq!(e, &expected(4, s + 1), "{sharding}: eval after step {s}");
            }
        }
    }
}

#[test]
fn a_module_skipped_on_one_step_is_drained_not_a_crash() {
    let plan = plan(2, Sharding::Flat, 200);
    on_world(2, |rank| {
        let state = ModelState::from_f32(Arc::new(rank), &plan, &init())?;
        let mut c = state.coordinator(config(PolicyKind::TraceReplay))?;
        for step in 0..4 {
            for (k, m) in modules().iter().enumerate() {
                if step == 2 && k == 1 {
                    continue; // data-dependent control flow: module 1 skipped
                }
                let v = c.fetch(m)?;
                assert_eq!(v.f32(m[0])?, &init()[m[0].index()][..]);
                drop(v);
                c.release(m)?;
            }
            let stats = c.end_step()?;
            if step == 2 {
                let skipped = stats.schedule.drained_params + stats.schedule.discarded_prefetches;
                assert!(skipped > 0, "the prefetched module 1 was neither drained nor discarded: {stats:?}");
            }
            if step == 3 {
                assert!(stats.schedule.prefetch_hits > 0, "trace replay stopped prefetching: {stats:?}");
            }
            assert_eq!(state.live_bytes(), 0, "step {step} left gathered memory");
        }
        Ok(())
    });
}

#[test]
fn an_error_mid_step_changes_nothing_and_the_next_step_is_clean() {
    let plan = plan(2, Sharding::EvenSplit, 256);
    let got = on_world(2, |rank| {
        let r = collsched::backend::Backend::rank(&rank);
        let state = ModelState::from_f32(Arc::new(rank), &plan, &init())?;
        let mut c = state.coordinator(config(PolicyKind::TraceReplay))?;
        train_step(&mut c, r)?;
        // Step 2: errors in the middle.
        let [p0, p1] = modules()[0];
        c.fetch(&[p0, p1])?;
        let e = c.grad_ready_f32(p0, &[1.0; 3]).expect_err("wrong gradient size");
        assert!(matches!(&e, RuntimeError::Param { param: Some(n), .. } if n == "p0"), "{e}");
        assert!(e.to_string().contains("rank"), "{e}");
        let e = c.fetch(&[ParamId(99)]).err().expect("unknown parameter");
        assert!(matches!(e, RuntimeError::Schedule(ScheduleError::UnknownParam { .. })), "{e}");
        c.release(&[p0, p1])?;
        // ... the step goes on as if nothing happened.
        for m in modules().iter().rev() {
            c.fetch(m)?;
            for &p in m {
                c.grad_ready_f32(p, &vec![(r + 1) as f32; SIZES[p.index()]])?;
            }
            c.release(m)?;
        }
        c.end_step()?;
        c.update_shards_f32(|_, _, w, g| w.iter_mut().zip(g).for_each(|(w, g)| *w -= 0.5 * g))?;
        train_step(&mut c, r)?;
        let out = fetch_all(&mut c)?;
        c.end_step()?;
        Ok(out)
    });
    for p in got {
        assert_eq!(p, expected(2, 3));
    }
}

#[test]
fn a_parameter_released_twice_is_a_clear_error_and_state_stays_intact() {
    let plan = plan(2, Sharding::Greedy, 256);
    on_world(2, |rank| {
        let state = ModelState::from_f32(Arc::new(rank), &plan, &init())?;
        let mut c = state.coordinator(config(PolicyKind::None))?;
        let [p0, p1] = modules()[0];
        c.fetch(&[p0, p1])?;
        c.release(&[p0])?;
        let e = c.release(&[p1, p0]).expect_err("second release of p0");
        match &e {
            RuntimeError::Schedule(ScheduleError::NotFetched { name, twice, .. }) => {
                assert_eq!((name.as_str(), *twice), ("p0", true));
            }
            other => panic!("unexpected error {other}"),
        }
        assert!(e.to_string().contains("already released"), "{e}");
        // p1 is still held (the failed release changed nothing) ...
        assert_eq!(state.param_state(p1), ParamState::Available { users: 1 });
        assert_eq!(c.fetch(&[p1])?.f32(p1)?, &init()[1][..]);
        c.release(&[p1, p1])?;
        assert_eq!(state.live_bytes(), 0);
        let stats = c.end_step()?;
        assert!(c.last_report().held.is_empty(), "{:?}", c.last_report());
        assert_eq!(stats.schedule.all_gathers, 1);
        Ok(())
    });
}

#[test]
fn one_step_issues_one_gather_per_bucket_and_one_reduction_per_gradient_bucket() {
    for (sharding, world) in
        [(Sharding::EvenSplit, 3), (Sharding::Flat, 4), (Sharding::Greedy, 3), (Sharding::Hybrid(2), 4)]
    {
        let plan = plan(world as u32, sharding, 200);
        let n_gather = plan.layout().gather_buckets().len() as u64;
        let n_grad = plan.layout().grad_buckets().len() as u64;
        let stages: u64 =
            plan.layout().grad_buckets().iter().map(|b| plan.grad_ops(b.id()).len() as u64).sum();
        let stats = on_world(world, |rank| {
            let r = collsched::backend::Backend::rank(&rank);
            let state = ModelState::from_f32(Arc::new(rank), &plan, &init())?;
            let mut c = state.coordinator(config(PolicyKind::None))?;
            // Each bucket fetched once (all its parameters together), every gradient given.
            for b in plan.layout().gather_buckets() {
                c.fetch(b.params())?;
                for &p in b.params() {
                    c.grad_ready_f32(p, &vec![(r + 1) as f32; SIZES[p.index()]])?;
                }
                c.release(b.params())?;
            }
            c.end_step()
        });
        for s in stats {
            assert_eq!(s.schedule.all_gathers, n_gather, "{sharding}: {s:?}");
            assert_eq!(s.schedule.reduce_scatters, n_grad, "{sharding}: {s:?}");
            assert_eq!(s.collectives(), n_gather + stages, "{sharding}: backend launches {s:?}");
            assert!(s.bytes_moved() > 0 && s.peak_gathered_bytes() > 0);
        }
    }
}

#[test]
fn ranks_with_different_plans_get_a_mismatch_naming_the_bucket() {
    let a = plan(2, Sharding::EvenSplit, 256);
    let b = plan(2, Sharding::EvenSplit, 1 << 20);
    let world = LocalWorld::with_config(
        2,
        LocalConfig { timeout: Duration::from_secs(30), ..LocalConfig::default() },
    )
    .expect("world");
    let results = world
        .run(|rank| {
            let r = collsched::backend::Backend::rank(&rank);
            let p = if r == 0 { &a } else { &b };
            let state = ModelState::from_f32(Arc::new(rank), p, &init())?;
            state.coordinator(SchedulerConfig::default()).map(|_| ())
        })
        .expect("ranks");
    for (r, res) in results.into_iter().enumerate() {
        match res.expect("no panic") {
            Err(RuntimeError::Schedule(ScheduleError::PlanMismatch { rank, peer, bucket, .. })) => {
                assert_eq!((rank as usize, peer as usize), (r, 1 - r));
                assert!(bucket.is_some(), "the first differing bucket is named");
            }
            other => panic!("rank {r}: expected PlanMismatch, got {other:?}"),
        }
    }
}

#[test]
fn no_sync_accumulates_and_the_next_step_reduces() {
    let plan = plan(2, Sharding::Flat, 256);
    let got = on_world(2, |rank| {
        let r = collsched::backend::Backend::rank(&rank);
        let state = ModelState::from_f32(Arc::new(rank), &plan, &init())?;
        let mut c = state.coordinator(config(PolicyKind::TraceReplay))?;
        {
            let mut g = c.no_sync()?;
            for &p in &ids() {
                g.fetch(&[p])?;
                g.grad_ready_f32(p, &vec![(r + 1) as f32; SIZES[p.index()]])?;
                g.release(&[p])?;
            }
            let s = g.end_step()?;
            assert_eq!(s.schedule.reduce_scatters, 0);
            assert_eq!(s.schedule.accumulated_grads, SIZES.len() as u64);
            // Nothing reduced yet: the optimizer hook visits nothing.
            assert_eq!(g.update_shards_f32(|_, _, _, _| panic!("no gradients yet"))?, 0);
        }
        train_step(&mut c, r)?; // adds the fresh gradient to the accumulated one
        let out = fetch_all(&mut c)?;
        c.end_step()?;
        Ok(out)
    });
    for p in got {
        // Two micro-batches of gradient rank+1: mean over ranks of 2 (r + 1) = 3, times 0.5.
        assert_eq!(p, expected(2, 2));
    }
}
