//! The `collsched` command line; see `collsched --help` and `ARCHITECTURE.md`.

use std::process::ExitCode;

fn main() -> ExitCode {
    collsched::cli::main()
}
