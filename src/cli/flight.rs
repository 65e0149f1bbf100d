//! `collsched flight DIR`: reads every rank's flight record (`rank-R.json`, written on a
//! collective's failure when `COLLSCHED_FLIGHT_RECORDER=DIR`, or on request) and says what went
//! wrong first in one line (`backend::flight::verdict`): the first collective the ranks
//! disagree on, the ranks that never launched one their peers did, or the rank that failed
//! first; ranks with no record are named. Then each rank's record in short (`--quiet` leaves
//! it out). Exit status 1, naming the file, when a record cannot be read. `--trace-out FILE`
//! also writes the ranks' collectives as a Chrome trace on the simulator's tracks
//! (`backend::flight::trace`), to lay a real run beside `collsched sim --trace-out`'s.

use std::path::PathBuf;
use std::process::ExitCode;

use super::CliError;
use crate::backend::flight::{trace, verdict, FlightDump};

/// Flags of `collsched flight`.
#[derive(Debug, clap::Args)]
pub struct FlightArgs {
    /// The directory holding the ranks' records (`rank-0.json`, `rank-1.json`, ...).
    pub dir: PathBuf,
    /// Print the verdict line only.
    #[arg(long)]
    pub quiet: bool,
    /// Also write the records' collectives as a Chrome trace (Perfetto) to this file: one
    /// process per rank, the simulator's tracks (all-gather, reduce-scatter).
    #[arg(long, value_name = "FILE.json")]
    pub trace_out: Option<PathBuf>,
}

/// Every `rank-R.json` in `dir`, by rank.
///
/// # Errors
/// An unreadable directory or file, a file that is not a flight record (naming it), no record
/// at all.
pub fn read_dir(dir: &std::path::Path) -> Result<Vec<FlightDump>, CliError> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut dumps = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if !(name.starts_with("rank-") && name.ends_with(".json")) {
            continue;
        }
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let dump: FlightDump = serde_json::from_str(&text)
            .map_err(|e| format!("{}: not a collsched flight record: {e}", path.display()))?;
        dumps.push(dump);
    }
    if dumps.is_empty() {
        return Err(format!(
            "{}: no flight records (rank-R.json) here; run with COLLSCHED_FLIGHT_RECORDER={} to have failures \
             write them",
            dir.display(),
            dir.display()
        )
        .into());
    }
    dumps.sort_by_key(|d| d.rank);
    Ok(dumps)
}

/// Runs `collsched flight`.
///
/// # Errors
/// As [`read_dir`].
pub fn run(args: FlightArgs) -> Result<ExitCode, CliError> {
    let dumps = read_dir(&args.dir)?;
    println!("{}", verdict::analyze(&dumps));
    if !args.quiet {
        print!("{}", verdict::summary(&dumps));
    }
    if let Some(out) = &args.trace_out {
        std::fs::write(out, trace::chrome_trace(&dumps)).map_err(|e| format!("{}: {e}", out.display()))?;
        println!("trace: {}", out.display());
    }
    Ok(ExitCode::SUCCESS)
}
