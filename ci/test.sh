#!/usr/bin/env bash
# The whole test suite (doc tests, then unit, integration, property and CLI tests through
# nextest, whose summary line closes the run), all features on.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
cargo test --workspace --all-features --doc
cargo nextest run --workspace --all-features --no-fail-fast
