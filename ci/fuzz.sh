#!/usr/bin/env bash
# Builds the cargo-fuzz targets in fuzz/ and runs each for COLLSCHED_FUZZ_SECS seconds
# (default 60; 0 builds only); longer runs are for humans, see README.md "Fuzzing". libFuzzer needs nightly-only flags; RUSTC_BOOTSTRAP=1 lets the stable toolchain
# accept them. Installs cargo-fuzz on a fresh machine (about 2 minutes, once).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "ci/fuzz: cargo install cargo-fuzz --locked"
  cargo install cargo-fuzz --locked
fi
cd fuzz
# Its own workspace and target directory (fuzz/target): sanitizer flags would invalidate a
# shared one on every switch.
unset CARGO_TARGET_DIR
RUSTC_BOOTSTRAP=1 cargo fuzz build
echo "ci/fuzz: built $(ls fuzz_targets | sed 's/\.rs$//' | tr '\n' ' ')"
secs="${COLLSCHED_FUZZ_SECS:-60}"
if [ "$secs" -gt 0 ]; then
  for target in $(ls fuzz_targets | sed 's/\.rs$//'); do
    echo "ci/fuzz: running $target for ${secs}s"
    # A crash fails the step; its input is kept in fuzz/artifacts/$target/.
    RUSTC_BOOTSTRAP=1 cargo fuzz run "$target" -- -max_total_time="$secs" -print_final_stats=1 2>&1 | tail -n 3
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "ci/fuzz: $target found a failure"; exit 1; }
  done
fi
