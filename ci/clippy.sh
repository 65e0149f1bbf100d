#!/usr/bin/env bash
# Lints with warnings as errors, on every target, with and without the optional features.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy --workspace --all-targets --all-features -- -D warnings
