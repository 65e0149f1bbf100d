#!/usr/bin/env bash
# The whole test suite (doc tests, then unit, integration, property and CLI tests through
# nextest), all features on. Nextest's summary is kept in target/ci-nextest.log so that
# ci/all.sh can repeat it as the run's closing line.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
cargo test --workspace --all-features --doc
log="${CARGO_TARGET_DIR:-target}/ci-nextest.log"
mkdir -p "$(dirname "$log")"
cargo nextest run --workspace --all-features --no-fail-fast 2>&1 | tee "$log"
rc="${PIPESTATUS[0]}"
[ "$rc" -eq 0 ] || exit "$rc"
# The errors of a machine without a CUDA driver (this one): ignored by default, so that a GPU
# machine's run of the ignored tests does not select them.
cargo nextest run --workspace --all-features --no-fail-fast --run-ignored only -E 'test(/without_a_driver/)'
