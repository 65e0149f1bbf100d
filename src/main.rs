//! The `collsched` command line; see `collsched --help` and `ARCHITECTURE.md`.

use std::process::ExitCode;

fn main() -> ExitCode {
    // Output piped into a program that stops reading (`collsched plan --json | head -1`) ends
    // this process quietly, as coreutils do, instead of a panic in `println!` on EPIPE: restore
    // the default action of SIGPIPE, which the Rust runtime sets to "ignore".
    // SAFETY: called first thing in `main`, before any thread exists; SIG_DFL is a valid
    // disposition for SIGPIPE and installs no handler code.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    collsched::cli::main()
}
