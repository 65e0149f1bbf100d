#!/usr/bin/env bash
# Everything CI checks, in order; what `.ci/run` calls. Each step is a script of its own, run
# by ci/steps.sh: a step that exits 77 is reported skipped with its reason, not passed, and the
# closing summary lists every step as passed, skipped (why) or failed.
# Benches are type-checked by clippy --all-targets, not built in release (that would double CI).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/steps.sh
# On a failure the step list closes the output; on success it comes before the counts.
trap 'rc=$?; [ "$rc" = 0 ] || ci_summary' EXIT
ci_step setup
ci_step fmt
ci_step house
ci_step clippy
ci_step test
ci_step fidelity
ci_step python
ci_step gpu
ci_step wheel
for extra in doc ptx fuzz loom sanitize multihost; do
  [ -f "ci/$extra.sh" ] && ci_step "$extra"
done
ci_summary
echo "== ci: all green in $(($(date +%s) - ci_start))s"
# The closing line: nextest's counts, in the plain form 'N passed, N failed, N skipped'.
summary=$(grep -E "Summary \[" "${CARGO_TARGET_DIR:-target}/ci-nextest.log" | tail -n 1 || true)
run=$(sed -nE 's/.* ([0-9]+) tests? run: ([0-9]+) passed.*/\2/p' <<<"$summary")
skipped=$(sed -nE 's/.* ([0-9]+) skipped.*/\1/p' <<<"$summary")
failed=$(sed -nE 's/.* ([0-9]+) failed.*/\1/p' <<<"$summary")
echo "tests: ${run:-0} passed, ${failed:-0} failed, ${skipped:-0} skipped"
# pytest's closing line, e.g. '12 passed, 1 skipped in 80.1s'.
pyline=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "${CARGO_TARGET_DIR:-target}/ci-pytest.log" | tail -n 1 || true)
echo "python tests: ${pyline:-none}"
