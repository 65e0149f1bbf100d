#!/usr/bin/env bash
# Builds the cargo-fuzz targets in fuzz/ (not run: running is for humans, see README.md
# "Fuzzing"). libFuzzer needs nightly-only flags; RUSTC_BOOTSTRAP=1 lets the stable toolchain
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
