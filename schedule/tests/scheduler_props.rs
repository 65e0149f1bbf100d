//! Property tests of the scheduler over random engine event sequences: no buffer is freed
//! while a user holds it, the budgets hold, every launched gather is consumed or drained, and
//! the launches do not depend on completion timing.

mod common;

use std::collections::{BTreeMap, HashMap};

use collsched_schedule::buckets::{BucketId, ParamId};
use collsched_schedule::{
    Action, EngineEvent, Event, InflightRegistry, LaunchId, Plan, PolicyKind, Role, Scheduler,
    SchedulerConfig,
};
use common::*;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Step {
    Fetch(Vec<usize>),
    Release(usize),
    ReleaseAll,
    Grad(usize),
    Done(usize),
    End,
    NoSync(bool),
    Shards,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => prop::collection::vec(0usize..64, 1..4).prop_map(Step::Fetch),
        3 => (0usize..64).prop_map(Step::Release),
        1 => Just(Step::ReleaseAll),
        3 => (0usize..64).prop_map(Step::Grad),
        2 => (0usize..64).prop_map(Step::Done),
        1 => Just(Step::End),
        1 => any::<bool>().prop_map(Step::NoSync),
        1 => Just(Step::Shards),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Completions {
    /// Only where the sequence says.
    AsGiven,
    /// Every launch completes right after the event that issued it.
    Eager,
    /// Nothing ever reports completion.
    Never,
}

#[derive(Debug, PartialEq)]
struct Outcome {
    launches: Vec<(u64, BucketId, Role, bool)>,
    frees: Vec<(BucketId, u64)>,
    errors: Vec<bool>,
}

fn held_buckets(plan: &Plan, held: &BTreeMap<ParamId, u32>) -> Vec<BucketId> {
    held.iter().filter(|(_, &n)| n > 0).map(|(p, _)| plan.layout().gather_bucket_of(*p).unwrap()).collect()
}

fn run(plan: &Plan, cfg: &SchedulerConfig, steps: &[Step], completions: Completions) -> Outcome {
    let n = plan.layout().params().len();
    let mut reg = InflightRegistry::new(&collsched_schedule::ScheduleInput::from_plan(plan));
    let mut s = Scheduler::from_plan(plan, 0, cfg.clone(), &mut reg).unwrap();
    let mut drv = CheckingDriver::default();
    let mut held: BTreeMap<ParamId, u32> = BTreeMap::new();
    let mut out = Vec::new();
    let mut launched: Vec<LaunchId> = Vec::new();
    let mut pending: HashMap<BucketId, usize> = HashMap::new(); // prefetched, not yet fetched
    let mut outcome = Outcome { launches: vec![], frees: vec![], errors: vec![] };
    let bytes_of = |b: BucketId| common::memory_bytes(plan, b);
    let mut all: Vec<Step> = steps.to_vec();
    all.push(Step::ReleaseAll);
    all.push(Step::End);
    for (seq, st) in (1u64..).zip(&all) {
        out.clear();
        let held_before = held_buckets(plan, &held);
        let users_before: Vec<u32> = (0..n as u32).map(|p| reg.users(ParamId(p))).collect();
        let live_before = reg.live_bytes();
        let after = Some(EngineEvent { queue: 0, seq });
        let r = match st {
            Step::Fetch(ps) => {
                let ps: Vec<ParamId> = ps.iter().map(|&i| ParamId((i % n) as u32)).collect();
                let r = s.handle(&mut reg, Event::Fetch(&ps), &mut out);
                if r.is_ok() {
                    for p in &ps {
                        *held.entry(*p).or_default() += 1;
                        pending.remove(&plan.layout().gather_bucket_of(*p).unwrap());
                    }
                }
                r
            }
            Step::Release(i) => {
                let p = ParamId((i % n) as u32);
                let r = s.handle(&mut reg, Event::Release { params: &[p], after }, &mut out);
                if r.is_ok() {
                    *held.get_mut(&p).unwrap() -= 1;
                }
                r
            }
            Step::ReleaseAll => {
                let ps: Vec<ParamId> =
                    held.iter().flat_map(|(p, &k)| std::iter::repeat_n(*p, k as usize)).collect();
                let r = s.handle(&mut reg, Event::Release { params: &ps, after }, &mut out);
                assert!(r.is_ok(), "releasing exactly what is held failed: {r:?}");
                held.clear();
                r
            }
            Step::Grad(i) => {
                s.handle(&mut reg, Event::GradReady { param: ParamId((i % n) as u32), after }, &mut out)
            }
            Step::Done(i) => {
                if completions == Completions::AsGiven && !launched.is_empty() {
                    s.handle(&mut reg, Event::OpDone(launched[i % launched.len()]), &mut out)
                } else {
                    Ok(())
                }
            }
            Step::End => s.handle(&mut reg, Event::EndStep, &mut out),
            Step::NoSync(on) => s.handle(&mut reg, Event::SetNoSync(*on), &mut out),
            Step::Shards => s.handle(&mut reg, Event::ShardsUpdated(EngineEvent { queue: 1, seq }), &mut out),
        };
        outcome.errors.push(r.is_err());
        if r.is_err() {
            // A failed event changes nothing.
            assert!(out.is_empty(), "{st:?} failed but pushed {out:?}");
            let users: Vec<u32> = (0..n as u32).map(|p| reg.users(ParamId(p))).collect();
            assert_eq!(users, users_before);
            assert_eq!(reg.live_bytes(), live_before);
        }
        let held_after = held_buckets(plan, &held);
        drv.run(&out, |b| held_before.contains(&b) && held_after.contains(&b));
        for a in &out {
            match a {
                Action::Launch(l) => {
                    launched.push(l.id);
                    outcome.launches.push((l.id.serial, l.id.bucket, l.id.role, l.prefetch));
                    if l.prefetch {
                        pending.insert(l.id.bucket, l.bytes);
                    }
                }
                Action::Free { buffer, .. } => {
                    outcome.frees.push((buffer.bucket, buffer.serial));
                    pending.remove(&buffer.bucket);
                }
                _ => {}
            }
        }
        if completions == Completions::Eager {
            for l in launches(&out) {
                s.handle(&mut reg, Event::OpDone(l.id), &mut Vec::new()).unwrap();
            }
        }
        // Budgets.
        // The first bucket ahead is admitted whatever its size; with two or more ahead their
        // bytes fit `prefetch_bytes`. So bytes ahead <= max(prefetch_bytes, largest bucket ahead).
        let ahead: usize = pending.values().sum();
        assert!(
            pending.len() <= 1 || ahead <= cfg.prefetch_bytes,
            "{} buckets, {ahead} bytes ahead > {}",
            pending.len(),
            cfg.prefetch_bytes
        );
        let largest = pending.values().copied().max().unwrap_or(0);
        assert!(ahead <= cfg.prefetch_bytes.max(largest));
        assert!(pending.len() <= cfg.max_inflight, "{} ahead > {}", pending.len(), cfg.max_inflight);
        let mut held_set = held_after.clone();
        held_set.sort();
        held_set.dedup();
        let held_bytes: usize = held_set.iter().map(|&b| bytes_of(b)).sum();
        assert_eq!(reg.live_bytes(), drv.live_gathered_bytes(), "registry and driver disagree");
        assert!(
            reg.live_bytes() <= cfg.max_live_bytes.max(held_bytes),
            "live {} > max({}, held {held_bytes})",
            reg.live_bytes(),
            cfg.max_live_bytes
        );
    }
    // Everything launched was consumed or drained; every buffer freed exactly once.
    assert_eq!(reg.live_bytes(), 0);
    assert!(drv.live.is_empty(), "buffers never freed: {:?}", drv.live);
    outcome
}

fn config() -> impl Strategy<Value = SchedulerConfig> {
    (0usize..5, 0usize..5, 1usize..6, any::<bool>()).prop_map(|(pf, inflight, live, trace)| {
        let one = 3 * 1024 + 128 * 4; // about one layer's gathered bytes
        SchedulerConfig {
            policy: if trace { PolicyKind::TraceReplay } else { PolicyKind::None },
            prefetch_bytes: pf * one,
            max_inflight: inflight,
            max_live_bytes: live * one,
            ..SchedulerConfig::default()
        }
    })
}

/// A realistic step (forward, backward with gradients) so trace replay has something to
/// replay, followed by random events.
fn steps_with_warmup(layers: usize, random: Vec<Step>) -> Vec<Step> {
    let mut v = Vec::new();
    for i in 0..layers {
        v.push(Step::Fetch(vec![2 * i, 2 * i + 1]));
        v.push(Step::ReleaseAll);
    }
    for i in (0..layers).rev() {
        v.push(Step::Fetch(vec![2 * i, 2 * i + 1]));
        v.push(Step::Grad(2 * i));
        v.push(Step::Grad(2 * i + 1));
        v.push(Step::ReleaseAll);
    }
    v.push(Step::End);
    v.extend(random);
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn random_sequences_keep_every_invariant(
        layers in 2usize..7,
        cfg in config(),
        random in prop::collection::vec(step(), 0..80),
    ) {
        let plan = layered(layers, 4);
        let steps = steps_with_warmup(layers, random);
        run(&plan, &cfg, &steps, Completions::AsGiven);
    }

    #[test]
    fn launches_do_not_depend_on_completion_timing(
        layers in 2usize..7,
        cfg in config(),
        random in prop::collection::vec(step(), 0..80),
    ) {
        let plan = layered(layers, 4);
        let steps = steps_with_warmup(layers, random);
        let a = run(&plan, &cfg, &steps, Completions::AsGiven);
        let b = run(&plan, &cfg, &steps, Completions::Eager);
        let c = run(&plan, &cfg, &steps, Completions::Never);
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(&a, &c);
    }
}

/// Two schedulers (training and evaluation) on one registry, events interleaved at random.
fn run_shared(plan: &Plan, cfg: &SchedulerConfig, steps: &[(bool, Step)]) {
    let n = plan.layout().params().len();
    let mut reg = InflightRegistry::new(&collsched_schedule::ScheduleInput::from_plan(plan));
    let mut ss = [
        Scheduler::from_plan(plan, 0, cfg.clone(), &mut reg).unwrap(),
        Scheduler::from_plan(plan, 0, cfg.clone(), &mut reg).unwrap(),
    ];
    let mut held: [BTreeMap<ParamId, u32>; 2] = [BTreeMap::new(), BTreeMap::new()];
    let mut drv = CheckingDriver::default();
    let mut out = Vec::new();
    let mut all: Vec<(bool, Step)> = steps.to_vec();
    for who in [false, true] {
        all.push((who, Step::ReleaseAll));
        all.push((who, Step::End));
    }
    let union = |held: &[BTreeMap<ParamId, u32>; 2]| {
        let mut v = held_buckets(plan, &held[0]);
        v.extend(held_buckets(plan, &held[1]));
        v
    };
    for (seq, (who, st)) in (1u64..).zip(&all) {
        let k = usize::from(*who);
        out.clear();
        let before = union(&held);
        let users_before: Vec<u32> = (0..n as u32).map(|p| reg.users(ParamId(p))).collect();
        let s = &mut ss[k];
        let r = match st {
            Step::Fetch(ps) => {
                let ps: Vec<ParamId> = ps.iter().map(|&i| ParamId((i % n) as u32)).collect();
                let r = s.handle(&mut reg, Event::Fetch(&ps), &mut out);
                if r.is_ok() {
                    for p in ps {
                        *held[k].entry(p).or_default() += 1;
                    }
                }
                r
            }
            Step::Release(i) => {
                let p = ParamId((i % n) as u32);
                let r = s.handle(&mut reg, Event::Release { params: &[p], after: None }, &mut out);
                if r.is_ok() {
                    *held[k].get_mut(&p).unwrap() -= 1;
                }
                r
            }
            Step::ReleaseAll => {
                let ps: Vec<ParamId> =
                    held[k].iter().flat_map(|(p, &c)| std::iter::repeat_n(*p, c as usize)).collect();
                held[k].clear();
                s.handle(&mut reg, Event::Release { params: &ps, after: None }, &mut out)
            }
            Step::Grad(i) => {
                s.handle(&mut reg, Event::GradReady { param: ParamId((i % n) as u32), after: None }, &mut out)
            }
            Step::Done(_) => Ok(()),
            Step::End => s.handle(&mut reg, Event::EndStep, &mut out),
            Step::NoSync(on) => s.handle(&mut reg, Event::SetNoSync(*on), &mut out),
            Step::Shards => s.handle(&mut reg, Event::ShardsUpdated(EngineEvent { queue: 1, seq }), &mut out),
        };
        if r.is_err() {
            assert!(out.is_empty());
            let users: Vec<u32> = (0..n as u32).map(|p| reg.users(ParamId(p))).collect();
            assert_eq!(users, users_before);
        }
        let after = union(&held);
        drv.run(&out, |b| before.contains(&b) && after.contains(&b));
        for p in 0..n as u32 {
            let p = ParamId(p);
            let total = held[0].get(&p).copied().unwrap_or(0) + held[1].get(&p).copied().unwrap_or(0);
            assert_eq!(reg.users(p), total, "registry users of {p:?}");
        }
        assert_eq!(reg.live_bytes(), drv.live_gathered_bytes());
        // No bucket is gathered twice at once: the driver refuses a second live buffer per
        // launch, and the registry has one slot per bucket.
        let mut live_buckets: Vec<BucketId> = drv
            .live
            .keys()
            .filter(|b| drv.launched.iter().any(|l| l.buffer == **b && l.id.role == Role::Gather))
            .map(|b| b.bucket)
            .collect();
        live_buckets.sort();
        let count = live_buckets.len();
        live_buckets.dedup();
        assert_eq!(count, live_buckets.len(), "a bucket gathered twice at once");
    }
    assert_eq!(reg.live_bytes(), 0);
    assert!(drv.live.is_empty(), "buffers never freed: {:?}", drv.live);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn two_schedulers_sharing_a_registry_keep_every_invariant(
        layers in 2usize..6,
        cfg in config(),
        random in prop::collection::vec((any::<bool>(), step()), 0..100),
    ) {
        let plan = layered(layers, 4);
        let mut steps: Vec<(bool, Step)> = steps_with_warmup(layers, vec![]).into_iter().map(|s| (false, s)).collect();
        steps.extend(steps_with_warmup(layers, vec![]).into_iter().map(|s| (true, s)));
        steps.extend(random);
        run_shared(&plan, &cfg, &steps);
    }
}
