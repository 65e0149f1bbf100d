#!/usr/bin/env bash
# Rustdoc with warnings as errors (broken or private intra-doc links, missing docs).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --all-features
