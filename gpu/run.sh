#!/usr/bin/env bash
# The GPU check, on a machine with NVIDIA GPUs, over what gpu/pack.sh built elsewhere
# (gpu/pack/, or $COLLSCHED_GPU_PACK). Needs no Rust toolchain and no network: the driver,
# python3 with torch (its nvidia-* wheels give NVRTC and NCCL), and this working tree.
#
#   bash gpu/run.sh OUTDIR [STEP...]      every step, or the steps named, in order
#   bash gpu/run.sh --list                the steps
#
# Writes, as it goes (a run cut off still reports what it did):
#   OUTDIR/summary.txt    one line per step: name, ok|FAILED|skipped, seconds, and why
#   OUTDIR/logs.tar.gz    every step's log (logs/STEP.log, tarred again after each step)
#   OUTDIR/summary.json   the same as JSON: device, versions, each step's result and figures
#                         (gpu/summary.py; commit a run's as benches/gpu/<device>-<date>.json)
#   OUTDIR/trace-collsched.json.gz   the vs-fsdp2 step's trace of collsched's step (rank 0)
# and nothing else there (the device tool brings back 8 files at most); the logs themselves
# are written under $COLLSCHED_GPU_LOGS (default: a new folder in $TMPDIR or /tmp).
# Each step runs under its own timeout, inside a total of $COLLSCHED_GPU_TOTAL_SECS (default
# 540); a step that would not fit in what is left is skipped, saying so. $COLLSCHED_GPU_STEP_SECS,
# when set, caps every step's timeout (a quick rehearsal). Without a GPU every
# step reports skipped, with the reason. $COLLSCHED_GPU_PYTEST_K, when set, is the python step's
# pytest -k expression (a rerun of the tests that failed); $COLLSCHED_FIDELITY_RANKS the fidelity
# step's world sizes (default "2 4 8"). Exit status: 0 when no step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
here=$(pwd)
pack="${COLLSCHED_GPU_PACK:-$here/gpu/pack}"
total="${COLLSCHED_GPU_TOTAL_SECS:-540}"

# name:timeout_seconds:what it runs
STEPS=(
  "probe:30:driver, CUDA, NCCL, torch versions and where the libraries are"
  "nvrtc:60:every CUDA C source compiled by this machine's NVRTC (tests/cuda_ptx)"
  "rust-backend:120:the CUDA backend against the CPU kernels (tests/gpu_backend --ignored)"
  "rust-fences:60:host copies wait for every stream; teardown ends (tests/gpu_fences --ignored)"
  "rust-runtime:90:device gradients through the runtime, a fetch not waiting for its gather (tests/runtime_reduce_device, runtime_device --ignored)"
  "sanitize:150:compute-sanitizer --tool memcheck over the CUDA backend's tests (tests/gpu_backend --ignored)"
  "rust-demo:120:the demo's ZeRO-3 parity on every visible GPU (tests/gpu_demo --ignored)"
  "demo:60:collsched demo --backend cuda on every visible GPU (at most 2)"
  "bench:90:collsched bench --backend cuda, all-gather and reduce-scatter, 4 KiB to 256 MiB, 1 and 2 in flight"
  "kernels:60:collsched bench --backend cuda --op copy_in|copy_out: the copy kernels against a device copy, 4 KiB to 256 MiB"
  "python:220:python/tests/test_cuda.py (collsched.torch on NCCL, against plain PyTorch)"
  "vs-nccl:90:python/benchmarks/vs_nccl.py: collsched's collectives beside torch's NCCL and a device copy, 1 and 2 in flight"
  "vs-fsdp2:150:python/benchmarks/vs_fsdp2.py --device cuda: step and host time against FSDP2, GPT-2 small in f32 and bf16"
  "vs-fsdp2-1b:150:python/benchmarks/vs_fsdp2.py --device cuda: a 0.9B-parameter shape in bf16"
  "vs-fsdp2-offload:120:python/benchmarks/vs_fsdp2.py --device cuda --offload: GPT-2 small in bf16 under CPUOffloadPolicy"
  "host-profile:100:python/benchmarks/vs_fsdp2.py --device cuda --pyprofile: where the host's time goes in GPT-2 small bf16 steps, FSDP2 and collsched"
  "fidelity:90:benches/fidelity.sh on this machine's CPU cores (shm at 2, 4 and 8 ranks, not oversubscribed): the simulator's predictions against real steps"
)

if [ "${1:-}" = "--list" ]; then
  for s in "${STEPS[@]}"; do IFS=: read -r n t w <<<"$s"; printf '%-14s %4ss  %s\n' "$n" "$t" "$w"; done
  exit 0
fi
out="${1:?usage: gpu/run.sh OUTDIR [STEP...] (or --list)}"
shift
mkdir -p "$out"
logs="${COLLSCHED_GPU_LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/collsched-gpu-logs.XXXXXX")}"
mkdir -p "$logs/logs"
out=$(cd "$out" && pwd)
summary="$out/summary.txt"
: >"$summary"
start=$(date +%s)
failed=0
why_skip=""    # set by the probe: a reason every GPU step is skipped

note() { echo "$*" | tee -a "$summary"; }
bundle() {
  tar -C "$logs" -czf "$out/logs.tar.gz.part" logs 2>/dev/null && mv "$out/logs.tar.gz.part" "$out/logs.tar.gz"
  python3 "$here/gpu/summary.py" "$summary" "$logs/logs" >"$out/summary.json.part" 2>/dev/null && mv "$out/summary.json.part" "$out/summary.json"
}

gpus() { nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true; }

# Where the library looks for NVRTC, NCCL and the CUDA headers: torch's site-packages (its
# nvidia-* wheels; what collsched.torch sets itself), then the system's (the loader's order).
find_libraries() {
  local site
  site=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))" 2>/dev/null || true)
  if [ -n "$site" ] && [ -z "${COLLSCHED_CUDA_SEARCH:-}" ]; then export COLLSCHED_CUDA_SEARCH="$site"; fi
}

step_probe() {
  echo "date: $(date -u +%FT%TZ)"; uname -a
  nvidia-smi || return 1
  python3 - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
print("nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "n/a")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"device {i}: {p.name}, sm_{p.major}{p.minor}, {p.total_memory >> 20} MiB")
PY
  echo "python: $(python3 --version) at $(command -v python3)"
  for k in COLLSCHED_CUDA_SEARCH COLLSCHED_NVRTC_LIB COLLSCHED_NCCL_LIB COLLSCHED_CUDA_INCLUDE CUDA_HOME LD_LIBRARY_PATH; do
    echo "$k=${!k:-}"
  done
  # What the loader will find there (its own report comes with the nvrtc step).
  find "${COLLSCHED_CUDA_SEARCH:-/nonexistent}/nvidia" /usr/local/cuda/lib64 -maxdepth 3 \
    \( -name 'libnvrtc.so*' -o -name 'libnccl.so*' -o -name 'cuda_fp16.h' \) 2>/dev/null | head -20
  cat "$pack/MANIFEST"
}

# A Rust test binary's GPU tests (ignored elsewhere), one at a time.
rust_ignored() { COLLSCHED_GPU=1 "$pack/tests/$1" --ignored --test-threads=1 "${@:2}"; }

step_nvrtc() { CI=true "$pack/tests/cuda_ptx" --test-threads=1 --nocapture; }
step_rust_backend() { rust_ignored gpu_backend; }
step_rust_fences() { rust_ignored gpu_fences; }
step_rust_runtime() { rust_ignored runtime_reduce_device && rust_ignored runtime_device --nocapture; }
step_sanitize() {
  local cs
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null | head -n 1)
  [ -n "$cs" ] || { echo "compute-sanitizer: not found on PATH nor under /usr/local/cuda*/bin"; return 1; }
  # Memory errors only: CUDA API errors are not reported (NCCL's start-up probes kernels built
  # for other architectures and gets cudaErrorNoKernelImageForDevice, 96 of them on an H100).
  COLLSCHED_GPU=1 "$cs" --tool memcheck --report-api-errors no --error-exitcode 1 "$pack/tests/gpu_backend" --ignored --test-threads=1
}
step_rust_demo() { rust_ignored gpu_demo; }
step_demo() {
  local n; n=$(gpus); [ "$n" -gt 2 ] && n=2
  "$pack/bin/collsched" demo --backend cuda --ranks "$n" --steps 6
}
step_bench() {
  local n; n=$(gpus); [ "$n" -gt 2 ] && n=2
  # Each collective alone (--inflight 1: its latency), then 2 in flight (queued: one overlaps the next).
  for k in 1 2; do
    for op in all_gather reduce_scatter; do
      echo "== $op, --inflight $k"
      "$pack/bin/collsched" bench --backend cuda --op "$op" --ranks "$n" -b 4K -e 256M -f 4 --inflight "$k" --check || return 1
    done
  done
}
# The copy kernels against cuMemcpyDtoDAsync of the same bytes, 12 pieces (a block's parameters),
# in f32 and bf16; the footer compares them from 64 MiB up.
step_kernels() {
  for op in copy_in copy_out; do
    for ty in f32 bf16; do
      echo "== $op, $ty"
      "$pack/bin/collsched" bench --backend cuda --op "$op" --dtype "$ty" -b 4K -e 256M -f 4 --coalesce 12 --check || return 1
    done
  done
}

# The wheel, unpacked where python3 finds it (PYTHONPATH; nothing installed system-wide).
python_site() {
  local site=/tmp/collsched-gpu-site
  if [ ! -d "$site/collsched" ]; then
    python3 -m pip install -q --no-deps --no-index --no-compile --target "$site" "$pack"/wheel/*.whl || return 1
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  python3 -c "import collsched, collsched._native; print('collsched from', collsched.__file__)"
}
step_python() { python_site && COLLSCHED_GPU=1 python3 -m pytest -q -rs -p no:cacheprovider python/tests/test_cuda.py ${COLLSCHED_GPU_PYTEST_K:+-k "$COLLSCHED_GPU_PYTEST_K"}; }
# Each collective alone, then 2 queued at once (collsched's in flight, torch's async_op).
step_vs_nccl() { python_site && python3 python/benchmarks/vs_nccl.py && python3 python/benchmarks/vs_nccl.py --inflight 2; }
step_vs_fsdp2() {
  python_site || return 1
  local n; n=$(gpus); [ "$n" -gt 2 ] && n=2
  # GPT-2 small's shape (12 blocks of dim 768) in f32 and in bf16 (MixedPrecisionPolicy(bf16,
  # f32)). FSDP2 and collsched compute alike in bf16: their losses to 1e-2.
  local gpt2=(--dim 768 --heads 12 --blocks 12 --seq 512 --batch 8)
  vs_fsdp2 "$n" "${gpt2[@]}" || return 1
  # The bf16 run also traces one step of each (torch.profiler): the traces stay out of the logs'
  # tarball (their size), drawn as SVG into it; collsched's rank 0 trace comes back gzipped.
  local traces="$logs/traces"
  vs_fsdp2 "$n" "${gpt2[@]}" --mp bf16 --loss-rtol 1e-2 --trace "$traces" || return 1
  local t
  for t in "$traces"/*-rank0.json; do
    python3 python/benchmarks/trace_svg.py "$t" "$logs/logs/$(basename "$t" .json).svg" --title "$(basename "$t" .json), GPT-2 small bf16, $(nvidia-smi -L | head -n 1 | cut -d'(' -f1)" || return 1
  done
  gzip -c "$traces/collsched-rank0.json" >"$out/trace-collsched.json.gz.part" || return 1
  if [ "$(stat -c %s "$out/trace-collsched.json.gz.part")" -lt 15000000 ]; then
    mv "$out/trace-collsched.json.gz.part" "$out/trace-collsched.json.gz"
  else
    echo "trace-collsched.json.gz over 15 MB: not brought back"; rm -f "$out/trace-collsched.json.gz.part"
  fi
}
# A 0.9B-parameter shape (16 blocks of dim 2048), bf16.
step_vs_fsdp2_1b() {
  python_site || return 1
  local n; n=$(gpus); [ "$n" -gt 2 ] && n=2
  vs_fsdp2 "$n" --dim 2048 --heads 16 --blocks 16 --seq 512 --batch 4 --vocab 32000 --steps 5 --mp bf16 --loss-rtol 1e-2
}
# GPT-2 small in bf16 again, both under CPUOffloadPolicy (the AdamW step on the host).
step_vs_fsdp2_offload() {
  python_site || return 1
  local n; n=$(gpus); [ "$n" -gt 2 ] && n=2
  vs_fsdp2 "$n" --dim 768 --heads 12 --blocks 12 --seq 512 --batch 8 --steps 5 --mp bf16 --offload --loss-rtol 1e-2
}
# Three untimed steps of each under cProfile, after 2 timed ones: the host's time by function.
step_host_profile() {
  python_site || return 1
  local n; n=$(gpus); [ "$n" -gt 2 ] && n=2
  vs_fsdp2 "$n" --dim 768 --heads 12 --blocks 12 --seq 512 --batch 8 --steps 2 --warmup 2 --mp bf16 --loss-rtol 1e-2 --pyprofile 45
}
# A CPU step: the simulator's predictions on a host with cores to spare and no other build
# running (the build machine's 2 shared cores are the noise floor of that table).
step_fidelity() {
  COLLSCHED_EXE="$pack/bin/collsched" FIDELITY_RANKS="${COLLSCHED_FIDELITY_RANKS:-2 4 8}" bash benches/fidelity.sh
}
vs_fsdp2() {
  local n=$1; shift
  python3 -m torch.distributed.run --standalone --nproc-per-node "$n" python/benchmarks/vs_fsdp2.py --device cuda "$@"
}

run_step() {
  local name=$1 limit=$2 fn="step_${1//-/_}" log="$logs/logs/$1.log" t0 rc secs left
  if [ -n "${COLLSCHED_GPU_STEP_SECS:-}" ] && [ "$COLLSCHED_GPU_STEP_SECS" -lt "$limit" ]; then limit=$COLLSCHED_GPU_STEP_SECS; fi
  left=$(( total - ($(date +%s) - start) ))
  if [ -n "$why_skip" ] && [ "$name" != probe ]; then
    note "$(printf '%-14s skipped %4ss  %s' "$name" 0 "$why_skip")"; return
  fi
  if [ "$left" -lt "$limit" ]; then
    note "$(printf '%-14s skipped %4ss  %s' "$name" 0 "${left}s left of the total ${total}s, the step may take ${limit}s")"; return
  fi
  t0=$(date +%s)
  ( "$fn" ) >"$log" 2>&1 &
  local pid=$!
  ( sleep "$limit"; kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null ) &
  local watchdog=$!
  wait "$pid"; rc=$?
  kill -- "-$watchdog" 2>/dev/null || kill "$watchdog" 2>/dev/null; wait "$watchdog" 2>/dev/null
  secs=$(( $(date +%s) - t0 ))
  if [ "$rc" -eq 0 ]; then
    note "$(printf '%-14s ok      %4ss' "$name" "$secs")"
  else
    failed=1
    local why="exit $rc"
    [ "$secs" -ge "$limit" ] && why="timed out after ${limit}s"
    note "$(printf '%-14s FAILED  %4ss  %s; last line: %s' "$name" "$secs" "$why" "$(tail -n 1 "$log" | cut -c1-200)")"
  fi
  bundle
}

set -m  # each step in its own process group, so a timeout ends everything it started
wanted=("$@")
if [ ! -d "$pack/tests" ]; then
  why_skip="no pack at $pack: run gpu/pack.sh on the build machine and carry gpu/pack"
elif ! command -v nvidia-smi >/dev/null 2>&1 || [ "$(gpus)" -eq 0 ]; then
  why_skip="no GPU here (nvidia-smi lists none)"
fi
[ -z "$why_skip" ] && find_libraries
for s in "${STEPS[@]}"; do
  IFS=: read -r name limit _ <<<"$s"
  if [ ${#wanted[@]} -gt 0 ] && [[ ! " ${wanted[*]} " == *" $name "* ]]; then continue; fi
  if [ "$name" = probe ] && [ -n "$why_skip" ]; then
    note "$(printf '%-14s skipped %4ss  %s' probe 0 "$why_skip")"; continue
  fi
  run_step "$name" "$limit"
done
bundle
note "total $(( $(date +%s) - start ))s; $( [ "$failed" -eq 0 ] && echo 'no step failed' || echo 'some step FAILED')"
exit "$failed"
