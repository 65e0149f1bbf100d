#!/usr/bin/env bash
# The house rules that no compiler checks: imports between the modules of a crate run one way
# (ci/modcycles.py), and no non-test Rust source file nor any Python file grows past 800 lines
# (split it along its seams).
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
