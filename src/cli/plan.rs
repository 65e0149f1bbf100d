//! `collsched plan`: build the layout and coalesced plan of a parameter file and print it,
//! as a short table or (`--json`) as the plan JSON that scripts read (a contract).
//!
//! Flags: `--params FILE --world N [--strategy even|flat|greedy|hybrid:G] [--bucket-mb X]
//! [--align BYTES] [--bucket-by size|module[:D][+pack]] [--json]`; `--bucket-mb` is MiB
//! (fractions allowed, default 64), `--align` defaults to 256, `--bucket-by` to `size`.
//!
//! The table prints one row per bucket (at most 40; `--json` has all) and totals: collective
//! counts per kind counting each group, all-gathered bytes per step, padding overhead.
//!
//! `--json` streams the plan JSON on one line: the format is a contract, documented (and
//! written) by [`collsched_schedule::plan::json`]; this command writes it to stdout. The golden
//! file `tests/data/params/small.hybrid2.plan.json` pins it (`tests/cli_plan.rs` says how to
//! regenerate it).

use std::io::{self, BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use collsched_buckets::{Boundary, Bucket, Sharding};
use collsched_schedule::{plan_from_json, CollectiveKind, Plan, PlanInputError};

use super::CliError;

/// Flags of `collsched plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// Parameter file: `{"params": [{"name", "shape", "dtype", "trainable", "module"}, ...]}`
    /// (`trainable` and `module` optional).
    #[arg(long, value_name = "FILE.json")]
    pub params: PathBuf,
    /// Number of ranks.
    #[arg(long, value_name = "N")]
    pub world: u32,
    /// Sharding strategy: even, flat, greedy or hybrid:G (G ranks per shard group).
    #[arg(long, default_value = "even", value_name = "even|flat|greedy|hybrid:G")]
    pub strategy: Sharding,
    /// Cap on a bucket's parameter bytes, in MiB (fractions allowed).
    #[arg(long, default_value_t = 64.0, value_name = "X")]
    pub bucket_mb: f64,
    /// Alignment of shard offsets and segment starts in bytes (a power of two, a multiple of
    /// every dtype's size).
    #[arg(long, default_value_t = collsched_buckets::DEFAULT_ALIGN, value_name = "BYTES")]
    pub align: usize,
    /// Where buckets end: size (by the cap alone, across modules), module (also at every
    /// change of layer: `h.0` of `h.0.attn.qkv.weight`, `model.layers.12` of
    /// `model.layers.12.mlp.up_proj.weight`), module:D (also where the first D components of
    /// the module path change); a parameter's "module" field wins over its name; +pack lets
    /// small consecutive whole modules share a bucket.
    #[arg(long, default_value = "size", value_name = "size|module[:D][+pack]")]
    pub bucket_by: Boundary,
    /// Print the plan as one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Runs `collsched plan`.
///
/// # Errors
/// Any failure, as one line for the user: an unreadable or invalid parameter file, a bad flag
/// value, a layout that cannot be built, a failed write to stdout.
pub fn run(args: PlanArgs) -> Result<ExitCode, CliError> {
    let plan = build(&args)?;
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    if args.json {
        // One shard entry (at least ~40 bytes) per rank per bucket: refuse what no reader wants
        // before writing gigabytes.
        let buckets = plan.layout().buckets().len() as u64;
        let estimate = u64::from(plan.layout().world()).saturating_mul(buckets).saturating_mul(40);
        if estimate > MAX_JSON_BYTES {
            return Err(format!(
                "--world {} --json would write at least {estimate} bytes (a shard entry per rank per bucket, {buckets} \
                 buckets), above the limit of {MAX_JSON_BYTES}; use a smaller --world or the table (without --json)",
                plan.layout().world()
            )
            .into());
        }
        write_json(&mut out, &plan)?;
    } else {
        write_table(&mut out, &plan)?;
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// The largest plan JSON `collsched plan --json` writes (1 GiB).
pub const MAX_JSON_BYTES: u64 = 1 << 30;

/// Reads the parameter file and builds the plan the flags describe.
///
/// # Errors
/// One line naming the file, flag, parameter or bucket at fault.
pub fn build(args: &PlanArgs) -> Result<Plan, CliError> {
    let file = args.params.display();
    let text = std::fs::read_to_string(&args.params).map_err(|e| format!("cannot read {file}: {e}"))?;
    let bucket_bytes = bucket_bytes(args.bucket_mb)?;
    plan_from_json(&text, args.strategy, args.world, bucket_bytes, args.align, args.bucket_by).map_err(|e| {
        match e {
            PlanInputError::Params(e) => format!("{file}: {e}").into(),
            PlanInputError::Layout(e) => e.into(),
        }
    })
}

/// `--bucket-mb` (or the Python package's `bucket_mb`) in bytes: MiB, rounded to the nearest byte.
///
/// # Errors
/// A negative, non-finite, sub-byte or huge value, naming the flag.
pub fn bucket_bytes(mb: f64) -> Result<usize, CliError> {
    if !mb.is_finite() || mb < 0.0 {
        return Err(format!("--bucket-mb {mb}: give a positive number of MiB, e.g. --bucket-mb 64").into());
    }
    let bytes = (mb * 1048576.0).round();
    if bytes > usize::MAX as f64 / 2.0 {
        return Err(format!("--bucket-mb {mb} is too large").into());
    }
    if mb > 0.0 && bytes < 1.0 {
        return Err(format!(
            "--bucket-mb {mb} is below one byte (1 MiB is 1048576 bytes); give at least 0.000001, e.g. --bucket-mb 64"
        )
        .into());
    }
    // Zero is rejected by the layout builder with its own message.
    Ok(bytes as usize)
}

/// Writes the plan as one JSON object on one line ([`Plan::json`]; the format is
/// [`collsched_schedule::plan::json`]'s rustdoc), streaming: the per-rank segments are derived
/// while writing, never all held in memory.
fn write_json(out: &mut impl Write, plan: &Plan) -> io::Result<()> {
    serde_json::to_writer(&mut *out, &plan.json()).map_err(io::Error::other)?;
    out.write_all(b"\n")
}

/// At most this many bucket rows in the table; `--json` has them all.
const TABLE_ROWS: usize = 40;

/// Writes the short human summary: one row per bucket (up to 40), then totals.
///
/// # Errors
/// A failed write.
pub fn write_table(out: &mut impl Write, plan: &Plan) -> io::Result<()> {
    let l = plan.layout();
    let set = l.params();
    let param_bytes: usize = set.specs().iter().zip(set.numels()).map(|(s, &n)| n * s.dtype.size()).sum();
    let trainable = set.specs().iter().filter(|s| s.trainable).count();
    writeln!(
        out,
        "plan: {} params ({} trainable, {}), world {}, strategy {}, align {} B, bucket cap {}{}",
        set.len(),
        trainable,
        human_bytes(param_bytes),
        l.world(),
        l.sharding(),
        l.align(),
        human_bytes(l.bucket_bytes()),
        match l.boundary() {
            Boundary::Size => String::new(),
            b => format!(", bucket boundaries {b}"),
        },
    )?;
    writeln!(out, "fingerprint {}", plan.fingerprint())?;
    writeln!(
        out,
        "{:>6}  {:<6}  {:<5}  {:>7}  {:>11}  {:>14}  {:>8}  ops",
        "bucket", "kind", "dtype", "params", "shard", "gathered", "padding"
    )?;
    for b in l.buckets().iter().take(TABLE_ROWS) {
        let ops: Vec<&str> =
            plan.ops_of(b.id()).iter().filter_map(|&o| plan.op(o)).map(|o| o.kind().name()).collect();
        writeln!(
            out,
            "{:>6}  {:<6}  {:<5}  {:>7}  {:>11}  {:>14}  {:>7.1}%  {}",
            b.id().0,
            b.kind().name(),
            b.dtype().name(),
            b.params().len(),
            human_bytes(b.shard_bytes()),
            human_bytes(b.gathered_bytes()),
            padding(b) * 100.0,
            ops.join(" + "),
        )?;
    }
    if l.buckets().len() > TABLE_ROWS {
        writeln!(out, "   ... {} more buckets (--json lists all)", l.buckets().len() - TABLE_ROWS)?;
    }
    let mut counts = Vec::new();
    for kind in [
        CollectiveKind::AllGather,
        CollectiveKind::Broadcast,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllReduce,
    ] {
        let n: u64 =
            plan.ops().iter().filter(|o| o.kind() == kind).map(|o| u64::from(o.groups().count())).sum();
        if n > 0 {
            counts.push(format!("{n} {}", kind.name()));
        }
    }
    let gather_bytes: usize = l.gather_buckets().iter().map(|b| b.gathered_bytes()).sum();
    writeln!(
        out,
        "total: {} gather + {} grad buckets; {} collectives ({}); all-gathered {} per step, padding overhead {:.2}%",
        l.gather_buckets().len(),
        l.grad_buckets().len(),
        plan.ops().iter().map(|o| u64::from(o.groups().count())).sum::<u64>(),
        counts.join(", "),
        human_bytes(gather_bytes),
        l.padding_overhead() * 100.0,
    )
}

/// Padding of a bucket's buffer relative to its parameters' elements.
fn padding(b: &Bucket) -> f64 {
    let buffer = b.gathered_numel();
    if b.param_numel() == 0 {
        0.0
    } else {
        (buffer as f64 - b.param_numel() as f64) / b.param_numel() as f64
    }
}

fn human_bytes(b: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
