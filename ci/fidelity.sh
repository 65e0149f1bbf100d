#!/usr/bin/env bash
# The simulator's calibration and its fidelity benchmark run and print their figures:
# `collsched calibrate` on the local and shm backends, then benches/fidelity.sh, short (2 ranks,
# one round), with the debug binary. Figures only: nothing here asserts a timing (CI's machine
# is a busy 2-core one; the figures worth reading are benches/README.md's, from the release
# binary). What fails the step is what makes a figure meaningless: a run that fails, a demo
# that lost parity, a NaN, a short run, a simulated step that issues other collectives than the
# real one. A calibration whose every fit a burst of load spoiled is measured once more.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
# The binary the test step built (all features), so nothing is compiled again.
cargo build --quiet --all-features --bin collsched
exe="$(pwd)/${CARGO_TARGET_DIR:-target}/debug/collsched"
[[ ${CARGO_TARGET_DIR:-} == /* ]] && exe="$CARGO_TARGET_DIR/debug/collsched"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
twice() { "$@" || { echo "ci/fidelity: measuring once more (a busy machine): $*"; "$@"; }; }
for backend in local shm; do
  echo "ci/fidelity: collsched calibrate --backend $backend --ranks 2"
  twice "$exe" calibrate --backend "$backend" --ranks 2 --iters 10 --warmup 2 --demo-steps 5 \
    --out "$work/$backend.json"
done
echo "ci/fidelity: benches/fidelity.sh (2 ranks, 20 steps, one round)"
COLLSCHED_EXE="$exe" FIDELITY_RANKS=2 FIDELITY_STEPS=20 FIDELITY_ROUNDS=1 \
  FIDELITY_CALIBRATE="--iters 10 --warmup 2 --demo-steps 5" twice bash benches/fidelity.sh
