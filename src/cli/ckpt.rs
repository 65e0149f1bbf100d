//! `collsched ckpt inspect PATH`: prints a checkpoint's index (world, strategy, step,
//! fingerprint, parameters with shape, dtype and pieces, files with their bytes) after checking
//! that every file and piece it names is there with its size. Exit status 1, naming the file,
//! when anything is missing or damaged.

use std::path::PathBuf;
use std::process::ExitCode;

use super::CliError;
use crate::checkpoint;

/// Flags of `collsched ckpt`.
#[derive(Debug, clap::Args)]
pub struct CkptArgs {
    /// What to do with the checkpoint.
    #[command(subcommand)]
    pub action: CkptAction,
}

/// What `collsched ckpt` does.
#[derive(Debug, clap::Subcommand)]
pub enum CkptAction {
    /// Print the index of the checkpoint at PATH and check its files.
    Inspect {
        /// The checkpoint directory.
        path: PathBuf,
    },
}

/// Runs `collsched ckpt`.
///
/// # Errors
/// A missing index, a damaged file, a failed write to stdout.
pub fn run(args: CkptArgs) -> Result<ExitCode, CliError> {
    let CkptAction::Inspect { path } = args.action;
    let (index, sizes) = checkpoint::inspect(&path)?;
    let total: u64 = sizes.iter().sum();
    println!(
        "{}: {}, world {}, strategy {}, step {}, fingerprint {}",
        path.display(),
        index.format,
        index.world,
        index.strategy,
        index.step,
        index.fingerprint
    );
    println!("{} parameters, {} bytes in {} files", index.params.len(), total, index.files.len());
    for p in &index.params {
        println!("  {} {:?} {} ({} pieces)", p.name, p.shape, p.dtype, p.pieces.len());
    }
    for (f, n) in index.files.iter().zip(&sizes) {
        println!("  {f}: {n} bytes");
    }
    println!("ok: every piece present with its size");
    Ok(ExitCode::SUCCESS)
}
