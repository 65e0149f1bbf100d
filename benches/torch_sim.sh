#!/usr/bin/env bash
# collsched.torch's step against the simulator's prediction of it (a benchmark, not a test: it
# asserts nothing about timings).
#
# Each round: python/examples/train.py trains 20 steps on 2 shm ranks with its flight record and
# workload (--flight-out), `collsched calibrate` measures the machine, and `collsched sim`
# predicts the step from the workload (its compute measured under core sharing, so the
# profile's sharing terms are off; "with sharing": on). Prints per round the slower rank's
# median real step (steps 2..20, from one step's first compute span to the next step's), each
# rank's median compute spans a step, the workload's compute and engine time a step, and the
# predictions with their ratio to the real step.
#
# Fails on a short run (fewer steps recorded than trained), a figure that is not a positive
# number, or a failed command.
#
#   bash benches/torch_sim.sh            # 5 rounds; TORCH_SIM_ROUNDS=N for another count
# Needs torch and the collsched package importable by $PYTHON (default python3), torchrun on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${TORCH_SIM_ROUNDS:-5}
steps=20
exe=${COLLSCHED_EXE:-${CARGO_TARGET_DIR:-target}/release/collsched}
[[ -x $exe ]] || cargo build --release --quiet
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "# benches/torch_sim.sh: $exe; $rounds round(s) of $steps steps on 2 shm ranks; load $(cut -d' ' -f1-3 /proc/loadavg)"
for ((r = 1; r <= rounds; r++)); do
  fl="$work/fl"
  rm -rf "$fl"
  torchrun --nproc-per-node 2 python/examples/train.py --steps "$steps" --micro 1 --eval-every 0 \
    --flight-out "$fl" >"$work/train.txt" 2>&1 || { tail -5 "$work/train.txt"; echo "train.py failed" >&2; exit 1; }
  "$exe" calibrate --backend shm --ranks 2 --out "$work/profile.json" >"$work/cal.txt" 2>&1 \
    || { tail -5 "$work/cal.txt"; echo "calibrate failed" >&2; exit 1; }
  sim() {
    "$exe" sim --workload "$fl/workload.json" --world 2 --cost "$work/profile.json" --tflops 1 \
      --bucket-by module --steps "$steps" --json "$@" | grep -o '"step_ms":[0-9.e+-]*' | cut -d: -f2
  }
  predicted=$(sim --compute-slowdown 1 --compute-overlap 1)
  shared=$(sim)
  "$py" - "$fl" "$steps" "$r" "$predicted" "$shared" <<'PY'
import glob, json, math, statistics, sys

fl, steps, r = sys.argv[1], int(sys.argv[2]), sys.argv[3]
predicted, shared = float(sys.argv[4]), float(sys.argv[5])
real, spans = [], []
for f in sorted(glob.glob(f"{fl}/rank-*.json")):
    by = {}
    for c in json.load(open(f))["compute"]:
        by.setdefault(c["step"], []).append(c)
    if sorted(by) != list(range(steps)):
        sys.exit(f"{f}: compute spans of steps {sorted(by)}, not of all {steps} (a short run)")
    first = [min(c["start_ns"] for c in by[k]) for k in range(steps)]
    real.append(statistics.median(b - a for a, b in zip(first[1:], first[2:])) / 1e6)
    spans.append(statistics.median(sum(c["end_ns"] - c["start_ns"] for c in by[k]) for k in range(1, steps - 1)) / 1e6)
w = json.load(open(f"{fl}/workload.json"))
compute = (sum(l["forward_flops"] + l["backward_flops"] for l in w["layers"]) + w["loss_flops"] + w["update_flops"]) / 1e9
engine = w["hook_s"] * 1e3 * len(w["layers"])
figures = [*real, *spans, compute, engine, predicted, shared]
if len(real) != 2 or not all(math.isfinite(x) and x > 0 for x in figures):
    sys.exit(f"round {r}: a figure is missing or not a positive number: {figures}")
step = max(real)
print(f"round {r}: real {step:.2f} ms; spans {spans[0]:.2f}, {spans[1]:.2f} ms; workload compute {compute:.2f} ms, "
      f"engine {engine:.2f} ms; simulated {predicted:.2f} ms ({predicted / step:.2f}), with sharing {shared:.2f} ms "
      f"({shared / step:.2f})")
PY
done
