//! The `collsched` command line: one module per subcommand, each with its own flags (`PlanArgs`,
//! `BenchArgs`, ...) and `run`.
//!
//! The flags and output formats are a contract that scripts depend on: each subcommand's
//! module documents its own, and `collsched <command> --help` lists every flag with its
//! default. Every bad input exits with status 1 and one line `error: ...`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub mod bench;
pub mod calibrate;
pub mod ckpt;
pub mod demo;
pub mod flight;
pub mod launch;
pub mod plan;
pub mod sim;
pub mod topo;

/// Coalesced collective plans and their scheduling for sharded data-parallel training.
#[derive(Debug, Parser)]
#[command(name = "collsched", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Build the layout and coalesced plan for a parameter list and print it.
    Plan(plan::PlanArgs),
    /// Measure collectives, printing nccl-tests columns.
    Bench(bench::BenchArgs),
    /// Simulate training steps on a modelled machine.
    Sim(Box<sim::SimArgs>),
    /// Measure this machine's collective, launch and host costs into a cost profile for `sim --cost`.
    Calibrate(calibrate::CalibrateArgs),
    /// Train a small model sharded over local ranks and check parity with an unsharded run.
    Demo(demo::DemoArgs),
    /// Print the machine as the library sees it.
    Topo(topo::TopoArgs),
    /// Inspect a checkpoint: its index, and every file and piece it names.
    Ckpt(ckpt::CkptArgs),
    /// Read the ranks' flight records and say what went wrong first.
    Flight(flight::FlightArgs),
}

/// An error a subcommand reports: printed as one line `error: ...`, exit status 1.
pub type CliError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Parses the command line, runs the subcommand and turns its outcome into an exit code.
pub fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan(a) => plan::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Sim(a) => sim::run(*a),
        Command::Calibrate(a) => calibrate::run(a),
        Command::Demo(a) => demo::run(a),
        Command::Topo(a) => topo::run(a),
        Command::Ckpt(a) => ckpt::run(a),
        Command::Flight(a) => flight::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr, filtered by `COLLSCHED_LOG` (tracing's env-filter syntax, e.g.
/// `collsched::coll=debug`); default: warnings only.
fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("COLLSCHED_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}
