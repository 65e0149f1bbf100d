#!/usr/bin/env bash
# The loom model checks of the local backend's synchronisation (src/backend/local/loom_tests.rs):
# events, the stream queue, the meeting protocol (arrive, abort, depart) and deferred frees,
# every interleaving (loom's default: no preemption bound; LOOM_MAX_PREEMPTIONS sets one).
# `--cfg loom` swaps loom's primitives in (src/backend/local/sync.rs) and rebuilds everything:
# its own target directory.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
export RUSTFLAGS="--cfg loom"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/loom"
mkdir -p "$CARGO_TARGET_DIR"
log="$CARGO_TARGET_DIR/ci-loom.log"
cargo test --lib --release loom_ >"$log" 2>&1 || { tail -n 60 "$log"; echo "ci/loom: failed (whole log: $log)"; exit 1; }
result=$(grep -E "^test result:" "$log" | tail -n 1)
# A filter that matched nothing would pass: insist on the checks having run.
ran=$(sed -nE 's/^test result: ok\. ([0-9]+) passed.*/\1/p' <<<"$result")
[ "${ran:-0}" -gt 0 ] || { echo "ci/loom: no loom test ran ($result)"; exit 1; }
echo "ci/loom: $result"
