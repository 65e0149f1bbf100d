#!/usr/bin/env bash
# Builds, on this machine, everything gpu/run.sh needs on a GPU machine (which has no Rust
# toolchain and no network) into one ignored folder, gpu/pack/ (or $COLLSCHED_GPU_PACK):
#   bin/collsched        the CLI, release, feature cuda only (no MPI, no hwloc), stripped
#   tests/<name>         test binaries holding GPU tests, feature cuda only, stripped
#   wheel/*.whl          the Python package (abi3: any CPython from 3.11), feature cuda
#   MANIFEST             what was built, from which commit, with sizes
# The scripts (gpu/run.sh, python/tests, python/benchmarks) travel with the working tree.
# Fails when the folder is over $COLLSCHED_GPU_PACK_MAX_MB (default 56) MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
pack="${COLLSCHED_GPU_PACK:-gpu/pack}"
max_mb="${COLLSCHED_GPU_PACK_MAX_MB:-56}"
target="${CARGO_TARGET_DIR:-target}"
rm -rf "$pack"
mkdir -p "$pack/bin" "$pack/tests" "$pack/wheel"

# The test binaries whose tests need a GPU (ignored elsewhere), and the NVRTC compile test.
collsched_tests=(gpu_backend gpu_fences gpu_demo runtime_reduce_device runtime_device)
echo "gpu/pack: cargo build --release --features cuda --bin collsched"
cargo build -q --release --features cuda --bin collsched
install -m 755 "$target/release/collsched" "$pack/bin/collsched"

echo "gpu/pack: test binaries (feature cuda): lib ${collsched_tests[*]} cuda_ptx"
list="$pack/.executables"
test_args=(--lib)
for t in "${collsched_tests[@]}"; do test_args+=(--test "$t"); done
cargo test -q --no-run --features cuda -p collsched "${test_args[@]}" --message-format=json >"$list.json"
cargo test -q --no-run -p collsched-kernels --features cuda --test cuda_ptx --message-format=json >>"$list.json"
# Each artifact with an executable: its target name (the lib's is "collsched") and path.
python3 - "$list.json" "$pack/tests" <<'PY'
import json, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
seen = set()
for line in open(src):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    # Test harnesses only (the CLI binary the integration tests run is an artifact too).
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
        continue
    t = m["target"]
    name = "lib_" + t["name"] if "lib" in t["kind"] else t["name"]
    if name in seen:
        continue
    seen.add(name)
    shutil.copy(m["executable"], f"{dst}/{name}")
    print(f"gpu/pack: tests/{name}")
PY
rm -f "$list.json"
strip "$pack"/bin/* "$pack"/tests/*

echo "gpu/pack: maturin build --release (abi3 wheel, feature cuda)"
venv="${COLLSCHED_VENV:-}"
maturin="maturin"
if [ -n "$venv" ] && [ -x "$venv/bin/maturin" ]; then maturin="$venv/bin/maturin"; fi
"$maturin" build --quiet --release --strip -m python/Cargo.toml -o "$pack/wheel" --compatibility linux >/dev/null
ls "$pack"/wheel/*-cp311-abi3-*.whl >/dev/null || { echo "gpu/pack: no cp311-abi3 wheel in $pack/wheel"; exit 1; }

{
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(rustc --version)"
  (cd "$pack" && find . -type f ! -name MANIFEST -printf '%s %p\n' | sort -k2)
} >"$pack/MANIFEST"
bytes=$(du -sb "$pack" | cut -f1)
mb=$(( (bytes + 1048575) / 1048576 ))
echo "gpu/pack: $pack holds $(find "$pack" -type f | wc -l) files, $mb MiB (limit $max_mb MiB)"
if [ "$mb" -gt "$max_mb" ]; then
  echo "gpu/pack: over the limit of $max_mb MiB: the device tool carries 64 MiB with the working tree"
  exit 1
fi
