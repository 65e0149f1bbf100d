#!/usr/bin/env bash
# The house rules that no compiler checks: imports between the modules of a crate run one way
# (ci/modcycles.py), no non-test Rust source file nor any Python file grows past 800 lines
# (split it along its seams), and CI reports a skipped step as skipped, not passed.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 ci/modcycles.py
limit=800
long=$( (find src buckets/src schedule/src topo/src kernels/src -name '*.rs' ! -name 'tests.rs' ! -name '*_tests.rs'
  find python ci gpu -name '*.py' ! -path '*/target/*') \
  | xargs wc -l | awk -v l="$limit" '$2 != "total" && $1 > l { print "  " $2 ": " $1 " lines" }')
if [ -n "$long" ]; then
  echo "house: source files over $limit lines; split them along their seams:"
  echo "$long"
  exit 1
fi
echo "house: no source file over $limit lines"

# ci/all.sh's reports (ci/steps.sh): a step that exits 77 is reported skipped with its reason,
# never passed, and a failure as failed with its status; ci/multihost.sh's skip exits 77.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
printf 'echo fine\n' >"$scratch/ok.sh"
printf 'echo "x: skipped: no widget here"; exit 77\n' >"$scratch/skip.sh"
printf 'echo broken; exit 3\n' >"$scratch/bad.sh"
report=$(
  source ci/steps.sh
  ci_step ok "$scratch/ok.sh"
  ci_step skip "$scratch/skip.sh"
  ci_step bad "$scratch/bad.sh" || echo "returned $?"
  MULTIHOST_SKIP="forced by ci/house.sh" ci_step multihost
  ci_summary
)
for want in "  ok: passed" "  skip: skipped: no widget here" "returned 3" "  bad: failed (exit 3)" \
  "  multihost: skipped: MULTIHOST_SKIP: forced by ci/house.sh" "steps: 1 passed, 1 failed, 2 skipped"; do
  grep -qxF -- "$want" <<<"$report" || { echo "$report"; echo "house: ci/steps.sh's report lacks the line '$want'"; exit 1; }
done
echo "house: a CI step that exits 77 is reported skipped, with its reason"
