//! Prefetch policies: what to gather ahead of the engine's fetches.
//!
//! # Design note: prefetch
//! A policy only *proposes*: after each fetch (and after each release that freed memory, but
//! between steps, where nothing is prefetched) the scheduler asks it for candidates, best first, and launches each one that is not gathered
//! yet while the budgets allow (`prefetch_bytes`, `max_inflight`, `max_live_bytes`), stopping
//! at the first one that does not fit (so the order of the proposal is kept). The first bucket
//! ahead is always admitted by `prefetch_bytes` (a bucket larger than the budget is still
//! prefetched one ahead); further ones must fit in it; `max_inflight` and `max_live_bytes`
//! bound every prefetch. The policy sees
//! only the sequence of fetched buckets, and the budgets count only launched-but-not-fetched
//! and gathered-but-not-released state, so **what is launched is a function of the engine's
//! event sequence alone**: every rank launches the same collectives in the same order whatever
//! the completion timing.
//!
//! [`TraceReplay`] records the first step's bucket order and replays it. When a fetch is not
//! the next bucket of the trace, it looks for that bucket further on and continues from
//! there within the same step (DeepSpeed instead drops prefetch until the next step); a bucket
//! not in the rest of the trace leaves the position where it was. Buckets it launched that
//! the step then skipped are drained at `end_step`.

use crate::buckets::BucketId;
use smallvec::SmallVec;

/// The scheduler's answer to a proposed bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    /// Launched now.
    Launched,
    /// Not a gather bucket of this plan: nothing to do, go on.
    Skipped,
    /// Already gathered (held, or prefetched earlier): nothing to launch now. A policy that
    /// replays an order should wait here, since the bucket may be freed before its turn.
    Live,
    /// Over a budget: stop proposing for now (ask again later from the same place).
    Stop,
}

/// Decides which gather buckets to launch ahead of their fetch.
///
/// Implementations must be deterministic functions of the calls they receive (never of time):
/// all ranks must launch the same collectives in the same order. `Send + Sync`, so that a
/// scheduler may be used from whichever thread an engine calls from (autograd calls hooks
/// from its device threads) while another holds a reference to it.
pub trait PrefetchPolicy: std::fmt::Debug + Send + Sync {
    /// A short name for logs and counters.
    fn name(&self) -> &'static str;
    /// The engine fetched `bucket` (the first fetch by this scheduler since it last held it).
    fn observe_fetch(&mut self, bucket: BucketId);
    /// Propose buckets, best first, until `offer` returns [`Offer::Stop`] or nothing is left.
    fn candidates(&mut self, offer: &mut dyn FnMut(BucketId) -> Offer);
    /// Buckets this policy proposed earlier that it now expects not to be fetched (e.g. trace
    /// positions jumped over at a divergence): the scheduler frees them if they are still
    /// unused prefetches, which gives their budget back. Called after each
    /// [`observe_fetch`](Self::observe_fetch). Default: none.
    fn take_skipped(&mut self, _skipped: &mut dyn FnMut(BucketId)) {}
    /// The engine's backward pass of this step begins: later fetches of the step are for the
    /// backward (an engine event; see [`Scheduler::begin_backward`](super::Scheduler::begin_backward)).
    /// Default: nothing.
    fn begin_backward(&mut self) {}
    /// The step ended.
    fn end_step(&mut self) {}
}

/// Launches nothing ahead.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoPrefetch;

impl PrefetchPolicy for NoPrefetch {
    fn name(&self) -> &'static str {
        "none"
    }
    fn observe_fetch(&mut self, _bucket: BucketId) {}
    fn candidates(&mut self, _offer: &mut dyn FnMut(BucketId) -> Offer) {}
}

/// Records the first step's fetch order of buckets and replays it on later steps, re-syncing
/// at the point of divergence (see the module docs).
///
/// # Examples
/// ```
/// use collsched_schedule::buckets::BucketId;
/// use collsched_schedule::{Offer, PrefetchPolicy, TraceReplay};
/// let mut t = TraceReplay::default();
/// for b in [0, 1, 2, 3] { t.observe_fetch(BucketId(b)); }
/// t.end_step();
/// t.observe_fetch(BucketId(0));
/// t.observe_fetch(BucketId(2)); // diverged: 1 skipped; continue after 2
/// let mut proposed = Vec::new();
/// t.candidates(&mut |b| { proposed.push(b); Offer::Launched });
/// assert_eq!(proposed, [BucketId(3)]);
/// ```
#[derive(Clone, Debug, Default)]
pub struct TraceReplay {
    trace: Vec<BucketId>,
    recorded: bool,
    cursor: usize,
    offered: usize,
    divergences: u64,
    skipped: Vec<BucketId>,
    rerecord_after: u32,
    lost_this_step: u32,
    lost_steps: u32,
}

impl TraceReplay {
    /// A replay that records again after `steps` consecutive steps with fetches the trace
    /// does not have ahead of its position (0: never; see
    /// [`SchedulerConfig::trace_rerecord_after`](super::SchedulerConfig::trace_rerecord_after)).
    pub fn with_rerecord_after(steps: u32) -> TraceReplay {
        TraceReplay { rerecord_after: steps, ..TraceReplay::default() }
    }

    /// Consecutive replayed steps so far that had fetches the trace did not have ahead.
    pub fn lost_steps(&self) -> u32 {
        self.lost_steps
    }

    /// The recorded trace (empty while recording the first step).
    pub fn trace(&self) -> &[BucketId] {
        if self.recorded {
            &self.trace
        } else {
            &[]
        }
    }

    /// Fetches that did not match the next bucket of the trace, since creation.
    pub fn divergences(&self) -> u64 {
        self.divergences
    }

    /// Position in the trace of the next expected fetch.
    pub fn cursor(&self) -> usize {
        self.cursor
    }

    /// Forgets the trace and records again on the next step.
    pub fn rerecord(&mut self) {
        self.trace.clear();
        self.skipped.clear();
        self.lost_this_step = 0;
        self.recorded = false;
        self.cursor = 0;
        self.offered = 0;
    }
}

impl PrefetchPolicy for TraceReplay {
    fn name(&self) -> &'static str {
        "trace-replay"
    }

    fn observe_fetch(&mut self, bucket: BucketId) {
        if !self.recorded {
            self.trace.push(bucket);
            return;
        }
        if self.trace.get(self.cursor) == Some(&bucket) {
            self.cursor += 1;
        } else {
            self.divergences += 1;
            let from = self.cursor.min(self.trace.len());
            if let Some(j) = self.trace[from..].iter().position(|&b| b == bucket) {
                // Positions jumped over that were already proposed are not coming.
                let proposed = self.offered.clamp(from, from + j);
                self.skipped.extend_from_slice(&self.trace[from..proposed]);
                self.cursor = from + j + 1;
            } else {
                self.lost_this_step += 1;
            }
        }
        self.offered = self.offered.max(self.cursor);
    }

    fn take_skipped(&mut self, skipped: &mut dyn FnMut(BucketId)) {
        for &b in &self.skipped {
            skipped(b);
        }
        self.skipped.clear();
    }

    fn candidates(&mut self, offer: &mut dyn FnMut(BucketId) -> Offer) {
        if !self.recorded {
            return;
        }
        while let Some(&b) = self.trace.get(self.offered) {
            if matches!(offer(b), Offer::Stop | Offer::Live) {
                break;
            }
            self.offered += 1;
        }
    }

    fn end_step(&mut self) {
        if self.recorded {
            self.lost_steps = if self.lost_this_step > 0 { self.lost_steps + 1 } else { 0 };
            self.lost_this_step = 0;
            if self.rerecord_after > 0 && self.lost_steps >= self.rerecord_after {
                self.rerecord();
                self.lost_steps = 0;
                return;
            }
        }
        if !self.recorded && !self.trace.is_empty() {
            self.recorded = true;
            self.skipped.reserve(self.trace.len());
        }
        self.skipped.clear();
        self.cursor = 0;
        self.offered = 0;
    }
}

/// The engine names what to prefetch after each fetch (FSDP2's
/// `set_modules_to_forward_prefetch`): after bucket `a` is fetched, propose the listed buckets
/// in order.
///
/// # Examples
/// ```
/// use collsched_schedule::buckets::BucketId;
/// use collsched_schedule::{Explicit, Offer, PrefetchPolicy};
/// let mut e = Explicit::default();
/// e.after(BucketId(0), &[BucketId(1), BucketId(2)]);
/// e.observe_fetch(BucketId(0));
/// let mut proposed = Vec::new();
/// e.candidates(&mut |b| { proposed.push(b); Offer::Launched });
/// assert_eq!(proposed, [BucketId(1), BucketId(2)]);
/// ```
///
/// Rules given with [`after_in_backward`](Explicit::after_in_backward) (FSDP2's
/// `set_modules_to_backward_prefetch`) replace the forward ones for the fetches after
/// [`begin_backward`](PrefetchPolicy::begin_backward), until the step ends.
#[derive(Clone, Debug, Default)]
pub struct Explicit {
    rules: Vec<SmallVec<[BucketId; 4]>>,
    /// Rules of the backward pass (empty: the forward rules apply throughout).
    backward: Vec<SmallVec<[BucketId; 4]>>,
    /// Whether this step's backward began.
    in_backward: bool,
    current: Option<BucketId>,
    next: usize,
    /// See [`Explicit::once_per_step`].
    once: bool,
    /// With `once`: the buckets whose rule fired this step (by bucket index), in the forward
    /// and in the backward.
    fired: Vec<bool>,
    fired_backward: Vec<bool>,
}

impl Explicit {
    /// After `bucket` is fetched, prefetch `then` (in order). Replaces an earlier rule for
    /// `bucket`.
    pub fn after(&mut self, bucket: BucketId, then: &[BucketId]) -> &mut Self {
        if self.rules.len() <= bucket.index() {
            self.rules.resize(bucket.index() + 1, SmallVec::new());
        }
        self.rules[bucket.index()] = then.iter().copied().collect();
        self
    }

    /// In the backward pass, after `bucket` is fetched, prefetch `then` (in order). Once any
    /// backward rule exists, backward fetches follow the backward rules only.
    ///
    /// # Examples
    /// ```
    /// use collsched_schedule::buckets::BucketId;
    /// use collsched_schedule::{Explicit, Offer, PrefetchPolicy};
    /// let mut e = Explicit::default();
    /// e.after(BucketId(1), &[BucketId(2)]).after_in_backward(BucketId(1), &[BucketId(0)]);
    /// e.once_per_step(true);
    /// let mut proposed = Vec::new();
    /// e.observe_fetch(BucketId(1)); // forward
    /// e.candidates(&mut |b| { proposed.push(b); Offer::Launched });
    /// e.begin_backward();
    /// e.observe_fetch(BucketId(1)); // backward: its own rule, fired once too
    /// e.candidates(&mut |b| { proposed.push(b); Offer::Launched });
    /// e.observe_fetch(BucketId(1));
    /// e.candidates(&mut |b| { proposed.push(b); Offer::Launched });
    /// assert_eq!(proposed, [BucketId(2), BucketId(0)]);
    /// e.end_step(); // the next step starts in its forward
    /// e.observe_fetch(BucketId(1));
    /// e.candidates(&mut |b| { proposed.push(b); Offer::Launched });
    /// assert_eq!(proposed, [BucketId(2), BucketId(0), BucketId(2)]);
    /// ```
    pub fn after_in_backward(&mut self, bucket: BucketId, then: &[BucketId]) -> &mut Self {
        if self.backward.len() <= bucket.index() {
            self.backward.resize(bucket.index() + 1, SmallVec::new());
        }
        self.backward[bucket.index()] = then.iter().copied().collect();
        self
    }

    /// The rule for `bucket` (empty if none).
    pub fn rule(&self, bucket: BucketId) -> &[BucketId] {
        self.rules.get(bucket.index()).map_or(&[], |r| r.as_slice())
    }

    /// The rules that apply now.
    fn table(&self) -> &[SmallVec<[BucketId; 4]>] {
        if self.in_backward && !self.backward.is_empty() {
            &self.backward
        } else {
            &self.rules
        }
    }

    /// With `once`, a bucket's rule fires at its first fetch of a step only; later fetches of
    /// the same bucket in that step propose nothing. Rules keyed by buckets need it when a
    /// bucket is fetched by two modules of one pass: a tied embedding whose bucket ends both
    /// `embed` and `head` would otherwise fire "after `embed`, prefetch block 0" again at
    /// `head`. Default `false` (every fetch fires its rule).
    ///
    /// # Examples
    /// ```
    /// use collsched_schedule::buckets::BucketId;
    /// use collsched_schedule::{Explicit, Offer, PrefetchPolicy};
    /// let mut e = Explicit::default();
    /// e.after(BucketId(0), &[BucketId(1)]).once_per_step(true);
    /// let mut proposed = Vec::new();
    /// for _ in 0..2 {
    ///     e.observe_fetch(BucketId(0));
    ///     e.candidates(&mut |b| { proposed.push(b); Offer::Launched });
    /// }
    /// assert_eq!(proposed, [BucketId(1)]); // the second fetch proposed nothing
    /// e.end_step();
    /// e.observe_fetch(BucketId(0));
    /// e.candidates(&mut |b| { proposed.push(b); Offer::Launched });
    /// assert_eq!(proposed, [BucketId(1), BucketId(1)]); // a new step fires it again
    /// ```
    pub fn once_per_step(&mut self, once: bool) -> &mut Self {
        self.once = once;
        self
    }
}

impl PrefetchPolicy for Explicit {
    fn name(&self) -> &'static str {
        "explicit"
    }

    fn observe_fetch(&mut self, bucket: BucketId) {
        self.current = Some(bucket);
        self.next = 0;
        if self.once {
            let i = bucket.index();
            let has_rule = self.table().get(i).is_some_and(|r| !r.is_empty());
            let backward = self.in_backward && !self.backward.is_empty();
            let fired = if backward { &mut self.fired_backward } else { &mut self.fired };
            if fired.get(i).copied().unwrap_or(false) {
                // Fired earlier this step (in this pass): this fetch proposes nothing.
                self.current = None;
            } else if has_rule {
                if fired.len() <= i {
                    fired.resize(i + 1, false);
                }
                fired[i] = true;
            }
        }
    }

    fn candidates(&mut self, offer: &mut dyn FnMut(BucketId) -> Offer) {
        let Some(cur) = self.current else { return };
        let mut next = self.next;
        let Some(rule) = self.table().get(cur.index()) else { return };
        while let Some(&b) = rule.get(next) {
            if offer(b) == Offer::Stop {
                break;
            }
            next += 1;
        }
        self.next = next;
    }

    fn begin_backward(&mut self) {
        self.in_backward = true;
        self.current = None;
        self.next = 0;
    }

    fn end_step(&mut self) {
        self.current = None;
        self.next = 0;
        self.in_backward = false;
        self.fired.fill(false);
        self.fired_backward.fill(false);
    }
}
