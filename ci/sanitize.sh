#!/usr/bin/env bash
# The local and shm backends' tests once under AddressSanitizer: out-of-bounds accesses and
# uses after free in the stream threads, the pools, the meeting protocol and the moves between
# ranks' buffers (the raw-pointer parts). -Zsanitizer is nightly-only; RUSTC_BOOTSTRAP=1 lets
# the stable toolchain take it. Its own target directory (the flags rebuild everything). The
# allocation-counting tests replace the global allocator and are left out; so is leak
# detection (a pool leaks, on purpose, a buffer a peer may still read when its event never
# completed).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
host=$(rustc -vV | sed -n 's/^host: //p')
export RUSTC_BOOTSTRAP=1
export RUSTFLAGS="-Zsanitizer=address"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/asan"
# Dependencies unoptimized and line tables only: this build is for finding bad accesses, and
# halves its compile time next to the test profile's optimized dependencies.
export CARGO_PROFILE_DEV_DEBUG=line-tables-only
cfg=(--config 'profile.dev.package."*".opt-level=0')
tests=(local_collectives local_chain local_failures local_streams local_teardown shm flight)
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
# --target makes RUSTFLAGS skip build scripts and proc macros (they run on the host uninstrumented).
log="$CARGO_TARGET_DIR/ci-sanitize.log"
mkdir -p "$CARGO_TARGET_DIR"
{
  cargo test "${cfg[@]}" --target "$host" --lib -- backend:: &&
    cargo test "${cfg[@]}" --target "$host" "${args[@]}"
} >"$log" 2>&1 || { tail -n 60 "$log"; echo "ci/sanitize: failed (whole log: $log)"; exit 1; }
grep -E "^test result:" "$log" | sed 's/^/ci\/sanitize: /'
