//! Behaviour of the sans-IO scheduler: one test per behaviour and per bad input.

mod common;

use collsched_schedule::buckets::{BucketId, DType, ParamId};
use collsched_schedule::{
    split_divide, Action, CollectiveKind, EngineEvent, Event, Explicit, Fence, GradReduce, GradSource,
    InflightRegistry, ParamState, Plan, PolicyKind, Role, ScheduleError, Scheduler, SchedulerConfig, Stream,
    WaitOn,
};
use common::*;

struct Rig {
    plan: Plan,
    reg: InflightRegistry,
    s: Scheduler,
    out: Vec<Action>,
}

fn rig(layers: usize, config: SchedulerConfig) -> Rig {
    let plan = layered(layers, 4);
    let mut reg = registry(&plan);
    let s = Scheduler::from_plan(&plan, 0, config, &mut reg).unwrap();
    Rig { plan, reg, s, out: Vec::new() }
}

fn no_prefetch() -> SchedulerConfig {
    SchedulerConfig { policy: PolicyKind::None, ..SchedulerConfig::default() }
}

impl Rig {
    fn ev(&mut self, e: Event<'_>) -> Result<(), ScheduleError> {
        self.s.handle(&mut self.reg, e, &mut self.out)
    }
    fn fetch(&mut self, p: &[ParamId]) {
        self.ev(Event::Fetch(p)).unwrap();
    }
    fn release(&mut self, p: &[ParamId]) {
        self.ev(Event::Release { params: p, after: None }).unwrap();
    }
    fn grad(&mut self, p: ParamId) {
        self.ev(Event::GradReady { param: p, after: None }).unwrap();
    }
    fn end(&mut self) {
        self.ev(Event::EndStep).unwrap();
    }
    /// A training step: forward over `fwd` layers, backward in reverse with gradients.
    fn train_step(&mut self, fwd: &[usize]) {
        for &i in fwd {
            self.fetch(&layer(i));
            self.release(&layer(i));
        }
        for &i in fwd.iter().rev() {
            self.fetch(&layer(i));
            for p in layer(i) {
                self.grad(p);
            }
            self.release(&layer(i));
        }
        self.end();
    }
    fn take(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.out)
    }
}

#[test]
fn a_fetch_gathers_the_whole_bucket_once() {
    let mut r = rig(3, no_prefetch());
    r.fetch(&[layer(1)[0]]);
    r.fetch(&[layer(1)[1]]);
    let a = r.take();
    let g = gathers(&a);
    assert_eq!(g, [r.plan.layout().gather_bucket_of(layer(1)[0]).unwrap()]);
    let l = launches(&a)[0];
    assert_eq!(l.ops.as_slice(), r.plan.ops_of(g[0]));
    assert_eq!(l.stream, Stream::AllGather);
    assert_eq!(l.bytes, memory_bytes(&r.plan, g[0]));
    // Both params of the bucket are gathered by that one launch.
    for p in layer(1) {
        assert_eq!(r.reg.param_state(p), ParamState::InFlight(l.id));
    }
    // One wait for the compute stream, not two.
    let waits = a.iter().filter(|a| matches!(a, Action::Wait { .. })).count();
    assert_eq!(waits, 1);
}

#[test]
fn a_step_issues_one_gather_per_bucket_fetched_and_one_reduce_per_grad_bucket() {
    for policy in [PolicyKind::None, PolicyKind::TraceReplay] {
        let layers = 5;
        let mut r = rig(layers, SchedulerConfig { policy, ..SchedulerConfig::default() });
        let order: Vec<usize> = (0..layers).collect();
        for step in 0..3 {
            r.train_step(&order);
            let a = r.take();
            let c = &r.s.last_step().counters;
            // Forward and backward each fetch every bucket once (released in between).
            let expected_gathers = 2 * r.plan.layout().gather_buckets().len();
            assert_eq!(gathers(&a).len(), expected_gathers, "step {step} {policy:?}");
            assert_eq!(c.all_gathers as usize, expected_gathers);
            assert_eq!(reduces(&a).len(), r.plan.layout().grad_buckets().len());
            assert_eq!(c.reduce_scatters as usize, r.plan.layout().grad_buckets().len());
            assert_eq!(c.prefetch_hits + c.prefetch_misses + c.already_gathered, expected_gathers as u64);
            if policy == PolicyKind::TraceReplay && step > 0 {
                // Only the very first fetch of a replayed step misses.
                assert_eq!(c.prefetch_misses, 1, "{c:?}");
            } else {
                assert_eq!(c.prefetch_hits, 0);
            }
            assert!(r.s.last_step().drained.is_empty());
            assert!(r.s.last_step().zero_filled.is_empty());
            assert_eq!(r.reg.live_bytes(), 0);
        }
    }
}

#[test]
fn reduces_launch_in_fill_order_with_the_grad_buffer_freed_after_the_reduce() {
    let mut r = rig(4, no_prefetch());
    for i in [2, 0, 3, 1] {
        r.fetch(&layer(i));
        for p in layer(i) {
            r.grad(p);
        }
        r.release(&layer(i));
    }
    let a = r.take();
    let expected: Vec<BucketId> =
        [2, 0, 3, 1].iter().map(|&i| r.plan.layout().grad_bucket_of(layer(i)[0]).unwrap()).collect();
    assert_eq!(reduces(&a), expected);
    for (k, act) in a.iter().enumerate() {
        if let Action::Launch(l) = act {
            if l.id.role == Role::Reduce {
                assert_eq!(l.stream, Stream::ReduceScatter);
                let Action::Free { buffer, after } = &a[k + 1] else { panic!("no free after reduce") };
                assert_eq!(*buffer, l.buffer);
                assert_eq!(after.as_slice(), [Fence::Op(l.id)]);
            }
        }
    }
    r.end();
    // The end of step makes the compute stream wait for every reduce.
    let a = r.take();
    let waits: Vec<_> =
        a.iter().filter(|x| matches!(x, Action::Wait { on: WaitOn::Stream(Stream::Compute), .. })).collect();
    assert_eq!(waits.len(), expected.len());
}

#[test]
fn reported_reduce_completions_are_found_and_save_their_end_of_step_waits() {
    let mut r = rig(4, no_prefetch());
    // Two steps: the second step's ids must not be confused with the first's (same buckets).
    for step in 0..2 {
        for i in [2, 0, 3, 1] {
            r.fetch(&layer(i));
            for p in layer(i) {
                r.grad(p);
            }
            r.release(&layer(i));
        }
        let a = r.take();
        let ids: Vec<_> = launches(&a).iter().filter(|l| l.id.role == Role::Reduce).map(|l| l.id).collect();
        assert_eq!(ids.len(), 4);
        // Report every other reduce, out of launch order.
        let done: Vec<_> = ids.iter().rev().step_by(2).copied().collect();
        for &id in &done {
            r.ev(Event::OpDone(id)).unwrap();
        }
        r.end();
        let a = r.take();
        let waited: Vec<_> = a
            .iter()
            .filter_map(|x| match x {
                Action::Wait { fence: Fence::Op(id), on: WaitOn::Stream(Stream::Compute) } => Some(*id),
                _ => None,
            })
            .collect();
        let expected: Vec<_> = ids.iter().filter(|id| !done.contains(id)).copied().collect();
        assert_eq!(waited, expected, "step {step}: waits in launch order for the unreported reduces");
        // A stale completion (of a reduce of an ended step) is ignored.
        r.ev(Event::OpDone(ids[0])).unwrap();
    }
}

#[test]
fn frees_are_deferred_until_the_consumers_events() {
    let mut r = rig(2, no_prefetch());
    let [w, b] = layer(0);
    r.fetch(&[w]);
    r.fetch(&[b]);
    let launch = launches(&r.out)[0].id;
    r.out.clear();
    let e = |queue, seq| EngineEvent { queue, seq };
    r.ev(Event::Release { params: &[w], after: Some(e(0, 5)) }).unwrap();
    assert!(frees(&r.out).is_empty(), "freed while `b` is still held");
    r.ev(Event::Release { params: &[b], after: Some(e(1, 2)) }).unwrap();
    let Some(Action::Free { buffer, after }) = r.out.last() else { panic!("no free") };
    assert_eq!(buffer.bucket, launch.bucket);
    // Both queues' events, and the gather itself (not reported complete).
    assert!(after.contains(&Fence::Engine(e(0, 5))) && after.contains(&Fence::Engine(e(1, 2))));
    assert!(after.contains(&Fence::Op(launch)));
    // Later events on one queue replace earlier ones; a completed gather is not waited for.
    r.out.clear();
    r.fetch(&[w, b]);
    let launch = launches(&r.out)[0].id;
    r.ev(Event::OpDone(launch)).unwrap();
    r.ev(Event::Release { params: &[w], after: Some(e(0, 7)) }).unwrap();
    r.ev(Event::Release { params: &[b], after: Some(e(0, 9)) }).unwrap();
    let Some(Action::Free { after, .. }) = r.out.last() else { panic!("no free") };
    assert_eq!(after.as_slice(), [Fence::Engine(e(0, 9))]);
}

#[test]
fn op_done_saves_the_wait_but_changes_no_launch() {
    let mut r = rig(3, SchedulerConfig::default());
    r.train_step(&[0, 1, 2]);
    r.out.clear();
    r.fetch(&layer(0)); // replay: prefetches layer 1's bucket
    let pre = launches(&r.out).iter().find(|l| l.prefetch).map(|l| l.id).expect("a prefetch");
    r.ev(Event::OpDone(pre)).unwrap();
    r.out.clear();
    r.fetch(&layer(1));
    assert!(!r.out.iter().any(|a| matches!(a, Action::Wait { fence: Fence::Op(id), .. } if *id == pre)));
    assert_eq!(r.s.counters().prefetch_hits, 1);
    assert!(matches!(r.reg.param_state(layer(1)[0]), ParamState::Available { users: 1 }));
}

#[test]
fn release_without_fetch_and_double_release_are_errors_that_change_nothing() {
    let mut r = rig(2, no_prefetch());
    let [w, b] = layer(0);
    let err = r.ev(Event::Release { params: &[w], after: None }).unwrap_err();
    assert!(matches!(err, ScheduleError::NotFetched { twice: false, .. }), "{err}");
    assert!(err.to_string().contains("l0.w") && err.to_string().contains("bucket"));
    r.fetch(&[w, b]);
    r.out.clear();
    // A release naming `w` twice fails as a whole: `b` and `w` stay held.
    let err = r.ev(Event::Release { params: &[b, w, w], after: None }).unwrap_err();
    assert!(matches!(err, ScheduleError::NotFetched { twice: true, .. }));
    assert!(r.out.is_empty());
    assert_eq!((r.reg.users(w), r.reg.users(b)), (1, 1));
    r.release(&[w, b]);
    assert_eq!(frees(&r.out).len(), 1);
    let err = r.ev(Event::Release { params: &[w], after: None }).unwrap_err();
    assert!(matches!(err, ScheduleError::NotFetched { twice: true, .. }), "{err}");
    assert!(err.to_string().contains("already released"));
    assert_eq!(r.reg.live_bytes(), 0);
}

#[test]
fn unknown_params_are_errors_that_change_nothing() {
    let mut r = rig(2, no_prefetch());
    let bad = ParamId(99);
    for e in [
        Event::Fetch(&[ParamId(0), bad]),
        Event::Release { params: &[bad], after: None },
        Event::GradReady { param: bad, after: None },
    ] {
        let err = r.ev(e).unwrap_err();
        assert!(matches!(err, ScheduleError::UnknownParam { param, .. } if param == bad), "{err}");
    }
    assert!(r.out.is_empty());
    assert_eq!(r.reg.live_bytes(), 0);
    assert_eq!(r.reg.users(ParamId(0)), 0);
    let err = r.ev(Event::SetTrainable(&[true])).unwrap_err();
    assert!(matches!(err, ScheduleError::MaskLength { got: 1, expected: 4, .. }));
}

#[test]
fn op_done_of_a_launch_never_issued_is_an_error_and_a_stale_one_is_ignored() {
    let mut r = rig(2, no_prefetch());
    r.fetch(&layer(0));
    let id = launches(&r.out)[0].id;
    let mut fake = id;
    fake.serial = 1000;
    assert!(matches!(r.ev(Event::OpDone(fake)).unwrap_err(), ScheduleError::UnknownLaunch { .. }));
    r.release(&layer(0));
    r.ev(Event::OpDone(id)).unwrap(); // buffer already freed: nothing to do
    assert_eq!(r.reg.param_state(layer(0)[0]), ParamState::NotAvailable);
}

#[test]
fn gradient_errors_name_the_parameter() {
    let plan = layered_with(2, 4, |i| i == 1);
    let mut reg = registry(&plan);
    let mut s = Scheduler::from_plan(&plan, 3, no_prefetch(), &mut reg).unwrap();
    let mut out = Vec::new();
    let err = s.handle(&mut reg, Event::GradReady { param: layer(0)[0], after: None }, &mut out).unwrap_err();
    assert!(matches!(err, ScheduleError::GradOfFrozen { rank: 3, .. }));
    assert!(err.to_string().contains("l0.w"));
    s.handle(&mut reg, Event::GradReady { param: layer(1)[0], after: None }, &mut out).unwrap();
    let err = s.handle(&mut reg, Event::GradReady { param: layer(1)[0], after: None }, &mut out).unwrap_err();
    assert!(matches!(err, ScheduleError::GradTwice { .. }));
    let err = s.set_no_sync(true).unwrap_err();
    assert!(matches!(err, ScheduleError::NoSyncMidStep { arrived: 1, .. }));
    // Frozen layer 0 takes no part: one gradient bucket, one reduce.
    s.handle(&mut reg, Event::GradReady { param: layer(1)[1], after: None }, &mut out).unwrap();
    s.handle(&mut reg, Event::EndStep, &mut out).unwrap();
    assert_eq!(reduces(&out).len(), 1);
    assert!(s.last_step().zero_filled.is_empty());
}

#[test]
fn two_schedulers_on_one_registry_neither_double_gather_nor_free_under_each_other() {
    let plan = layered(3, 4);
    let mut reg = registry(&plan);
    let mut train = Scheduler::from_plan(&plan, 0, SchedulerConfig::default(), &mut reg).unwrap();
    let mut eval = Scheduler::from_plan(&plan, 0, SchedulerConfig::default(), &mut reg).unwrap();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let mut drv = CheckingDriver::default();
    train.handle(&mut reg, Event::Fetch(&layer(0)), &mut a).unwrap();
    eval.handle(&mut reg, Event::Fetch(&layer(0)), &mut b).unwrap();
    assert_eq!(gathers(&a).len(), 1);
    assert!(gathers(&b).is_empty(), "eval gathered again");
    // eval still waits for train's gather.
    let l = launches(&a)[0].id;
    assert!(b.iter().any(|x| matches!(x, Action::Wait { fence: Fence::Op(id), .. } if *id == l)));
    assert_eq!(eval.counters().already_gathered, 1);
    a.clear();
    train.handle(&mut reg, Event::Release { params: &layer(0), after: None }, &mut a).unwrap();
    assert!(frees(&a).is_empty(), "train freed a bucket eval holds");
    // eval cannot release what train fetched.
    train.handle(&mut reg, Event::Fetch(&layer(1)), &mut a).unwrap();
    let err = eval.handle(&mut reg, Event::Release { params: &layer(1), after: None }, &mut b).unwrap_err();
    assert!(matches!(err, ScheduleError::NotFetched { .. }));
    eval.handle(&mut reg, Event::Release { params: &layer(0), after: None }, &mut b).unwrap();
    assert_eq!(frees(&b).len(), 1);
    // A registry of the wrong model is refused.
    let mut other = registry(&layered(4, 4));
    let err = train.handle(&mut other, Event::Fetch(&layer(0)), &mut a).unwrap_err();
    assert!(matches!(err, ScheduleError::WrongRegistry { .. }));
    assert!(Scheduler::from_plan(&plan, 0, SchedulerConfig::default(), &mut other).is_err());
    let _ = &mut drv;
}

#[test]
fn eval_after_train_drains_unused_prefetches_and_reports_them() {
    let layers = 4;
    let plan = layered(layers, 4);
    let mut reg = registry(&plan);
    let mut train = Scheduler::from_plan(&plan, 0, SchedulerConfig::default(), &mut reg).unwrap();
    let mut eval = Scheduler::from_plan(&plan, 0, SchedulerConfig::default(), &mut reg).unwrap();
    let mut out = Vec::new();
    let mut drv = CheckingDriver::default();
    let steps = |s: &mut Scheduler, reg: &mut InflightRegistry, out: &mut Vec<Action>, layers_used: usize| {
        for i in 0..layers_used {
            s.handle(reg, Event::Fetch(&layer(i)), out).unwrap();
            s.handle(reg, Event::Release { params: &layer(i), after: None }, out).unwrap();
        }
        s.handle(reg, Event::EndStep, out).unwrap();
    };
    // Two full forward passes on train (record, replay); eval records its own order.
    steps(&mut train, &mut reg, &mut out, layers);
    steps(&mut train, &mut reg, &mut out, layers);
    steps(&mut eval, &mut reg, &mut out, layers);
    // Replay on train but stop after the first layer, like an early exit: its prefetch of
    // layer 1 (and beyond) is never used.
    train.handle(&mut reg, Event::Fetch(&layer(0)), &mut out).unwrap();
    train.handle(&mut reg, Event::Release { params: &layer(0), after: None }, &mut out).unwrap();
    let prefetched: Vec<BucketId> =
        launches(&out).iter().rev().take_while(|l| l.prefetch).map(|l| l.id.bucket).collect();
    assert!(!prefetched.is_empty());
    // eval uses train's prefetch of layer 1 instead of gathering it again.
    let mark = out.len();
    eval.handle(&mut reg, Event::Fetch(&layer(1)), &mut out).unwrap();
    assert!(!gathers(&out[mark..]).contains(&plan.layout().gather_bucket_of(layer(1)[0]).unwrap()));
    eval.handle(&mut reg, Event::Release { params: &layer(1), after: None }, &mut out).unwrap();
    train.handle(&mut reg, Event::EndStep, &mut out).unwrap();
    eval.handle(&mut reg, Event::EndStep, &mut out).unwrap();
    drv.run(&out, |_| false);
    let drained = &train.last_step().drained;
    assert!(!drained.is_empty());
    for b in prefetched.iter().filter(|&&b| b != plan.layout().gather_bucket_of(layer(1)[0]).unwrap()) {
        for p in plan.layout().bucket(*b).unwrap().params() {
            assert!(drained.contains(p), "{p:?} of bucket {b} not reported");
        }
    }
    assert_eq!(train.last_step().counters.drained_params as usize, drained.len());
    assert_eq!(reg.live_bytes(), 0, "something still gathered after both ended their step");
}

#[test]
fn a_module_skipped_in_one_step_is_reduced_as_zeros_in_bucket_order_and_the_next_step_is_clean() {
    let layers = 4;
    let mut r = rig(layers, SchedulerConfig::default());
    r.train_step(&[0, 1, 2, 3]);
    r.out.clear();
    r.train_step(&[0, 1, 3]); // layer 2 skipped
    let a = r.take();
    let grad_of = |i: usize| r.plan.layout().grad_bucket_of(layer(i)[0]).unwrap();
    // Filled buckets reduce as they fill (backward order), the skipped one at the end.
    assert_eq!(reduces(&a), [grad_of(3), grad_of(1), grad_of(0), grad_of(2)]);
    assert_eq!(r.s.last_step().zero_filled, layer(2));
    assert_eq!(r.s.last_step().counters.zero_filled_params, 2);
    // The prefetch of layer 2 (trace replay) was drained or discarded, never leaked.
    assert_eq!(r.reg.live_bytes(), 0);
    let mut drv = CheckingDriver::default();
    drv.run(&a, |_| false);
    assert!(drv.live.is_empty(), "buffers left: {:?}", drv.live);
    r.train_step(&[0, 1, 2, 3]);
    assert!(r.s.last_step().zero_filled.is_empty());
    assert_eq!(r.s.last_step().counters.reduce_scatters, layers as u64);
}

#[test]
fn an_error_mid_step_leaves_a_clean_next_step() {
    let mut clean = rig(3, SchedulerConfig::default());
    let mut r = rig(3, SchedulerConfig::default());
    for x in [&mut clean, &mut r] {
        x.train_step(&[0, 1, 2]);
    }
    // Step with errors sprinkled in.
    r.fetch(&layer(0));
    assert!(r.ev(Event::Release { params: &layer(1), after: None }).is_err());
    assert!(r.ev(Event::Fetch(&[ParamId(77)])).is_err());
    r.release(&layer(0));
    assert!(r.ev(Event::Release { params: &layer(0), after: None }).is_err());
    r.fetch(&layer(1));
    r.release(&layer(1));
    r.fetch(&layer(1));
    r.grad(layer(1)[0]);
    assert!(r.ev(Event::GradReady { param: layer(1)[0], after: None }).is_err());
    r.grad(layer(1)[1]);
    r.release(&layer(1));
    r.end();
    // Next step: identical to the clean scheduler's.
    clean.out.clear();
    r.out.clear();
    clean.train_step(&[0, 1, 2]);
    r.train_step(&[0, 1, 2]);
    let key =
        |a: &[Action]| launches(a).iter().map(|l| (l.id.bucket, l.id.role, l.prefetch)).collect::<Vec<_>>();
    assert_eq!(key(&r.out), key(&clean.out));
    assert_eq!(r.s.last_step().counters.all_gathers, clean.s.last_step().counters.all_gathers);
    assert!(r.s.last_step().zero_filled.is_empty());
    assert_eq!(r.reg.live_bytes(), 0);
}

#[test]
fn trace_divergence_replays_from_the_divergence_point() {
    let layers = 6;
    let cfg = SchedulerConfig { max_inflight: 2, ..SchedulerConfig::default() };
    let mut r = rig(layers, cfg);
    let fwd = |r: &mut Rig, order: &[usize]| {
        for &i in order {
            r.fetch(&layer(i));
            r.release(&layer(i));
        }
        r.end();
    };
    fwd(&mut r, &[0, 1, 2, 3, 4, 5]);
    r.out.clear();
    let plan = r.plan.clone();
    let b = |i: usize| plan.layout().gather_bucket_of(layer(i)[0]).unwrap();
    // Diverge: skip layers 1 and 2.
    r.fetch(&layer(0));
    r.release(&layer(0));
    let a = r.take();
    let pre: Vec<_> = launches(&a).iter().filter(|l| l.prefetch).map(|l| l.id.bucket).collect();
    assert_eq!(pre, [b(1), b(2)]);
    r.fetch(&layer(3));
    let a = r.take();
    // The jumped-over prefetches are freed at once, then replay continues after layer 3.
    let freed: Vec<_> = frees(&a).iter().map(|f| f.bucket).collect();
    assert!(freed.contains(&b(1)) && freed.contains(&b(2)));
    let pre: Vec<_> = launches(&a).iter().filter(|l| l.prefetch).map(|l| l.id.bucket).collect();
    assert_eq!(pre, [b(4), b(5)]);
    r.release(&layer(3));
    for i in [4, 5] {
        r.fetch(&layer(i));
        r.release(&layer(i));
    }
    let c = r.s.counters().clone();
    assert_eq!(c.prefetch_hits, 2, "layers 4 and 5 hit: {c:?}");
    assert_eq!(c.prefetch_misses, 2, "layers 0 and 3 miss");
    assert_eq!(c.discarded_prefetches, 2);
    r.end();
    assert_eq!(r.reg.live_bytes(), 0);
}

#[test]
fn explicit_prefetch_follows_the_engines_rules() {
    let mut r = rig(4, SchedulerConfig::default());
    let plan = r.plan.clone();
    let b = |i: usize| plan.layout().gather_bucket_of(layer(i)[0]).unwrap();
    let mut e = Explicit::default();
    e.after(b(0), &[b(2), b(3)]);
    r.s.set_policy(Box::new(e));
    r.fetch(&layer(0));
    let pre: Vec<_> = launches(&r.out).iter().filter(|l| l.prefetch).map(|l| l.id.bucket).collect();
    assert_eq!(pre, [b(2), b(3)]);
    assert_eq!(r.s.policy().name(), "explicit");
}

#[test]
fn prefetch_stays_inside_its_byte_and_count_budgets() {
    let layers = 6;
    let plan = layered(layers, 4);
    let one = plan.layout().gather_buckets().iter().map(|b| memory_bytes(&plan, b.id())).max().unwrap();
    for (prefetch_bytes, max_inflight) in [(one, 10), (10 * one, 1), (3 * one, 2), (one - 1, 10)] {
        let cfg = SchedulerConfig { prefetch_bytes, max_inflight, ..SchedulerConfig::default() };
        let mut r = rig(layers, cfg);
        r.train_step(&(0..layers).collect::<Vec<_>>());
        r.out.clear();
        r.fetch(&layer(0));
        let pre: Vec<_> = launches(&r.out).iter().filter(|l| l.prefetch).map(|l| l.bytes).collect();
        assert!(pre.len() <= max_inflight);
        // The first bucket ahead is admitted whatever its size; more than one fit the budget.
        assert!(!pre.is_empty(), "nothing prefetched ({prefetch_bytes}, {max_inflight})");
        assert!(pre.len() == 1 || pre.iter().sum::<usize>() <= prefetch_bytes, "{pre:?} > {prefetch_bytes}");
        // The budget is used as far as the next bucket allows.
        let next =
            plan.layout().bucket(plan.layout().gather_bucket_of(layer(pre.len() + 1)[0]).unwrap()).unwrap();
        let full = pre.len() == max_inflight
            || pre.iter().sum::<usize>() + memory_bytes(&plan, next.id()) > prefetch_bytes;
        assert!(full, "stopped early: {pre:?} ({prefetch_bytes}, {max_inflight})");
    }
}

#[test]
fn a_bucket_larger_than_prefetch_bytes_is_prefetched_one_ahead_and_a_second_is_not() {
    let layers = 5;
    let plan = layered(layers, 4);
    let bytes = |i: usize| memory_bytes(&plan, plan.layout().gather_bucket_of(layer(i)[0]).unwrap());
    let b = |i: usize| plan.layout().gather_bucket_of(layer(i)[0]).unwrap();
    let smallest = (0..layers).map(bytes).min().unwrap();
    let cfg =
        SchedulerConfig { prefetch_bytes: smallest - 1, max_inflight: 10, ..SchedulerConfig::default() };
    let mut r = rig(layers, cfg);
    r.train_step(&(0..layers).collect::<Vec<_>>());
    r.out.clear();
    let prefetched =
        |a: &[Action]| launches(a).iter().filter(|l| l.prefetch).map(|l| l.id.bucket).collect::<Vec<_>>();
    r.fetch(&layer(0));
    let a = r.take();
    assert!(bytes(1) > r.s.config().prefetch_bytes);
    assert_eq!(prefetched(&a), [b(1)], "one bucket ahead, not two");
    // Releasing layer 0 frees memory but the one ahead is still unfetched: nothing more.
    r.release(&layer(0));
    assert!(prefetched(&r.take()).is_empty());
    // Fetching layer 1 consumes the prefetch (a hit): the next one goes ahead.
    r.fetch(&layer(1));
    let a = r.take();
    assert_eq!(r.s.counters().prefetch_hits, 1);
    assert_eq!(prefetched(&a), [b(2)]);
    r.release(&layer(1));

    // `max_live_bytes` still binds strictly: no room for a second bucket, no prefetch.
    let cfg = SchedulerConfig {
        prefetch_bytes: 0,
        max_inflight: 10,
        max_live_bytes: bytes(0) + bytes(1) - 1,
        ..SchedulerConfig::default()
    };
    let mut r = rig(layers, cfg);
    r.train_step(&(0..layers).collect::<Vec<_>>());
    r.out.clear();
    r.fetch(&layer(0));
    assert!(prefetched(&r.take()).is_empty());
    assert!(r.reg.live_bytes() <= r.s.config().max_live_bytes);
    // And `max_inflight` = 0 disables prefetch whatever the sizes.
    let cfg = SchedulerConfig { prefetch_bytes: 0, max_inflight: 0, ..SchedulerConfig::default() };
    let mut r = rig(layers, cfg);
    r.train_step(&(0..layers).collect::<Vec<_>>());
    r.out.clear();
    r.fetch(&layer(0));
    assert!(prefetched(&r.take()).is_empty());
}

#[test]
fn gathered_memory_stays_under_max_live_bytes_and_fetches_evict_unused_prefetches() {
    let layers = 6;
    let plan = layered(layers, 4);
    let one = plan.layout().gather_buckets().iter().map(|b| memory_bytes(&plan, b.id())).max().unwrap();
    let cfg = SchedulerConfig { max_live_bytes: 2 * one, ..SchedulerConfig::default() };
    let mut r = rig(layers, cfg);
    r.train_step(&(0..layers).collect::<Vec<_>>());
    r.out.clear();
    r.fetch(&layer(0));
    assert!(r.reg.live_bytes() <= 2 * one);
    // Out of trace order: layer 4 while 0 is held and 1 prefetched: the prefetch makes room.
    r.fetch(&layer(4));
    assert!(r.reg.live_bytes() <= 2 * one);
    assert_eq!(r.s.counters().evictions, 1);
    // Holding three buckets must exceed: counted, not refused.
    r.fetch(&layer(5));
    assert_eq!(r.s.counters().live_overruns, 1);
    assert_eq!(r.reg.peak_live_bytes(), r.reg.live_bytes());
    for i in [0, 4, 5] {
        r.release(&layer(i));
    }
    r.end();
    assert_eq!(r.reg.live_bytes(), 0);
}

#[test]
fn no_sync_accumulates_locally_and_the_next_synced_step_reduces_the_sum() {
    let layers = 3;
    let mut r = rig(layers, no_prefetch());
    r.ev(Event::SetNoSync(true)).unwrap();
    r.train_step(&[0, 1, 2]);
    let a = r.take();
    assert!(reduces(&a).is_empty());
    let acc = a.iter().filter(|x| matches!(x, Action::AccumulateGrad { .. })).count();
    assert_eq!(acc, 2 * layers);
    assert!(!a.iter().any(|x| matches!(x, Action::AllocGrad { .. } | Action::CopyGradIn { .. })));
    assert_eq!(r.s.unsynced_grads(), 2 * layers);
    // Synced step; layer 1's bias gives no gradient this time: its accumulator is reduced.
    r.ev(Event::SetNoSync(false)).unwrap();
    for i in 0..layers {
        r.fetch(&layer(i));
        r.release(&layer(i));
    }
    for i in (0..layers).rev() {
        r.fetch(&layer(i));
        for p in layer(i) {
            if p != layer(1)[1] {
                r.grad(p);
            }
        }
        r.release(&layer(i));
    }
    r.end();
    let a = r.take();
    assert_eq!(reduces(&a).len(), layers);
    let sources: Vec<_> = a
        .iter()
        .filter_map(|x| match x {
            Action::CopyGradIn { param, source, .. } => Some((*param, *source)),
            _ => None,
        })
        .collect();
    assert_eq!(sources.len(), 2 * layers);
    for (p, s) in sources {
        let want = if p == layer(1)[1] { GradSource::Accumulated } else { GradSource::FreshPlusAccumulated };
        assert_eq!(s, want, "{p:?}");
    }
    assert!(r.s.last_step().zero_filled.is_empty());
    assert_eq!(r.s.unsynced_grads(), 0);
}

#[test]
fn a_forward_only_step_reduces_nothing() {
    let mut r = rig(3, no_prefetch());
    for i in 0..3 {
        r.fetch(&layer(i));
        r.release(&layer(i));
    }
    r.end();
    assert!(reduces(&r.out).is_empty());
    assert!(r.s.last_step().zero_filled.is_empty());
}

#[test]
fn reduce_dtype_and_divide_factors_are_per_bucket() {
    let plan = layered(2, 4);
    let g1 = plan.layout().gather_bucket_of(layer(1)[0]).unwrap();
    let cfg = SchedulerConfig {
        reduce_per_bucket: vec![(
            g1,
            GradReduce { dtype: Some(DType::F64), pre_divide: Some(2.0), post_divide: None },
        )],
        ..no_prefetch()
    };
    let mut reg = registry(&plan);
    let s = Scheduler::from_plan(&plan, 0, cfg, &mut reg).unwrap();
    let world = f64::from(plan.layout().world());
    let spec0 = s.reduce_spec(0).unwrap();
    assert_eq!((spec0.dtype, spec0.pre_divide, spec0.post_divide), (DType::F32, 1.0, world));
    let spec1 = s.reduce_spec(1).unwrap();
    assert_eq!((spec1.dtype, spec1.pre_divide, spec1.post_divide), (DType::F64, 2.0, world / 2.0));
    let mut r = Rig { plan, reg, s, out: Vec::new() };
    for p in layer(1) {
        r.grad(p);
    }
    let launch = &launches(&r.out)[0];
    assert_eq!(launch.reduce, Some(spec1));
    // The full-size gradient buffer is in the reduction dtype: f32 parameters reduced in f64
    // take twice the gathered bytes, in the AllocGrad, the launch and the counters alike.
    let gathered = r.s.grad_buckets()[1].gathered_bytes;
    let alloc: Vec<usize> = r
        .out
        .iter()
        .filter_map(|a| if let Action::AllocGrad { bytes, .. } = a { Some(*bytes) } else { None })
        .collect();
    assert_eq!(alloc, [2 * gathered]);
    assert_eq!(launch.bytes, 2 * gathered);
    assert_eq!(r.s.counters().reduced_bytes, 2 * gathered as u64);
}

#[test]
fn f16_divide_factors_split_as_fsdp2_splits_them_when_asked() {
    // FSDP2's `_get_gradient_divide_factors` for f16, worked by hand.
    for (factor, want) in [(1.0, (1.0, 1.0)), (2.0, (2.0, 1.0)), (3.0, (2.0, 1.5)), (6.0, (4.0, 1.5))] {
        assert_eq!(split_divide(factor), want, "factor {factor}");
    }
    for (factor, want) in [(8.0, (4.0, 2.0)), (16.0, (4.0, 4.0)), (1.5, (1.0, 1.5)), (64.0, (8.0, 8.0))] {
        assert_eq!(split_divide(factor), want, "factor {factor}");
    }
    let plan = layered(3, 4);
    let g1 = plan.layout().gather_bucket_of(layer(1)[0]).unwrap();
    let g2 = plan.layout().gather_bucket_of(layer(2)[0]).unwrap();
    let world = f64::from(plan.layout().world());
    let f16 = GradReduce { dtype: Some(DType::F16), ..GradReduce::default() };
    let per_bucket = vec![
        (g1, GradReduce { post_divide: Some(6.0), ..GradReduce::default() }),
        (g2, GradReduce { pre_divide: Some(1.0), post_divide: Some(6.0), dtype: None }),
    ];
    let specs = |split: bool| {
        let cfg = SchedulerConfig {
            reduce: f16,
            reduce_per_bucket: per_bucket.clone(),
            split_f16_divide: split,
            ..no_prefetch()
        };
        let s = Scheduler::from_plan(&plan, 0, cfg, &mut registry(&plan)).unwrap();
        (0..3).map(|j| s.reduce_spec(j).map(|r| (r.pre_divide, r.post_divide)).unwrap()).collect::<Vec<_>>()
    };
    // Split: the mean and the given factor alike; a pre_divide given is kept.
    assert_eq!(specs(true), [split_divide(world), (4.0, 1.5), (1.0, 6.0)]);
    assert_eq!(specs(false), [(1.0, world), (1.0, 6.0), (1.0, 6.0)]);
    // Other dtypes are not split.
    let cfg = SchedulerConfig { split_f16_divide: true, ..no_prefetch() };
    let s = Scheduler::from_plan(&plan, 0, cfg, &mut registry(&plan)).unwrap();
    assert_eq!(s.reduce_spec(0).map(|r| (r.pre_divide, r.post_divide)), Some((1.0, world)));
}

#[test]
fn gathers_after_a_shard_update_wait_for_it() {
    let mut r = rig(2, no_prefetch());
    let ev = EngineEvent { queue: 0, seq: 42 };
    r.ev(Event::ShardsUpdated(ev)).unwrap();
    r.fetch(&layer(0));
    assert_eq!(launches(&r.out)[0].after.as_slice(), [Fence::Engine(ev)]);
}

#[test]
fn trainability_changes_switch_plans_at_the_step_boundary() {
    let layers = 3;
    let mut r = rig(layers, SchedulerConfig::default());
    r.train_step(&[0, 1, 2]);
    let before = r.s.fingerprint();
    let mut mask = vec![true; 2 * layers];
    mask[0] = false;
    mask[1] = false; // freeze layer 0
    r.ev(Event::SetTrainable(&mask)).unwrap();
    // Mid-step nothing changes yet.
    assert_eq!(r.s.grad_buckets().len(), layers);
    r.end();
    assert_eq!(r.s.grad_buckets().len(), layers - 1);
    assert_ne!(r.s.fingerprint(), before);
    assert_eq!(r.s.grad_bucket_of(layer(0)[0]), None);
    let (refreshed, _) = r.plan.with_trainable(&mask).unwrap();
    assert_eq!(r.s.fingerprint(), refreshed.fingerprint().0);
    r.out.clear();
    // Layer 0 is frozen now: gradients only for 1 and 2.
    for i in 0..layers {
        r.fetch(&layer(i));
        r.release(&layer(i));
    }
    assert!(r.ev(Event::GradReady { param: layer(0)[0], after: None }).is_err());
    for i in 1..layers {
        for p in layer(i) {
            r.grad(p);
        }
    }
    r.end();
    assert_eq!(reduces(&r.out).len(), layers - 1);
    assert!(r.s.last_step().zero_filled.is_empty());
}

#[test]
fn a_refresh_with_unsynced_gradients_is_an_error_until_they_are_reduced() {
    let layers = 2;
    let mut r = rig(layers, no_prefetch());
    r.ev(Event::SetNoSync(true)).unwrap();
    r.grad(layer(0)[0]);
    let mask = [false, false, true, true];
    r.ev(Event::SetTrainable(&mask)).unwrap();
    let err = r.ev(Event::EndStep).unwrap_err();
    assert!(matches!(err, ScheduleError::RefreshWithUnsynced { count: 1, .. }), "{err}");
    assert!(err.to_string().contains("l0.w"));
    assert_eq!(r.s.grad_buckets().len(), layers, "plan changed despite the error");
    // A synced step reduces the accumulation; its end applies the pending mask.
    r.ev(Event::SetNoSync(false)).unwrap();
    r.end();
    assert_eq!(r.s.grad_buckets().len(), 1);
    // Explicit refresh mid-step is refused.
    r.grad(layer(1)[0]);
    let err = r.s.refresh_trainable(&[true; 4]).unwrap_err();
    assert!(matches!(err, ScheduleError::RefreshMidStep { .. }));
}

#[test]
fn with_check_trainable_off_only_an_explicit_refresh_changes_the_plan() {
    let mut r = rig(2, SchedulerConfig { check_trainable: false, ..no_prefetch() });
    let mask = [true, true, false, false];
    r.ev(Event::SetTrainable(&mask)).unwrap();
    r.end();
    assert_eq!(r.s.grad_buckets().len(), 2);
    assert!(r.s.refresh_trainable(&mask).unwrap());
    assert_eq!(r.s.grad_buckets().len(), 1);
    assert!(!r.s.refresh_trainable(&mask).unwrap());
}

#[test]
fn plan_agreement_names_the_first_differing_bucket() {
    let a = layered(4, 4);
    let b = layered(4, 4);
    let mut reg = registry(&a);
    let s = Scheduler::from_plan(&a, 0, no_prefetch(), &mut reg).unwrap();
    let peer_same = collsched_schedule::PlanDigests::of_plan(&b);
    s.check_peers([(1, &peer_same)]).unwrap();
    // Peer froze layer 2: its gradient buckets differ.
    let (c, _) = a.with_trainable(&[true, true, true, true, false, false, true, true]).unwrap();
    let peer = collsched_schedule::PlanDigests::of_plan(&c);
    let expected = (0..)
        .zip(s.digests().buckets.iter().zip(&peer.buckets))
        .find(|(_, (x, y))| x != y)
        .map(|(i, _)| BucketId(i));
    let err = s.check_peers([(1, &peer_same), (2, &peer)]).unwrap_err();
    match &err {
        ScheduleError::PlanMismatch { peer: 2, bucket, .. } => assert_eq!(*bucket, expected),
        e => panic!("{e}"),
    }
    assert!(expected.is_some());
    assert!(err.to_string().contains("rank 2"));
}

#[test]
fn plan_agreement_catches_a_different_bucket_boundary_knob() {
    use collsched_schedule::buckets::{Boundary, LayoutBuilder};
    // A peer built its layout with module boundaries: here every layer is already its own
    // bucket, so the buckets agree, but the settings do not.
    let a = layered(4, 4);
    let b = Plan::new(
        LayoutBuilder::new(a.layout().params(), a.layout().sharding(), 4)
            .bucket_bytes(a.layout().bucket_bytes())
            .align(a.layout().align())
            .boundary(Boundary::LAYER)
            .build()
            .unwrap(),
    );
    assert_eq!(a.layout().buckets(), b.layout().buckets());
    let mut reg = registry(&a);
    let s = Scheduler::from_plan(&a, 0, no_prefetch(), &mut reg).unwrap();
    let peer = collsched_schedule::PlanDigests::of_plan(&b);
    let err = s.check_peers([(3, &peer)]).unwrap_err();
    assert!(matches!(err, ScheduleError::PlanMismatch { peer: 3, bucket: None, .. }), "{err}");
    assert!(err.to_string().contains("bucket boundaries"), "{err}");
}

#[test]
fn steady_state_steps_reuse_the_action_buffer() {
    let mut r = rig(5, SchedulerConfig::default());
    for _ in 0..2 {
        r.train_step(&[0, 1, 2, 3, 4]);
        r.out.clear();
    }
    let cap = r.out.capacity();
    for _ in 0..3 {
        r.train_step(&[0, 1, 2, 3, 4]);
        r.out.clear();
    }
    assert_eq!(r.out.capacity(), cap);
    let _ = Role::Gather;
}

#[test]
fn hybrid_and_single_owner_buckets_launch_all_their_plan_ops_in_one_launch() {
    use collsched_schedule::buckets::{LayoutBuilder, ParamSet, ParamSpec, Sharding};
    let set =
        ParamSet::new(vec![ParamSpec::new("a", [4096], DType::BF16), ParamSpec::new("b", [8], DType::F32)])
            .unwrap();
    for sharding in [Sharding::Hybrid(2), Sharding::Greedy] {
        let plan = Plan::new(LayoutBuilder::new(&set, sharding, 4).build().unwrap());
        let mut reg = registry(&plan);
        let mut s = Scheduler::from_plan(&plan, 1, no_prefetch(), &mut reg).unwrap();
        let mut out = Vec::new();
        let ids: Vec<ParamId> = set.ids().collect();
        s.fetch(&mut reg, &ids, &mut out).unwrap();
        for id in &ids {
            s.grad_ready(&mut reg, *id, None, &mut out).unwrap();
        }
        let ls = launches(&out);
        assert_eq!(ls.len(), plan.layout().gather_buckets().len() + plan.layout().grad_buckets().len());
        for l in &ls {
            assert_eq!(l.ops.as_slice(), plan.ops_of(l.id.bucket), "{sharding}");
        }
        let ops: usize = ls.iter().map(|l| l.ops.len()).sum();
        assert_eq!(s.counters().ops_issued as usize, ops);
        for kind in [
            CollectiveKind::AllGather,
            CollectiveKind::ReduceScatter,
            CollectiveKind::AllReduce,
            CollectiveKind::Broadcast,
        ] {
            let want =
                ls.iter().flat_map(|l| l.ops.iter()).filter(|&&o| plan.op(o).unwrap().kind() == kind).count();
            assert_eq!(s.counters().ops_of_kind(kind) as usize, want, "{sharding} {kind:?}");
        }
    }
}

#[test]
fn scheduler_and_registry_can_move_between_threads() {
    fn send<T: Send>() {}
    fn sync<T: Sync>() {}
    send::<Scheduler>();
    send::<InflightRegistry>();
    sync::<InflightRegistry>();
}

#[test]
fn closing_a_scheduler_gives_back_everything_it_held() {
    let plan = layered(4, 4);
    let mut reg = registry(&plan);
    let mut train = Scheduler::from_plan(&plan, 0, SchedulerConfig::default(), &mut reg).unwrap();
    let mut eval = Scheduler::from_plan(&plan, 0, SchedulerConfig::default(), &mut reg).unwrap();
    let mut out = Vec::new();
    for s in [&mut train, &mut eval] {
        for i in 0..4 {
            s.fetch(&mut reg, &layer(i), &mut out).unwrap();
            s.release(&mut reg, &layer(i), None, &mut out).unwrap();
        }
        s.end_step(&mut reg, &mut out).unwrap();
    }
    // train: replay (prefetches), holds layer 0; eval holds layer 0 and 2.
    train.fetch(&mut reg, &layer(0), &mut out).unwrap();
    train.grad_ready(&mut reg, layer(0)[0], None, &mut out).unwrap();
    eval.fetch(&mut reg, &layer(0), &mut out).unwrap();
    eval.fetch(&mut reg, &layer(2), &mut out).unwrap();
    let held = train.close(&mut reg, &mut out).unwrap();
    assert_eq!(held, layer(0));
    assert_eq!(reg.users(layer(0)[0]), 1, "eval's hold survives");
    assert!(reg.gathered_by(layer(0)[0]).is_some());
    let held = eval.close(&mut reg, &mut out).unwrap();
    assert_eq!(held.len(), 4);
    assert_eq!(reg.live_bytes(), 0);
    let mut drv = CheckingDriver::default();
    drv.run(&out, |_| false);
    assert!(drv.live.is_empty(), "{:?}", drv.live);
}

#[test]
fn a_shard_update_frees_unused_prefetches_of_every_scheduler() {
    let mut r = rig(4, SchedulerConfig::default());
    let plan = r.plan.clone();
    let b = |i: usize| plan.layout().gather_bucket_of(layer(i)[0]).unwrap();
    let mut e = Explicit::default();
    e.after(b(3), &[b(0)]); // prefetch the next step's first layer, FSDP-style
    r.s.set_policy(Box::new(e));
    r.fetch(&layer(3));
    r.release(&layer(3));
    assert!(r.reg.gathered_by(layer(0)[0]).is_some());
    r.out.clear();
    r.ev(Event::ShardsUpdated(EngineEvent { queue: 0, seq: 1 })).unwrap();
    assert_eq!(frees(&r.out).iter().map(|f| f.bucket).collect::<Vec<_>>(), [b(0)]);
    assert_eq!(r.reg.live_bytes(), 0);
    assert_eq!(r.s.counters().discarded_prefetches, 1);
}

#[test]
fn bad_knobs_are_refused_with_their_name() {
    let plan = layered(2, 4);
    let grad_bucket = plan.layout().grad_buckets()[0].id();
    let bad = [
        SchedulerConfig {
            reduce: GradReduce { pre_divide: Some(0.0), ..GradReduce::default() },
            ..no_prefetch()
        },
        SchedulerConfig {
            reduce: GradReduce { post_divide: Some(f64::NAN), ..GradReduce::default() },
            ..no_prefetch()
        },
        SchedulerConfig { reduce_per_bucket: vec![(grad_bucket, GradReduce::default())], ..no_prefetch() },
    ];
    for (cfg, word) in bad.into_iter().zip(["pre_divide", "post_divide", "not a gather bucket"]) {
        let mut reg = registry(&plan);
        let err = Scheduler::from_plan(&plan, 0, cfg, &mut reg).unwrap_err();
        assert!(matches!(err, ScheduleError::BadConfig { .. }));
        assert!(err.to_string().contains(word), "{err}");
    }
}

#[test]
fn a_trace_that_keeps_missing_is_recorded_again() {
    let layers = 5;
    let mut r = rig(layers, SchedulerConfig { trace_rerecord_after: 2, ..SchedulerConfig::default() });
    let fwd = |r: &mut Rig, order: &[usize]| {
        for &i in order {
            r.fetch(&layer(i));
            r.release(&layer(i));
        }
        r.end();
        r.s.last_step().counters.clone()
    };
    fwd(&mut r, &[0, 1, 2, 3, 4]); // an unrepresentative first step
    let reversed = [4, 3, 2, 1, 0];
    let c1 = fwd(&mut r, &reversed);
    let c2 = fwd(&mut r, &reversed); // second lost step: records again at the end
    assert!(c1.prefetch_hits < 4 && c2.prefetch_hits < 4, "{c1:?} {c2:?}");
    fwd(&mut r, &reversed); // recorded
    let c4 = fwd(&mut r, &reversed);
    assert_eq!(c4.prefetch_hits, 4, "{c4:?}");
    assert_eq!(c4.prefetch_misses, 1);
}

/// Tables whose all-gathers place the pieces count a split bucket's unpacked copy alone, in the
/// registry and in the step's peak; a trainability refresh keeps them so.
#[test]
fn placed_buckets_count_their_unpacked_copy_alone_through_a_refresh() {
    use collsched_schedule::ScheduleInput;
    let plan = layered(2, 4);
    let plain = ScheduleInput::from_plan(&plan);
    let input = ScheduleInput::from_plan(&plan).placing(|_| true);
    assert!(plain.gather.iter().all(|b| !b.placed));
    for (p, b) in plain.gather.iter().zip(&input.gather) {
        // EvenSplit: every bucket splits its parameters over the ranks.
        assert!(p.unpacked_bytes > 0 && b.placed, "bucket {}", b.id);
        assert_eq!(p.memory_bytes(), p.gathered_bytes + p.unpacked_bytes);
        assert_eq!(b.memory_bytes(), b.unpacked_bytes);
    }
    assert!(ScheduleInput::from_plan(&plan).placing(|_| false).gather.iter().all(|b| !b.placed));
    let mut reg = InflightRegistry::new(&input);
    let s = Scheduler::from_plan_input(&plan, &input, 0, no_prefetch(), &mut reg).unwrap();
    let mut r = Rig { plan, reg, s, out: Vec::new() };
    let first = layer(0);
    r.fetch(&first);
    assert_eq!(r.reg.live_bytes(), input.gather[0].unpacked_bytes);
    r.release(&first);
    r.end();
    assert!(r.s.refresh_trainable(&[true, true, false, false]).unwrap());
    r.fetch(&first);
    assert_eq!(r.reg.live_bytes(), input.gather[0].unpacked_bytes, "after the refresh");
    r.release(&first);
}

#[test]
fn a_bucket_held_over_a_step_boundary_keeps_the_replay_in_order_and_releases_between_steps_prefetch_nothing()
{
    let cfg = SchedulerConfig { max_inflight: 1, ..SchedulerConfig::default() };
    let mut r = rig(4, cfg);
    let plan = r.plan.clone();
    let b = |i: usize| plan.layout().gather_bucket_of(layer(i)[0]).unwrap();
    let gathered = |a: &[Action]| launches(a).iter().map(|l| (l.id.bucket, l.prefetch)).collect::<Vec<_>>();
    // Step 0 records the order; step 1 ends with layers 0 and 1 still fetched (an engine's
    // reshard_after_backward=False keeps them into the next step).
    for i in 0..4 {
        r.fetch(&layer(i));
        r.release(&layer(i));
    }
    r.end();
    for i in 0..4 {
        r.fetch(&layer(i));
        if i >= 2 {
            r.release(&layer(i));
        }
    }
    r.end();
    assert_eq!(r.s.last_step().held.len(), 2 * layer(0).len(), "{:?}", r.s.last_step());
    r.out.clear();
    // Step 2: the held layers are fetched again (nothing gathered) and their holds dropped;
    // the replay goes on past them: layer 2 is prefetched once layer 1 is fetched.
    r.fetch(&layer(0));
    r.release(&layer(0));
    r.release(&layer(0));
    assert_eq!(gathered(&r.take()), [], "layer 1 is held: nothing to prefetch yet");
    r.fetch(&layer(1));
    assert_eq!(gathered(&r.take()), [(b(2), true)]);
    r.release(&layer(1));
    r.release(&layer(1));
    r.fetch(&layer(2));
    r.release(&layer(2));
    r.fetch(&layer(3));
    r.release(&layer(3));
    let c = r.s.counters().clone();
    assert_eq!((c.already_gathered, c.prefetch_hits, c.discarded_prefetches), (2, 2, 0), "{c:?}");
    assert_eq!(c.all_gathers, 2, "{c:?}");
    // Held over again, then released between steps: freed, and no prefetch launched.
    r.fetch(&layer(0));
    r.end();
    r.out.clear();
    r.release(&layer(0));
    let a = r.take();
    assert_eq!(gathered(&a), [], "a release between steps launched a gather");
    assert_eq!(frees(&a).iter().map(|f| f.bucket).collect::<Vec<_>>(), [b(0)]);
    assert_eq!(r.reg.live_bytes(), 0);
}

#[test]
fn a_bucket_kept_from_the_forward_fires_the_backward_rules_at_its_backward_fetch() {
    // FSDP2's root kept fetched into its backward (reshard_after_forward=False): its fetch in
    // the backward gathers nothing, and an explicit backward rule on it still prefetches the
    // layer the backward reaches next.
    let mut r = rig(4, no_prefetch());
    let plan = r.plan.clone();
    let b = |i: usize| plan.layout().gather_bucket_of(layer(i)[0]).unwrap();
    let gathered = |a: &[Action]| launches(a).iter().map(|l| (l.id.bucket, l.prefetch)).collect::<Vec<_>>();
    let mut e = Explicit::default();
    e.after_in_backward(b(0), &[b(3)]);
    r.s.set_policy(Box::new(e));
    for i in 0..4 {
        r.fetch(&layer(i));
        if i > 0 {
            r.release(&layer(i));
        }
    }
    r.s.begin_backward();
    r.out.clear();
    r.fetch(&layer(0));
    assert_eq!(gathered(&r.take()), [(b(3), true)], "the rule on the kept bucket did not fire");
    r.release(&layer(0));
    r.fetch(&layer(3));
    assert_eq!(gathered(&r.take()), [], "layer 3 was gathered again");
    let c = r.s.counters().clone();
    assert_eq!((c.already_gathered, c.prefetch_hits), (1, 1), "{c:?}");
    // Gathered once in the forward, layer 3 once more ahead of its backward fetch.
    assert_eq!(c.all_gathers, 5, "{c:?}");
}
