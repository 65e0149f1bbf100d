//! `collsched sim`: simulate training steps of a workload on a modelled machine with the real
//! scheduler, and print step time, compute, exposed communication, TFLOPS, memory and
//! collective counts (a table, one JSON object, a sweep table, a Chrome trace, an SVG).
//!
//! `--json` prints one object: `step_ms`, `compute_ms`, `exposed_comm_ms`, `host_ms`, `comm_ms
//! {all_gather, reduce_scatter}`, `tflops_per_gpu`, `peak_gathered_bytes`, `collectives` (per
//! step), `all_gathers`, `reduce_scatters`, `prefetch_hits`, `host_syncs` (host-device syncs
//! per step; `zero3-2021` only), `gather_buckets`, `grad_buckets`, `scheduler_events`,
//! `workload`, `world`, `policy`, `bucket_by`, `steps_reported`.
//! `--sweep KEY=V1,V2,..` (keys `policy world topo workload bucket-mb bucket-by prefetch-mb
//! max-inflight max-live-mb steps tflops host-overhead-us jitter seed`, repeatable) runs the
//! grid and prints a table, or with `--json` one object per line with a `sweep` member.
//! `--cost FILE` (a profile `collsched calibrate` wrote) prices every collective by its measured
//! fit, and supplies the host overhead per collective, `--compute-slowdown` and
//! `--compute-overlap` unless they are given; `--topo` is then optional (all ranks on one
//! machine). The summary names the profile.
//! `--trace-out` writes Chrome trace JSON (`pid` = rank, `tid` 0 compute, 1 all_gather, 2
//! reduce_scatter; `"X"` events, times in µs); `--svg` draws rank `--svg-rank`'s last step, one
//! lane per stream, waits in red, prefetched collectives lighter, and with `--against` a real
//! trace with compute, the real run's step below on the same scale.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::sim::against;
use crate::sim::config::{DEFAULT_SIM_BOUNDARY, DEFAULT_STEPS};
use crate::sim::timeline::{write_chrome_trace, write_svg};
use crate::sim::workload::Workload;
use crate::sim::{peak_tflops, simulate, Lane, Policy, SimConfig, SimReport};
use collsched_buckets::Boundary;
use collsched_schedule::scheduler::{DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_LIVE_BYTES, DEFAULT_PREFETCH_BYTES};
use collsched_topo::{CostProfile, Topology};

use super::CliError;

/// Flags of `collsched sim`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// A workload preset (gpt2-1.5b, llama-7b, llama-70b, roberta-10b, roberta-50b) or a
    /// workload JSON file.
    #[arg(long, value_name = "NAME|FILE")]
    pub workload: String,
    /// Number of ranks.
    #[arg(long, value_name = "N")]
    pub world: u32,
    /// A topology preset (dgx-h100, p4d, pcie-8gpu, cpu-2socket), an hwloc XML file or a
    /// topology JSON file; as many nodes as the world needs. Required unless `--cost` is given
    /// (then all ranks are on one machine, the one calibrated).
    #[arg(long, value_name = "NAME|FILE", required_unless_present = "cost")]
    pub topo: Option<String>,
    /// A cost profile (`collsched calibrate --out FILE`): every collective priced by its
    /// measured fit instead of the topology's links, and its host time per collective as the
    /// default `--host-overhead-us`.
    #[arg(long, value_name = "FILE.json")]
    pub cost: Option<PathBuf>,
    /// naive (one collective per parameter, no prefetch, host overhead per collective),
    /// coalesced (buckets, no prefetch), trace (buckets, trace-replay prefetch), explicit
    /// (buckets, prefetch the next layer) or zero3-2021 (DeepSpeed ZeRO-3 before batching,
    /// v0.5.4: one all-gather per non-persistent parameter at every fetch, a device sync
    /// before each, no prefetch, list-form copies, norm logging and blocking releases with
    /// their syncs, one reduce-scatter per gradient, `.item()`s in the optimizer step; costs
    /// from published measurements, `topo/src/constants.rs`).
    #[arg(long, default_value = "trace", value_name = "P")]
    pub policy: String,
    /// Bucket cap in MiB (ignored by naive and zero3-2021).
    #[arg(long, default_value_t = 64.0, value_name = "X")]
    pub bucket_mb: f64,
    /// Where buckets end (ignored by naive and zero3-2021): size (by the cap alone, across layers), module
    /// (also at every layer: `block.3` of `block.3.attn.qkv.weight`), module:D (also where the
    /// first D components of the module path change), each module form with an optional +pack
    /// (small consecutive whole modules share a bucket). See `collsched plan --help`.
    #[arg(long, default_value_t = DEFAULT_SIM_BOUNDARY, value_name = "size|module[:D][+pack]")]
    pub bucket_by: Boundary,
    /// Prefetch budget in MiB (gathered bytes launched ahead of their fetch).
    #[arg(long, default_value_t = (DEFAULT_PREFETCH_BYTES >> 20) as f64, value_name = "Y")]
    pub prefetch_mb: f64,
    /// Bound on gathers launched ahead and not yet fetched.
    #[arg(long, default_value_t = DEFAULT_MAX_INFLIGHT, value_name = "K")]
    pub max_inflight: usize,
    /// Bound on gathered parameter memory per rank in MiB.
    #[arg(long, default_value_t = (DEFAULT_MAX_LIVE_BYTES >> 20) as f64, value_name = "MB")]
    pub max_live_mb: f64,
    /// Steps to simulate; with more than one, step 1 (which records the prefetch trace) is left
    /// out of the summary.
    #[arg(long, default_value_t = DEFAULT_STEPS, value_name = "S")]
    pub steps: u32,
    /// Achieved compute throughput per rank in TFLOPS (default: 40% of the GPU's peak).
    #[arg(long, value_name = "T")]
    pub tflops: Option<f64>,
    /// Host overhead per launched collective in microseconds (default: 20 for naive, 380 per
    /// all-gather and 250 per reduce-scatter for zero3-2021, else 0).
    #[arg(long, value_name = "US")]
    pub host_overhead_us: Option<f64>,
    /// Microseconds a rank loses each time it blocks on a collective, past the collective's
    /// end (the others' late arrival on shared cores, waking up). Default 0.
    #[arg(long, value_name = "US")]
    pub wait_overhead_us: Option<f64>,
    /// The all-gather and reduce-scatter streams share one link (one network adapter): a
    /// collective's transfer, its time beyond a launch of 0 bytes, runs only while the other
    /// stream's leave the link free. Default off: a link per stream.
    #[arg(long)]
    pub shared_link: bool,
    /// Compute is this many times slower (ranks sharing cores); default: the `--cost`
    /// profile's `compute_slowdown`, else 1.
    #[arg(long, value_name = "F")]
    pub compute_slowdown: Option<f64>,
    /// The fraction of collective time that overlaps compute (the rest stretches it); default:
    /// the `--cost` profile's `compute_overlap`, else 1.
    #[arg(long, value_name = "F")]
    pub compute_overlap: Option<f64>,
    /// Compute jitter: every compute op takes 1 + jitter * u longer, u uniform in [0, 1) per
    /// rank and op (stragglers). Default 0.
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    pub jitter: f64,
    /// Seed of the jitter.
    #[arg(long, default_value_t = 0, value_name = "SEED")]
    pub seed: u64,
    /// Write a Chrome trace JSON (open it in Perfetto): one process per rank, one thread per
    /// stream.
    #[arg(long, value_name = "FILE.json")]
    pub trace_out: Option<PathBuf>,
    /// A real run's trace (`collsched flight DIR --trace-out FILE.json`) to set beside this
    /// simulation: each rank's collective tracks compared (counts, busy time, the collective
    /// that differs most, matched by order on its track), and with `--trace-out` drawn in the
    /// same trace as processes "real rank R".
    #[arg(long, value_name = "REAL.json")]
    pub against: Option<PathBuf>,
    /// Draw one rank's last step as an SVG timeline (with `--against`, the real run's step
    /// below, where its trace has compute).
    #[arg(long, value_name = "FILE.svg")]
    pub svg: Option<PathBuf>,
    /// The rank `--svg` draws.
    #[arg(long, default_value_t = 0, value_name = "R")]
    pub svg_rank: usize,
    /// Print one JSON object (with --sweep: one per line).
    #[arg(long)]
    pub json: bool,
    /// Run a grid: KEY=V1,V2,.. (may repeat). Keys: policy, world, topo, workload, bucket-mb,
    /// bucket-by, prefetch-mb, max-inflight, max-live-mb, steps, tflops, host-overhead-us,
    /// jitter, seed.
    #[arg(long, value_name = "KEY=V1,V2,..")]
    pub sweep: Vec<String>,
}

/// Runs `collsched sim`.
///
/// # Errors
/// Any failure, as one line for the user: an unknown workload, topology or policy, a bad flag
/// value, an unwritable output file.
pub fn run(args: SimArgs) -> Result<ExitCode, CliError> {
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    if args.sweep.is_empty() {
        if args.against.is_some() && args.json {
            return Err("--against prints a table beside the summary; leave out --json".into());
        }
        let real = match &args.against {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("--against {}: {e}", path.display()))?;
                Some(against::parse_real(&text).map_err(|e| format!("--against {}: {e}", path.display()))?)
            }
            None => None,
        };
        let timeline = args.trace_out.is_some() || args.svg.is_some() || real.is_some();
        let (report, topo, cfg) = run_one(&args, timeline)?;
        if let Some(path) = &args.trace_out {
            let mut trace = Vec::new();
            write_chrome_trace(&mut trace, &report)?;
            if let Some(real) = &real {
                trace = against::overlay(&String::from_utf8_lossy(&trace), real, report.world)?.into_bytes();
            }
            std::fs::write(path, trace).map_err(|e| format!("--trace-out {}: {e}", path.display()))?;
        }
        if let Some(path) = &args.svg {
            if args.svg_rank >= report.world as usize {
                return Err(
                    format!("--svg-rank {} is outside the world of {}", args.svg_rank, report.world).into()
                );
            }
            let f = File::create(path).map_err(|e| format!("--svg {}: {e}", path.display()))?;
            let mut w = BufWriter::new(f);
            write_svg(&mut w, &report, args.svg_rank, report.steps.len() - 1, real.as_deref())?;
            w.flush().map_err(|e| format!("--svg {}: {e}", path.display()))?;
        }
        if args.json {
            serde_json::to_writer(&mut out, &report.to_json())?;
            writeln!(out)?;
        } else {
            write_summary(&mut out, &report, &topo, &cfg)?;
        }
        if let (Some(real), Some(path)) = (&real, &args.against) {
            write_against(&mut out, &against::compare(&report, real)?, path)?;
        }
    } else {
        if args.trace_out.is_some() || args.svg.is_some() || args.against.is_some() {
            return Err("--trace-out, --svg and --against take one run; leave them out of a --sweep".into());
        }
        run_sweep(&mut out, &args)?;
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// The table of `--against`: one row per rank and track (collectives, and compute where the real
/// run has it).
fn write_against(out: &mut impl Write, rows: &[against::TrackCompare], path: &Path) -> io::Result<()> {
    writeln!(
        out,
        "against {} (matched by bucket and occurrence, within each step where the real collectives carry steps, or \
         by order where the real names carry no bucket of the simulation's; times in us):",
        path.display()
    )?;
    writeln!(
        out,
        "  {:>4} {:<14} {:>6} {:>6} {:>6} {:<6} {:>7} {:>12} {:>12} {:>10}  largest difference",
        "rank", "track", "sim n", "real n", "pairs", "by", "resized", "sim busy", "real busy", "real/sim"
    )?;
    for r in rows {
        let ratio =
            if r.sim_busy_us > 0.0 { format!("{:.2}", r.real_busy_us / r.sim_busy_us) } else { "-".into() };
        let worst = r.worst.as_ref().map_or_else(
            || "-".to_owned(),
            |w| format!("#{} {}: sim {:.1}, real {:.1}", w.k, w.name, w.sim_us, w.real_us),
        );
        writeln!(
            out,
            "  {:>4} {:<14} {:>6} {:>6} {:>6} {:<6} {:>7} {:>12.1} {:>12.1} {:>10}  {worst}",
            r.rank,
            against::LANES[r.lane],
            r.sim_count,
            r.real_count,
            r.pairs,
            match r.matching {
                against::Matching::Bucket => "bucket",
                against::Matching::BucketStep => "step",
                against::Matching::Layer => "layer",
                against::Matching::Order => "order",
            },
            r.sized_apart,
            r.sim_busy_us,
            r.real_busy_us,
            ratio
        )?;
    }
    let engines: std::collections::BTreeSet<u64> = rows.iter().filter_map(|r| r.engine).collect();
    if !engines.is_empty() {
        let list: Vec<String> = engines.iter().map(u64::to_string).collect();
        writeln!(
            out,
            "  compared: the collectives of engine {} (on each rank the one with the most); {} real collectives of \
             other engines (an evaluation's, a model built and replaced) or of none left out",
            list.join(", "),
            rows.iter().map(|r| r.left_out).sum::<usize>()
        )?;
    }
    if rows.iter().any(|r| r.matching == against::Matching::Order && r.sim_count != r.real_count) {
        writeln!(
            out,
            "  the counts differ on some track: past a collective one side lacks, the pairs matched by order are not \
             the same collective"
        )?;
    }
    if rows.iter().any(|r| r.sized_apart > 0) {
        writeln!(
            out,
            "  some pairs differ in size (`resized`): a simulated bucket that is not the run's (simulate with the run's \
             bucket cap, boundary and parameter order; a collsched.torch workload record: --bucket-by module \
             --bucket-mb of the model), or, in a record whose collectives carry no engine, a real collective of another \
             model or engine (built earlier, evaluating) paired by occurrence"
        )?;
    }
    if rows.iter().any(|r| r.matching != against::Matching::Order && r.pairs < r.sim_count.max(r.real_count))
    {
        writeln!(
            out,
            "  some collectives or compute spans have no match on the other side (left out of the pairs)"
        )?;
    }
    Ok(())
}

fn mib(knob: &str, mb: f64) -> Result<usize, CliError> {
    if !mb.is_finite() || mb <= 0.0 || mb > 1e12 {
        return Err(format!("--{knob} {mb}: give a positive number of MiB").into());
    }
    Ok(((mb * 1048576.0).round() as usize).max(1))
}

/// The machine `--cost` without `--topo` simulates on (for its compute default; the profile
/// prices the collectives, every rank on one node).
const CALIBRATED_MACHINE: &str = "cpu-2socket";

/// Reads a `--cost` file.
fn load_profile(path: &std::path::Path) -> Result<CostProfile, CliError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!("--cost {}: {e}; give a file `collsched calibrate --out` wrote", path.display())
    })?;
    Ok(CostProfile::from_json(&text).map_err(|e| format!("--cost {}: {e}", path.display()))?)
}

/// Builds the configuration the flags describe and runs it.
fn run_one(args: &SimArgs, timeline: bool) -> Result<(SimReport, Topology, SimConfig), CliError> {
    let workload = Workload::resolve(&args.workload)?;
    let profile = args.cost.as_deref().map(load_profile).transpose()?;
    // Without --topo (only with --cost): one CPU machine holding every rank.
    let topo = collsched_topo::resolve(args.topo.as_deref().unwrap_or(CALIBRATED_MACHINE))?;
    let policy: Policy = args.policy.parse()?;
    if args.world == 0 {
        return Err("--world 0: give at least 1 rank".into());
    }
    let mut cfg = match args.tflops {
        Some(t) => SimConfig::with_topology(&topo, args.world, t)?,
        None => SimConfig::for_topology(&topo, args.world)?,
    };
    if args.topo.is_none() {
        cfg.ranks_per_node = args.world;
    }
    cfg.profile = profile;
    cfg.policy = policy;
    cfg.bucket_bytes = mib("bucket-mb", args.bucket_mb)?;
    cfg.boundary = args.bucket_by;
    cfg.prefetch_bytes = mib("prefetch-mb", args.prefetch_mb)?;
    cfg.max_inflight = args.max_inflight;
    cfg.max_live_bytes = mib("max-live-mb", args.max_live_mb)?;
    cfg.steps = args.steps;
    cfg.host_overhead_s = args.host_overhead_us.map(|us| us * 1e-6);
    cfg.wait_overhead_s = args.wait_overhead_us.map(|us| us * 1e-6);
    cfg.compute_slowdown = args.compute_slowdown;
    cfg.compute_overlap = args.compute_overlap;
    cfg.shared_link = args.shared_link;
    cfg.jitter = args.jitter;
    cfg.seed = args.seed;
    cfg.timeline = timeline;
    let report = simulate(&workload, &cfg)?;
    Ok((report, topo, cfg))
}

fn write_summary(out: &mut impl Write, r: &SimReport, topo: &Topology, cfg: &SimConfig) -> io::Result<()> {
    let nodes = cfg.world.div_ceil(cfg.ranks_per_node);
    writeln!(
        out,
        "collsched sim: {} on {} ranks of {} ({} node(s) x {}), policy {}",
        r.workload, r.world, topo.name, nodes, cfg.ranks_per_node, r.policy
    )?;
    writeln!(
        out,
        "  layout: {} gather buckets, {} gradient buckets (bucket by {}); compute at {} TFLOPS per rank{}",
        r.gather_buckets,
        r.grad_buckets,
        r.boundary,
        if cfg.tflops >= 1.0 { format!("{:.1}", cfg.tflops) } else { format!("{:.3e}", cfg.tflops) },
        peak_tflops(topo)
            .map_or(String::new(), |p| format!(" ({:.0}% of {p:.0} peak)", cfg.tflops / p * 100.0))
    )?;
    if let Some(p) = &cfg.profile {
        writeln!(
            out,
            "  collectives priced by a cost profile of `{}` measured on {} ranks{}; host overhead {:.1} us per collective, \
             {:.1} us per blocking wait; compute x{:.2}, {:.0}% of collective time overlapping it",
            p.backend,
            p.ranks,
            if p.machine.is_empty() { String::new() } else { format!(" ({})", p.machine) },
            cfg.host_overhead() * 1e6,
            cfg.wait_overhead() * 1e6,
            cfg.compute_slowdown(),
            cfg.compute_overlap() * 100.0
        )?;
    }
    if cfg.shared_link {
        writeln!(out, "  the all-gather and reduce-scatter streams share one link (--shared-link)")?;
    }
    let rep = r.reported().len();
    if r.steps.len() > 1 {
        writeln!(
            out,
            "  steps: {} simulated, {rep} reported (step 1 records the prefetch trace)",
            r.steps.len()
        )?;
    } else {
        writeln!(out, "  steps: 1 simulated and reported")?;
    }
    writeln!(out, "  {:<22}{:>12.3} ms", "step time", r.step_ms())?;
    writeln!(out, "  {:<22}{:>12.3} ms  (forward + recompute + backward)", "compute", r.compute_ms())?;
    writeln!(
        out,
        "  {:<22}{:>12.3} ms  (compute waiting on collectives)",
        "exposed comm",
        r.exposed_comm_ms()
    )?;
    writeln!(out, "  {:<22}{:>12.3} ms", "host overhead", r.host_ms())?;
    for lane in [Lane::AllGather, Lane::ReduceScatter] {
        writeln!(out, "  {:<22}{:>12.3} ms busy", format!("comm {}", lane.name()), r.comm_ms(lane))?;
    }
    writeln!(
        out,
        "  {:<22}{:>12.1}     (model FLOPs, no recomputation)",
        "TFLOPS per GPU",
        r.tflops_per_gpu()
    )?;
    writeln!(
        out,
        "  {:<22}{:>12.3} GiB",
        "peak gathered",
        r.peak_gathered_bytes as f64 / f64::from(1u32 << 30)
    )?;
    let last = r.reported().last().cloned().unwrap_or_default();
    writeln!(
        out,
        "  {:<22}{:>12.0}     per step ({} all-gathers, {} reduce-scatters; {} prefetched, {} prefetch hits)",
        "collectives",
        r.collectives(),
        last.all_gathers,
        last.reduce_scatters,
        last.prefetch_launches,
        last.prefetch_hits
    )?;
    if last.host_syncs > 0 {
        writeln!(
            out,
            "  {:<22}{:>12}     per step (host waiting on the device)",
            "host-device syncs", last.host_syncs
        )?;
    }
    Ok(())
}

const SWEEP_KEYS: [&str; 15] = [
    "policy",
    "world",
    "topo",
    "workload",
    "bucket-mb",
    "bucket-by",
    "prefetch-mb",
    "max-inflight",
    "max-live-mb",
    "steps",
    "tflops",
    "host-overhead-us",
    "wait-overhead-us",
    "jitter",
    "seed",
];

fn apply(args: &mut SimArgs, key: &str, v: &str) -> Result<(), CliError> {
    let num = |v: &str| -> Result<f64, CliError> {
        v.parse::<f64>().map_err(|_| format!("--sweep {key}={v}: `{v}` is not a number").into())
    };
    let int = |v: &str| -> Result<u64, CliError> {
        v.parse::<u64>().map_err(|_| format!("--sweep {key}={v}: `{v}` is not a whole number").into())
    };
    let small = |v: &str| -> Result<u32, CliError> {
        u32::try_from(int(v)?).map_err(|_| format!("--sweep {key}={v}: too large").into())
    };
    match key {
        "policy" => args.policy = v.to_owned(),
        "world" => args.world = small(v)?,
        "topo" => args.topo = Some(v.to_owned()),
        "workload" => args.workload = v.to_owned(),
        "bucket-mb" => args.bucket_mb = num(v)?,
        "bucket-by" => {
            args.bucket_by = v.parse().map_err(|e| format!("--sweep {key}={v}: {e}"))?;
        }
        "prefetch-mb" => args.prefetch_mb = num(v)?,
        "max-inflight" => args.max_inflight = int(v)? as usize,
        "max-live-mb" => args.max_live_mb = num(v)?,
        "steps" => args.steps = small(v)?,
        "tflops" => args.tflops = Some(num(v)?),
        "host-overhead-us" => args.host_overhead_us = Some(num(v)?),
        "wait-overhead-us" => args.wait_overhead_us = Some(num(v)?),
        "jitter" => args.jitter = num(v)?,
        "seed" => args.seed = int(v)?,
        _ => {
            return Err(format!("--sweep: unknown key `{key}`; use one of {}", SWEEP_KEYS.join(", ")).into());
        }
    }
    Ok(())
}

/// Parses the `--sweep` flags into (key, values).
fn parse_sweep(specs: &[String]) -> Result<Vec<(String, Vec<String>)>, CliError> {
    let mut grid: Vec<(String, Vec<String>)> = Vec::new();
    for s in specs {
        let Some((k, vs)) = s.split_once('=') else {
            return Err(
                format!("--sweep {s}: write KEY=V1,V2,.., e.g. --sweep policy=coalesced,trace").into()
            );
        };
        let k = k.trim().to_owned();
        if !SWEEP_KEYS.contains(&k.as_str()) {
            return Err(format!("--sweep: unknown key `{k}`; use one of {}", SWEEP_KEYS.join(", ")).into());
        }
        if grid.iter().any(|(g, _)| *g == k) {
            return Err(format!("--sweep: key `{k}` given twice; list its values once").into());
        }
        let vs: Vec<String> = vs.split(',').map(|v| v.trim().to_owned()).filter(|v| !v.is_empty()).collect();
        if vs.is_empty() {
            return Err(format!("--sweep {s}: no values").into());
        }
        grid.push((k, vs));
    }
    Ok(grid)
}

fn run_sweep(out: &mut impl Write, args: &SimArgs) -> Result<(), CliError> {
    let grid = parse_sweep(&args.sweep)?;
    let total: usize = grid.iter().map(|(_, v)| v.len()).product();
    if !args.json {
        for (k, _) in &grid {
            write!(out, "{k:>14} ")?;
        }
        writeln!(
            out,
            "{:>12} {:>12} {:>12} {:>12} {:>12} {:>9} {:>10} {:>11}",
            "step_ms", "compute_ms", "exposed_ms", "ag_ms", "rs_ms", "tflops", "peak_gib", "collectives"
        )?;
    }
    for i in 0..total {
        let mut a = args.clone();
        let mut rest = i;
        let mut chosen = Vec::with_capacity(grid.len());
        for (k, vs) in grid.iter().rev() {
            let v = &vs[rest % vs.len()];
            rest /= vs.len();
            apply(&mut a, k, v)?;
            chosen.push((k.as_str(), v.as_str()));
        }
        chosen.reverse();
        let (r, _, _) = run_one(&a, false)?;
        if args.json {
            let mut obj = r.to_json();
            if let Some(m) = obj.as_object_mut() {
                let sweep: serde_json::Map<String, serde_json::Value> =
                    chosen.iter().map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(*v))).collect();
                m.insert("sweep".to_owned(), serde_json::Value::Object(sweep));
            }
            serde_json::to_writer(&mut *out, &obj)?;
            writeln!(out)?;
        } else {
            for (_, v) in &chosen {
                write!(out, "{v:>14} ")?;
            }
            writeln!(
                out,
                "{:>12.3} {:>12.3} {:>12.3} {:>12.3} {:>12.3} {:>9.1} {:>10.3} {:>11.0}",
                r.step_ms(),
                r.compute_ms(),
                r.exposed_comm_ms(),
                r.comm_ms(Lane::AllGather),
                r.comm_ms(Lane::ReduceScatter),
                r.tflops_per_gpu(),
                r.peak_gathered_bytes as f64 / f64::from(1u32 << 30),
                r.collectives()
            )?;
        }
        out.flush()?;
    }
    Ok(())
}
