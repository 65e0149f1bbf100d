#!/usr/bin/env bash
# The GPU check's preparation, on a machine without a GPU: gpu/pack.sh builds the pack (and
# fails over its size limit); the pack's abi3 wheel installs into a Python 3.12 virtual
# environment and imports there; gpu/run.sh dry-runs: every step reports skipped with the
# reason, none passes or fails.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
export COLLSCHED_GPU_PACK="${COLLSCHED_GPU_PACK:-$(pwd)/${CARGO_TARGET_DIR:-target}/gpu-pack}"
bash gpu/pack.sh

# The wheel in another Python than the one that built it.
py312=""
# pyenv's own 3.12 before a python3.12 on PATH (pyenv's shim is on PATH but refuses to run a
# version that is not selected); each candidate must run.
for c in "$(pyenv root 2>/dev/null)/versions/3.12"*/bin/python3.12 python3.12; do
  if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then py312=$(command -v "$c"); break; fi
done
[ -n "$py312" ] || { echo "ci/gpu: no python3.12 (pyenv install 3.12, or put python3.12 on PATH)"; exit 1; }
venv312="$COLLSCHED_CI_CACHE/venv312"
[ -x "$venv312/bin/python" ] || "$py312" -m venv "$venv312"
"$venv312/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$COLLSCHED_GPU_PACK"/wheel/*.whl
"$venv312/bin/python" - <<'PY'
import sys
import collsched
from collsched import _native
assert sys.version_info[:2] == (3, 12), sys.version
# The extension works in this interpreter: a plan through the bindings.
plan = collsched.plan([{"name": "w", "shape": [4, 6], "dtype": "f32"}], world=2)
assert plan["world"] == 2 and [p["name"] for p in plan["params"]] == ["w"], plan
shards = [s for b in plan["buckets"] if b["kind"] == "gather" for s in b["shards"]]
assert sum(seg["numel"] for s in shards for seg in s["segments"]) == 24, shards
print(f"ci/gpu: the abi3 wheel imports in Python {sys.version.split()[0]}: {_native.__file__}")
PY

# The dry run: no GPU here, so every step is skipped, saying why.
dry=$(mktemp -d)
trap 'rm -rf "$dry"' EXIT
bash gpu/run.sh "$dry/out"
steps=$(bash gpu/run.sh --list | wc -l)
skipped=$(grep -c ' skipped ' "$dry/out/summary.txt" || true)
if [ "$skipped" -ne "$steps" ] || grep -Eq ' (ok|FAILED) ' "$dry/out/summary.txt"; then
  cat "$dry/out/summary.txt"; echo "ci/gpu: the dry run should skip all $steps steps, it skipped $skipped"; exit 1
fi
grep -q "no GPU here" "$dry/out/summary.txt" || { cat "$dry/out/summary.txt"; echo "ci/gpu: the dry run did not say why"; exit 1; }
[ -s "$dry/out/logs.tar.gz" ] || { echo "ci/gpu: the dry run wrote no logs.tar.gz"; exit 1; }
# Its JSON summary: every step, skipped, with the reason.
python3 - "$dry/out/summary.json" "$steps" <<'PY'
import json
import sys

s = json.load(open(sys.argv[1]))
steps = s["steps"]
assert len(steps) == int(sys.argv[2]), steps
assert all(x["result"] == "skipped" and "no GPU here" in x["why"] for x in steps), steps
PY
echo "ci/gpu: dry run: all $steps steps skipped (no GPU here)"

# A rehearsal of the runner's machinery on a fake GPU (an nvidia-smi that lists one, and a pack
# whose test binaries pass, fail and hang): each outcome is reported as such, a hung step is
# killed at its timeout with everything it started, and the logs come back.
fake="$dry/fake"
mkdir -p "$fake/bin" "$fake/pack/tests" "$fake/pack/bin" "$fake/pack/wheel"
printf '#!/bin/sh\n[ "$1" = "-L" ] && echo "GPU 0: Fake (UUID: GPU-0)" || echo fake\n' >"$fake/bin/nvidia-smi"
printf '#!/bin/sh\necho "passing $*"\n' >"$fake/pack/tests/cuda_ptx"
printf '#!/bin/sh\necho "failing $*"; exit 3\n' >"$fake/pack/tests/gpu_backend"
# (An odd duration, so that the check below finds this sleep and no other process's.)
printf '#!/bin/sh\necho hanging; exec sleep 287.25\n' >"$fake/pack/tests/gpu_fences"
echo "a fake pack" >"$fake/pack/MANIFEST"
chmod +x "$fake/bin/nvidia-smi" "$fake/pack/tests/"*
PATH="$fake/bin:$COLLSCHED_VENV/bin:$PATH" COLLSCHED_GPU_PACK="$fake/pack" COLLSCHED_GPU_STEP_SECS=3 \
  bash gpu/run.sh "$dry/rehearsal" nvrtc rust-backend rust-fences >/dev/null 2>&1 && rc=0 || rc=$?
s="$dry/rehearsal/summary.txt"
expect() { grep -Eq "$1" "$s" || { cat "$s"; echo "ci/gpu: the rehearsal's summary lacks: $1"; exit 1; }; }
expect '^nvrtc +ok '
expect '^rust-backend +FAILED .*exit 3; last line: failing --ignored'
expect '^rust-fences +FAILED .*timed out after 3s'
[ "$rc" -ne 0 ] || { cat "$s"; echo "ci/gpu: the rehearsal failed steps but exited 0"; exit 1; }
tar -tzf "$dry/rehearsal/logs.tar.gz" | grep -q 'logs/rust-fences.log' || { echo "ci/gpu: no logs from the rehearsal"; exit 1; }
# The device tool brings back 8 files at most: the output folder holds the summary (text and
# JSON) and the logs' tarball alone.
[ "$(ls -A "$dry/rehearsal" | tr '\n' ' ')" = "logs.tar.gz summary.json summary.txt " ] \
  || { ls -A "$dry/rehearsal"; echo "ci/gpu: the output folder holds more than summary.txt, summary.json and logs.tar.gz"; exit 1; }
if pgrep -f "$fake/pack/tests" >/dev/null || pgrep -fx 'sleep 287.25' >/dev/null; then
  echo "ci/gpu: the hung step's processes outlived its timeout"; exit 1
fi
echo "ci/gpu: rehearsal on a fake GPU: pass, fail and timeout reported, the hung step killed"
