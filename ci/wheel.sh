#!/usr/bin/env bash
# A wheel anyone can install: the abi3 wheel (`maturin build --release`, as gpu/pack.sh makes
# it, from the same build cache) installs with pip into a new virtual environment with
# no Rust toolchain on PATH, and the example trains under torchrun from it: every logged loss
# finite, the last below the first. torch comes from the CI environment through a .pth file
# (the same CPython 3.11), so CI downloads it once; the package itself is the wheel's alone.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
py="$COLLSCHED_VENV/bin/python"
[ -x "$py" ] || { echo "ci/wheel: no $py (run ci/python.sh first)"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "ci/wheel: maturin build --release (abi3 wheel)"
"$COLLSCHED_VENV/bin/maturin" build --quiet --release --strip -m python/Cargo.toml -o "$tmp/dist" \
  --compatibility linux >/dev/null
wheel=$(ls "$tmp"/dist/*-cp311-abi3-*.whl)
base=$("$py" -c 'import sys; print(sys.base_prefix)')
"$base/bin/python3" -m venv "$tmp/venv"
# PATH without cargo, rustc or maturin: the install cannot build anything.
clean="$tmp/venv/bin:/usr/bin:/bin"
if PATH="$clean" command -v cargo >/dev/null || PATH="$clean" command -v rustc >/dev/null; then
  echo "ci/wheel: a Rust toolchain is on the clean PATH ($clean)"; exit 1
fi
PATH="$clean" "$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
  --only-binary :all: "$wheel"
# torch (and what it needs) after the install: pip must not see the CI environment's packages.
site=$("$tmp/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$site/ci-torch.pth"
where=$(cd "$tmp" && PATH="$clean" "$tmp/venv/bin/python" -c 'import collsched; print(collsched.__file__)')
case "$where" in
  "$tmp/venv/"*) echo "ci/wheel: collsched from the wheel: $where" ;;
  *) echo "ci/wheel: collsched imported from $where, not from the new environment"; exit 1 ;;
esac
log="$tmp/train.log"
repo=$(pwd)
(cd "$tmp" && PATH="$clean" OMP_NUM_THREADS=1 timeout 600 "$tmp/venv/bin/python" -m torch.distributed.run \
  --standalone --nproc-per-node 2 "$repo/python/examples/train.py" --steps 10) >"$log" 2>&1 || {
  cat "$log"; echo "ci/wheel: the example failed under torchrun"; exit 1
}
cat "$log"
"$py" - "$log" <<'PY'
import math
import re
import sys

losses = [float(m) for m in re.findall(r"train loss (\S+),", open(sys.argv[1]).read())]
assert len(losses) >= 2, f"ci/wheel: {len(losses)} loss lines in the example's output"
assert all(math.isfinite(v) for v in losses), f"ci/wheel: a loss is not finite: {losses}"
assert losses[-1] < losses[0], f"ci/wheel: the loss did not go down: {losses}"
print(f"ci/wheel: the wheel trains under torchrun: loss {losses[0]} -> {losses[-1]}")
PY
