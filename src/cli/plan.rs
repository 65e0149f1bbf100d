//! `collsched plan`.

use std::process::ExitCode;

use super::CliError;

/// Flags of `collsched plan`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `collsched plan`.
///
/// # Errors
/// Any failure, as one line for the user.
pub fn run(_args: Args) -> Result<ExitCode, CliError> {
    Err(super::not_yet("plan"))
}
