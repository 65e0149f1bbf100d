//! A real run's trace beside the simulated one (`collsched sim ... --against REAL.json`).
//!
//! The real trace is Chrome trace JSON on the simulator's tracks (`collsched flight DIR
//! --trace-out`: `pid` = rank, `tid` 1 all-gather, 2 reduce-scatter, 0 compute, `"X"` events in
//! microseconds). Compute spans (categories `forward`, `backward`, `recompute`, and the step's
//! `loss` and `update` outside the layers) are compared with the simulator's layer arithmetic on
//! the same rank, by kind, layer and occurrence where their names carry layers (`"forward 3"`),
//! else by order; a layer's pieces within one phase of a step (a root's forward around its blocks')
//! count as one span. On each rank's collective track a real collective named `... bucket B` is
//! matched with the simulated one of bucket `B` of the same occurrence (the k-th gather of `B` with
//! the k-th), within each step where the real collectives carry their engine's step (the k-th step
//! with collectives on the track is the simulation's k-th: under gradient accumulation the
//! reduce-scatter track's steps are the synchronized ones): collectives one side has and the other
//! lacks (a plan agreement, a final gather) are left unmatched and counted, and shift no pair of
//! another step. Where the real collectives carry engines (`collsched flight`'s from a runtime
//! engine), each rank's are those of the engine with the most on it (a training engine); the others
//! (an evaluation engine's, a model built and replaced, a second layout) are left out and counted.
//! A track whose real names carry no bucket the simulation has is matched by order, the k-th with
//! the k-th (a stream runs its collectives in order; past a collective one side lacks, those pairs
//! are not the same one: the table says so). [`compare`] sums each track's busy time on both sides,
//! names the pair that differs most and counts the collective pairs whose bytes differ (a real
//! event's `args.bytes` against the simulated bucket's,
//! [`Timeline::bucket_bytes`](super::report::Timeline::bucket_bytes)), and [`overlay`] adds the
//! real events to the simulator's own trace as processes [`real_pid_base`]` + rank` ("real rank
//! R"), so one Perfetto view shows both.

use serde_json::Value;

use super::report::SimReport;
use super::step::NO_LAYER;

/// The first process id of the real events in an [`overlay`] of a simulated world of `world`
/// ranks: the first multiple of 1000 above the simulated ranks (1000 below 1000 ranks).
pub fn real_pid_base(world: u32) -> u64 {
    (u64::from(world) / 1000 + 1) * 1000
}

/// The largest rank a real trace may name.
pub const MAX_REAL_RANK: u64 = 1 << 20;

/// The tracks compared: the two collective tracks (`tid` 1 and 2), by the simulator's lane
/// order, then the compute track (`tid` 0: forward, backward and recomputed layers).
pub const LANES: [&str; 3] = ["all-gather", "reduce-scatter", "compute"];

/// The Chrome trace thread of each of [`LANES`].
const TIDS: [u64; 3] = [1, 2, 0];

/// Whether a compute-track event of this category is layer arithmetic (what a real record's
/// compute spans are; the simulator's waits and host time on that track are not).
fn arithmetic(cat: &str) -> bool {
    matches!(cat, "forward" | "backward" | "recompute" | "loss" | "update")
}

/// One collective or compute span of the real trace.
#[derive(Clone, Debug, PartialEq)]
pub struct RealEvent {
    /// Its rank (`pid`).
    pub rank: u64,
    /// 0 all-gather, 1 reduce-scatter, 2 compute (of [`LANES`]).
    pub lane: usize,
    /// Its name (`"all_gather bucket 3"`).
    pub name: String,
    /// Start, microseconds.
    pub ts_us: f64,
    /// Duration, microseconds.
    pub dur_us: f64,
    /// A compute span's step (1-based, its `args.step`), where the trace says.
    pub step: Option<u64>,
    /// A collective's bytes (its `args.bytes`: this rank's output), where the trace says.
    pub bytes: Option<u64>,
    /// A collective's engine (its `args.engine`: the runtime engine that launched it), where
    /// the trace says.
    pub engine: Option<u64>,
}

/// The pair of a track that differs most.
#[derive(Clone, Debug, PartialEq)]
pub struct Worst {
    /// Its position on the track (0-based).
    pub k: usize,
    /// The real collective's name.
    pub name: String,
    /// The simulated duration, microseconds.
    pub sim_us: f64,
    /// The real duration, microseconds.
    pub real_us: f64,
}

/// How a track's collectives were paired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Matching {
    /// By bucket and occurrence (the real names carry buckets the simulation has).
    Bucket,
    /// By bucket, step and occurrence within the step (the real collectives carry their
    /// engine's step too: the k-th step with collectives on the track is the simulation's k-th).
    BucketStep,
    /// Compute, by kind, layer and occurrence (the real names are `"forward L"` with `L` a
    /// layer the simulation has).
    Layer,
    /// The k-th with the k-th.
    Order,
}

/// The bucket a collective's name carries (`"all_gather bucket 3 (prefetch)"`: 3).
pub fn bucket_of(name: &str) -> Option<u32> {
    let (_, rest) = name.rsplit_once("bucket ")?;
    rest.split_whitespace().next()?.parse().ok()
}

/// One rank's collective or compute track on both sides.
#[derive(Clone, Debug, PartialEq)]
pub struct TrackCompare {
    /// The rank.
    pub rank: u64,
    /// 0 all-gather, 1 reduce-scatter, 2 compute (of [`LANES`]).
    pub lane: usize,
    /// Simulated collectives on the track.
    pub sim_count: usize,
    /// Real collectives on the track.
    pub real_count: usize,
    /// Summed simulated durations, microseconds.
    pub sim_busy_us: f64,
    /// Summed real durations, microseconds.
    pub real_busy_us: f64,
    /// How the pairs were made.
    pub matching: Matching,
    /// Pairs made (`min(sim_count, real_count)` by order).
    pub pairs: usize,
    /// Among the pairs (`k`: the real collective's position on its track); `None` when
    /// there is none.
    pub worst: Option<Worst>,
    /// Collective pairs whose bytes differ (the real event's `bytes` against the simulated
    /// bucket's): buckets of the same id that are not the same bucket (another bucket cap,
    /// boundary or parameter order than the run's), or a real collective of another model or
    /// engine in the record paired by occurrence. 0 where the real events carry no bytes.
    pub sized_apart: usize,
    /// The engine whose collectives are compared, where the real ones carry engines: the one
    /// with the most collectives on the rank (a training engine; not an evaluation engine's
    /// gathers, a model built and then replaced, a second layout).
    pub engine: Option<u64>,
    /// Real collectives on the track left out: another engine's, or none's where `engine` is
    /// set.
    pub left_out: usize,
}

/// The pairs `(simulated, real)` of one track, as indices, and how they were made: by key and
/// occurrence (the k-th of a key with the k-th; `sim_key` of a simulated span, `real_key` of a
/// real event) where some real event has a `decisive` key the simulation has (`keyed` says so),
/// else the k-th with the k-th.
fn pair_by<'a, K: Eq + std::hash::Hash>(
    sim: &'a [super::report::Span],
    real: &[&'a RealEvent],
    sim_key: impl Fn(&'a super::report::Span) -> K,
    real_key: impl Fn(&'a RealEvent) -> Option<K>,
    (keyed, decisive): (Matching, impl Fn(&K) -> bool),
) -> (Vec<(usize, usize)>, Matching) {
    let mut by_key: std::collections::HashMap<K, std::collections::VecDeque<usize>> =
        std::collections::HashMap::new();
    for (i, s) in sim.iter().enumerate() {
        by_key.entry(sim_key(s)).or_default().push_back(i);
    }
    if !real.iter().any(|r| real_key(r).is_some_and(|k| decisive(&k) && by_key.contains_key(&k))) {
        return ((0..sim.len().min(real.len())).map(|k| (k, k)).collect(), Matching::Order);
    }
    let mut out = Vec::new();
    for (k, r) in real.iter().enumerate() {
        if let Some(i) = real_key(r).and_then(|key| by_key.get_mut(&key)).and_then(|q| q.pop_front()) {
            out.push((i, k));
        }
    }
    (out, keyed)
}

/// A layer's compute that ran in pieces, other layers' between them (`collsched.torch`'s root
/// around its blocks), as one span, the simulator's: within a phase of a step (a run of spans
/// of one kind), the spans of one name joined at the first one's start, their durations
/// summed. Spans one a layer a phase (the demo's) are left as they are.
fn join_pieces(track: &[&RealEvent]) -> Vec<RealEvent> {
    let kind = |e: &RealEvent| e.name.split_whitespace().next().map(str::to_owned);
    let mut out: Vec<RealEvent> = Vec::new();
    let mut phase = 0;
    for &e in track {
        // A trace without steps joins nothing (its phases cannot be told apart).
        if out.get(phase).is_none_or(|f| f.step.is_none() || f.step != e.step || kind(f) != kind(e)) {
            phase = out.len();
        }
        match out[phase..].iter_mut().find(|x| x.name == e.name) {
            Some(x) => x.dur_us += e.dur_us,
            None => out.push(e.clone()),
        }
    }
    out
}

/// A compute span's kind and layer from its real name (`"backward 3"`: backward, 3); the
/// step's compute outside the layers (`"loss"`, `"update"`) has the simulator's layer of none.
fn layer_of(name: &str) -> Option<(&str, u32)> {
    let mut words = name.split_whitespace();
    let kind = words.next().filter(|k| arithmetic(k))?;
    match (kind, words.next()) {
        ("loss" | "update", None) => Some((kind, NO_LAYER)),
        (_, Some(layer)) => Some((kind, layer.parse().ok()?)),
        _ => None,
    }
}

/// The distinct steps of `track`'s events, in order, where every one carries its step and there
/// is one.
fn lane_steps(track: &[&RealEvent]) -> Option<Vec<u64>> {
    let mut steps: Vec<u64> = track.iter().map(|e| e.step).collect::<Option<_>>()?;
    steps.sort_unstable();
    steps.dedup();
    (!steps.is_empty()).then_some(steps)
}

/// The engine with the most collectives on `rank` in `real` (ties: the later made, the higher
/// number), where any carries one.
fn main_engine(real: &[RealEvent], rank: u64) -> Option<u64> {
    let mut count: std::collections::BTreeMap<u64, usize> = std::collections::BTreeMap::new();
    for e in real.iter().filter(|e| e.rank == rank && e.lane < 2) {
        if let Some(engine) = e.engine {
            *count.entry(engine).or_default() += 1;
        }
    }
    count.into_iter().max_by_key(|&(engine, n)| (n, engine)).map(|(engine, _)| engine)
}

/// The collectives of a real trace, in time order per track.
///
/// # Errors
/// Text that is not a Chrome trace (`{"traceEvents": [...]}`), or a collective event without a
/// finite, non-negative `ts` and `dur`, or without a rank.
pub fn parse_real(text: &str) -> Result<Vec<RealEvent>, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let events = v
        .get("traceEvents")
        .and_then(Value::as_array)
        .ok_or("no \"traceEvents\" array: write one with `collsched flight DIR --trace-out FILE.json`")?;
    let mut out = Vec::new();
    for (i, e) in events.iter().enumerate() {
        if e.get("ph").and_then(Value::as_str) != Some("X") {
            continue;
        }
        let lane = match e.get("tid").and_then(Value::as_u64) {
            Some(1) => 0,
            Some(2) => 1,
            Some(0) if e.get("cat").and_then(Value::as_str).is_some_and(arithmetic) => 2,
            _ => continue,
        };
        let rank =
            e.get("pid").and_then(Value::as_u64).ok_or(format!("event {i}: no numeric \"pid\" (rank)"))?;
        if rank > MAX_REAL_RANK {
            return Err(format!("event {i}: rank (\"pid\") {rank} is above {MAX_REAL_RANK}"));
        }
        let num = |key: &str| {
            e.get(key)
                .and_then(Value::as_f64)
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or(format!("event {i} (rank {rank}): \"{key}\" is not a non-negative number"))
        };
        let name = e.get("name").and_then(Value::as_str).unwrap_or("?").to_owned();
        let arg = |key: &str| e.get("args").and_then(|a| a.get(key)).and_then(Value::as_u64);
        let (step, bytes, engine) = (arg("step"), arg("bytes"), arg("engine"));
        out.push(RealEvent { rank, lane, name, ts_us: num("ts")?, dur_us: num("dur")?, step, bytes, engine });
    }
    out.sort_by(|a, b| (a.rank, a.lane).cmp(&(b.rank, b.lane)).then(a.ts_us.total_cmp(&b.ts_us)));
    Ok(out)
}

/// Every rank's collective tracks of `report` (simulated with a timeline) against `real`,
/// for the ranks either side has, by rank then lane; and a rank's compute track where `real`
/// has compute on it (its layer arithmetic against the simulator's, paired by kind, layer and
/// occurrence, or by order).
///
/// # Errors
/// A report without a timeline.
pub fn compare(report: &SimReport, real: &[RealEvent]) -> Result<Vec<TrackCompare>, String> {
    let tl = report.timeline.as_ref().ok_or("the simulation recorded no timeline")?;
    let ranks: std::collections::BTreeSet<u64> =
        (0..u64::from(report.world)).chain(real.iter().map(|e| e.rank)).collect();
    let mut out = Vec::new();
    for rank in ranks {
        let lanes = if real.iter().any(|e| e.rank == rank && e.lane == 2) { 3 } else { 2 };
        let simulated = rank < u64::from(report.world);
        let engine = main_engine(real, rank);
        // The simulator's layer arithmetic on this rank.
        let computed: Vec<super::report::Span> = match tl.compute.get(rank as usize) {
            Some(spans) if simulated => spans.iter().filter(|s| s.kind.is_compute()).copied().collect(),
            _ => Vec::new(),
        };
        for lane in 0..lanes {
            // The simulator's collectives run on every rank at once: one list for all.
            let sim: &[_] = match lane {
                2 => &computed,
                _ if simulated => &tl.collectives[lane],
                _ => &[],
            };
            let mut mine: Vec<&RealEvent> =
                real.iter().filter(|e| e.rank == rank && e.lane == lane).collect();
            let all = mine.len();
            if lane < 2 && engine.is_some() {
                mine.retain(|e| e.engine == engine);
            }
            let joined;
            if lane == 2 {
                joined = join_pieces(&mine);
                mine = joined.iter().collect();
            }
            let mut worst: Option<Worst> = None;
            let mut sized_apart = 0;
            // Collectives by bucket, compute by kind and layer (a recomputation one side lacks
            // stays unpaired); by order where the real names carry neither.
            // (The step's loss and update carry no layer: they alone pair nothing by layer.)
            let (pairs, matching) = if lane == 2 {
                let by_layer = |k: &(&str, u32)| k.1 != NO_LAYER;
                let sim_key = |s: &super::report::Span| (s.kind.name(), s.index);
                pair_by(sim, &mine, sim_key, |e| layer_of(&e.name), (Matching::Layer, by_layer))
            } else if let Some(steps) = lane_steps(&mine) {
                // Every collective carries its step: the k-th step with collectives on this
                // track is the simulation's k-th (a no_sync micro-batch's step, which reduces
                // nothing, is not one on the reduce-scatter track); a collective one side lacks
                // in a step leaves the other steps' pairs alone.
                let sim_key = |s: &super::report::Span| (s.index, u64::from(s.step));
                let real_key = |e: &RealEvent| {
                    let k = steps.binary_search(&e.step?).ok()?;
                    Some((bucket_of(&e.name)?, k as u64))
                };
                pair_by(sim, &mine, sim_key, real_key, (Matching::BucketStep, |_: &(u32, u64)| true))
            } else {
                let real_key = |e: &RealEvent| bucket_of(&e.name);
                pair_by(sim, &mine, |s| s.index, real_key, (Matching::Bucket, |_: &u32| true))
            };
            for &(i, k) in &pairs {
                let (s, r) = (&sim[i], mine[k]);
                if lane < 2 && r.bytes.is_some_and(|b| tl.bucket_bytes.get(s.index as usize) != Some(&b)) {
                    sized_apart += 1;
                }
                let sim_us = s.dur_ns as f64 / 1000.0;
                let gap = (sim_us - r.dur_us).abs();
                if worst.as_ref().is_none_or(|w| gap > (w.sim_us - w.real_us).abs()) {
                    worst = Some(Worst { k, name: r.name.clone(), sim_us, real_us: r.dur_us });
                }
            }
            out.push(TrackCompare {
                rank,
                lane,
                sim_count: sim.len(),
                real_count: mine.len(),
                sim_busy_us: sim.iter().map(|s| s.dur_ns as f64 / 1000.0).sum(),
                real_busy_us: mine.iter().map(|e| e.dur_us).sum(),
                matching,
                pairs: pairs.len(),
                worst,
                sized_apart,
                engine: engine.filter(|_| lane < 2),
                left_out: all - mine.len(),
            });
        }
    }
    Ok(out)
}

/// `sim_trace` (the simulator's Chrome trace JSON of a world of `world` ranks) with `real`'s
/// events added as processes [`real_pid_base`]` + rank`, named "real rank R", on the same
/// threads.
///
/// # Errors
/// `sim_trace` that is not a Chrome trace.
pub fn overlay(sim_trace: &str, real: &[RealEvent], world: u32) -> Result<String, String> {
    let base = real_pid_base(world);
    let mut v: Value = serde_json::from_str(sim_trace).map_err(|e| format!("the simulator's trace: {e}"))?;
    let events = v
        .get_mut("traceEvents")
        .and_then(Value::as_array_mut)
        .ok_or("the simulator's trace has no events")?;
    let mut ranks: Vec<u64> = real.iter().map(|e| e.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    for rank in ranks {
        let pid = base + rank;
        events.push(serde_json::json!({"ph": "M", "name": "process_name", "pid": pid,
            "args": {"name": format!("real rank {rank}")}}));
        for (lane, name) in LANES.iter().enumerate() {
            events.push(serde_json::json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": TIDS[lane],
                "args": {"name": name}}));
        }
    }
    for e in real {
        events.push(serde_json::json!({"ph": "X", "pid": base + e.rank, "tid": TIDS[e.lane],
            "name": e.name, "cat": "real", "ts": e.ts_us, "dur": e.dur_us}));
    }
    serde_json::to_string(&v).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::super::report::{Span, SpanKind};
    use super::{join_pieces, layer_of, pair_by, Matching, RealEvent};

    fn span(kind: SpanKind, index: u32) -> Span {
        Span { start_ns: 0, dur_ns: 1, kind, index, step: 0, prefetch: false }
    }

    fn real(name: &str) -> RealEvent {
        RealEvent {
            rank: 0,
            lane: 2,
            name: name.to_owned(),
            ts_us: 0.0,
            dur_us: 1.0,
            step: None,
            bytes: None,
            engine: None,
        }
    }

    /// Compute pairs by kind, layer and occurrence: the simulated recomputation the real run
    /// lacks stays unpaired instead of shifting every pair after it; names without layers
    /// fall back to order.
    #[test]
    fn compute_pairs_by_kind_and_layer() {
        use super::NO_LAYER;
        use SpanKind::{Backward, Forward, Loss, Recompute, Update};
        let unnamed_sets = [vec![real("a"), real("b")], vec![real("forward a"), real("update")]];
        let sim = [
            span(Forward, 0),
            span(Forward, 1),
            span(Loss, NO_LAYER),
            span(Recompute, 1),
            span(Backward, 1),
            span(Backward, 0),
            span(Update, NO_LAYER),
        ];
        // The real run's update a step is paired; a loss it did not record is not (a name with
        // a layer the simulation lacks neither).
        let events = [
            real("forward 0"),
            real("forward 1"),
            real("backward 1"),
            real("backward 0"),
            real("update"),
            real("loss 3"),
        ];
        let refs: Vec<&RealEvent> = events.iter().collect();
        let key = |s: &Span| (s.kind.name(), s.index);
        let by_layer = (Matching::Layer, |k: &(&str, u32)| k.1 != NO_LAYER);
        let (pairs, how) = pair_by(&sim, &refs, key, |e| layer_of(&e.name), by_layer);
        assert_eq!(how, Matching::Layer);
        assert_eq!(pairs, [(0, 0), (1, 1), (4, 2), (5, 3), (6, 4)]);
        // Names without layers go by order, an update among them or not (it carries no layer).
        for unnamed in &unnamed_sets {
            let refs: Vec<&RealEvent> = unnamed.iter().collect();
            let (pairs, how) = pair_by(&sim, &refs, key, |e| layer_of(&e.name), by_layer);
            assert_eq!((pairs, how), (vec![(0, 0), (1, 1)], Matching::Order), "{unnamed:?}");
        }
    }

    /// A root's pieces around its blocks join into one span a phase; the same layer in another
    /// phase (the backward, a second micro-batch) or another step stays apart.
    #[test]
    fn a_layers_pieces_in_one_phase_join() {
        let names =
            ["forward 0", "forward 1", "forward 0", "forward 2", "forward 0", "backward 0", "backward 2"];
        let more = ["backward 0", "backward 1", "backward 0", "forward 0", "forward 1", "forward 0"];
        let events: Vec<RealEvent> = names
            .iter()
            .chain(&more)
            .enumerate()
            .map(|(i, n)| RealEvent {
                ts_us: i as f64,
                dur_us: (i + 1) as f64,
                step: Some(1 + u64::from(i >= 10)),
                ..real(n)
            })
            .collect();
        let refs: Vec<&RealEvent> = events.iter().collect();
        let got: Vec<(String, f64, f64, Option<u64>)> =
            join_pieces(&refs).into_iter().map(|e| (e.name, e.ts_us, e.dur_us, e.step)).collect();
        let want = [
            ("forward 0", 0.0, 1.0 + 3.0 + 5.0, Some(1)),
            ("forward 1", 1.0, 2.0, Some(1)),
            ("forward 2", 3.0, 4.0, Some(1)),
            ("backward 0", 5.0, 6.0 + 8.0 + 10.0, Some(1)),
            ("backward 2", 6.0, 7.0, Some(1)),
            ("backward 1", 8.0, 9.0, Some(1)),
            ("forward 0", 10.0, 11.0 + 13.0, Some(2)),
            ("forward 1", 11.0, 12.0, Some(2)),
        ];
        let want: Vec<(String, f64, f64, Option<u64>)> =
            want.iter().map(|&(n, t, d, s)| (n.to_owned(), t, d, s)).collect();
        assert_eq!(got, want);
        // Without steps, nothing is joined.
        let stepless: Vec<RealEvent> = events.iter().map(|e| RealEvent { step: None, ..e.clone() }).collect();
        let refs: Vec<&RealEvent> = stepless.iter().collect();
        assert_eq!(join_pieces(&refs), stepless);
    }
}
