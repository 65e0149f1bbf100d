#!/usr/bin/env bash
# Two "hosts" on one machine: two network namespaces joined by a veth pair, each with its own
# address and host name, and an Open MPI job across them over TCP (mpirun's rsh agent enters
# the other namespace with `ip netns exec`). Runs the demo (parity with the unsharded reference)
# and checked benches over the link with the mpi backend, and runs the simulator, given the
# link's latency and bandwidth as the bench measures them, and again priced by the cost profile
# `collsched calibrate --backend mpi` measures across the link, on the demo's workload: it prints
# the measured and the simulated step times and their ratios (numbers in benches/README.md),
# and fails only when one is not a positive number. How close the two are is a timing, so
# no CI verdict rests on it (a busy machine slows the measurement by 10x). Then the same on the link slowed to
# 50 Mbit/s by `tc tbf` (where the kernel has tbf), and parity, bench and prediction on a link
# delayed 2 ms each way (`tc netem`, or where the kernel lacks it, a second link of TAP devices
# relayed by ci/delaylink.py). Needs root, iproute2 and namespaces: otherwise it says why and
# skips. A skip, whole or of a part (the rate-limited or the delayed run), exits 77 (automake's
# SKIP), which ci/all.sh reports as skipped with the reason, never as passed.
# MULTIHOST_VERBOSE=1 prints the bench tables; MULTIHOST_SKIP=REASON skips at once (ci/house.sh
# checks the skip's report with it).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh

skip() { echo "ci/multihost: skipped: $1"; exit 77; }
[ -z "${MULTIHOST_SKIP:-}" ] || skip "MULTIHOST_SKIP: $MULTIHOST_SKIP"
[ "$(id -u)" = 0 ] || skip "not root (network namespaces need it)"
command -v ip >/dev/null || skip "no ip command (apt install iproute2)"
command -v tc >/dev/null || skip "no tc command (apt install iproute2)"
command -v unshare >/dev/null || skip "no unshare command (util-linux)"
command -v mpirun >/dev/null || skip "no mpirun (apt install openmpi-bin)"

tag="cs$$"
ns0="$tag-h0" ns1="$tag-h1" dev0="${tag}a" dev1="${tag}b"
net=10.77.$(( $$ % 200 + 20 ))
a0="$net.1" a1="$net.2"
# The delayed link's subnet (ci/delaylink.py, where the kernel has no netem).
dnet=10.78.$(( $$ % 200 + 20 ))
d1="$dnet.2"
work=$(mktemp -d)
relay=""
cleanup() {
  if [ -n "$relay" ]; then kill "$relay" 2>/dev/null || true; fi
  ip netns del "$ns0" 2>/dev/null || true
  ip netns del "$ns1" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
ip netns add "$ns0" 2>/dev/null || skip "cannot create a network namespace here"
ip netns add "$ns1"
ip link add "$dev0" type veth peer name "$dev1" || skip "cannot create a veth pair here"
ip link set "$dev0" netns "$ns0"
ip link set "$dev1" netns "$ns1"
ip -n "$ns0" addr add "$a0/24" dev "$dev0"
ip -n "$ns1" addr add "$a1/24" dev "$dev1"
for ns in "$ns0" "$ns1"; do ip -n "$ns" link set lo up; done
ip -n "$ns0" link set "$dev0" up
ip -n "$ns1" link set "$dev1" up

# The rsh agent Open MPI calls as `agent HOST COMMAND...`: the second host is the second
# namespace, with a host name of its own (Open MPI tells nodes apart by name).
cat >"$work/agent" <<AGENT
#!/bin/sh
host="\$1"; shift
case "\$host" in
  $a1|$d1) exec ip netns exec $ns1 unshare --uts sh -c 'hostname $ns1; exec sh -c "\$0"' "\$*" ;;
  *) exec sh -c "\$*" ;;
esac
AGENT
chmod +x "$work/agent"

# A release build with the mpi backend (timings feed the simulator's prediction below: a debug
# build's host costs are not the library's), or MULTIHOST_EXE.
if [ -z "${MULTIHOST_EXE:-}" ]; then
  echo "ci/multihost: cargo build --release --features mpi"
  cargo build -q --release --features mpi --bin collsched
  exe=$(realpath "${CARGO_TARGET_DIR:-target}/release/collsched")
else
  exe=$(realpath "$MULTIHOST_EXE")
fi

run_across() {
  ip netns exec "$ns0" timeout 300 mpirun --allow-run-as-root --host "$a0:1,$a1:1" -np 2 \
    --mca plm_rsh_agent "$work/agent" --mca btl tcp,self \
    --mca btl_tcp_if_include "$net.0/24" --mca oob_tcp_if_include "$net.0/24" \
    -x COLLSCHED_TIMEOUT_SECS "$@"
}
across() { run_across "$exe" "$@"; }
export COLLSCHED_TIMEOUT_SECS=120

# Each demo writes its record (settings, losses, final parameters); the plain link's records
# are compared exactly with the test suite's independent reference (tests/support/reference.rs).
records=()
check_demo() {
  local out record="$work/record-${1//:/-}-${#records[@]}.json"
  out=$(across demo --backend mpi --steps 3 --strategy "$1" --record-out "$record")
  records+=("$record")
  grep -q "parity: max |loss difference| = 0e0 over 3 steps" <<<"$out" \
    || { echo "$out"; echo "ci/multihost: demo $1 across the link lost parity"; exit 1; }
  echo "ci/multihost: demo --strategy $1 across $a0 and $a1: parity exact; $(grep -o 'reference .* ms, sharded .* ms' <<<"$out")"
}
check_bench() {
  local out
  out=$(across bench --backend mpi --op "$1" -b 1K -e 4M -f 16 --iters 5 --warmup 1 --check)
  if [ -n "${MULTIHOST_VERBOSE:-}" ]; then echo "$out"; fi
  grep -q "# out of bounds values : 0 OK" <<<"$out" \
    || { echo "$out"; echo "ci/multihost: bench $1 across the link was wrong"; exit 1; }
  echo "ci/multihost: bench $1 across the link: 0 wrong; $(grep 'busbw at the largest' <<<"$out" | sed 's/^# //')"
}

hosts=$(run_across hostname | sort | tr '\n' ' ')
echo "ci/multihost: two hosts: $hosts($a0 in $ns0, $a1 in $ns1, Open MPI over TCP)"
check_demo even
check_demo greedy
check_demo hybrid:1
echo "ci/multihost: the demos' records against the independent reference (cargo test, feature mpi)"
COLLSCHED_DEMO_RECORD="$(IFS=:; echo "${records[*]}")" cargo test -q --features mpi --test cli_demo -- \
  --ignored --exact record_files_named_by_collsched_demo_record_match_the_reference \
  || { echo "ci/multihost: a demo's record differs from the independent reference"; exit 1; }
check_bench all_gather
check_bench reduce_scatter

# The simulator's prediction of the demo's step time over the link, from the link as a
# collective sees it: the mpi backend's all-gather at 4 KiB and at 64 KiB (the sizes of the
# demo's buckets; the bench's default two in flight, as a stream with queued work runs them)
# gives its latency a and bandwidth B (a 2-rank all-gather of S bytes takes a + S/2B, the cost
# model's ring), a topology file of two nodes joined by that link, the demo's workload
# (--workload-out) and its compute rate and host time per collective measured in the same run (--tflops,
# --host-overhead-us). The demo runs one
# micro-batch per step without evaluation or freezing: one simulated step.
predict_once() {
  local label="$1" out rows a_us bw step tflops host sim cal shared
  out=$(across bench --backend mpi --op all_gather -b 4K -e 64K -f 16 --iters 40 --warmup 5)
  rows=$(grep -v '^#' <<<"$out" | awk 'NF >= 8 { print $1, $6 }')
  read -r a_us bw < <(awk 'NR == 1 { s1 = $1; t1 = $2 } NR == 2 { s2 = $1; t2 = $2 }
    END { b = (s2 - s1) / 2 / ((t2 - t1) * 1e-6); if (b <= 0 || b > 1e12) b = 1e12
          a = t1 - s1 / 2 / b * 1e6; if (a < 0) a = 0; printf "%.3f %.6f\n", a, b / 1e9 }' <<<"$rows")
  cat >"$work/link.json" <<TOPO
{"format": "collsched-topology", "version": 1, "name": "veth-$label", "source": "ci/multihost.sh",
 "nodes": 2,
 "machine": {"packages": 1, "cores": 1, "pus": 1,
             "numa_nodes": [{"os_index": 0, "memory_bytes": 0, "package": 0}]},
 "intra_node": {"class": "shared_memory", "bandwidth_gbs": 10.0, "latency_us": 0.5},
 "inter_node": {"class": "ethernet", "bandwidth_gbs": $bw, "latency_us": $a_us}}
TOPO
  out=$(across demo --backend mpi --steps 40 --micro-batches 1 --eval-every 0 --no-freeze \
    --workload-out "$work/demo.json")
  grep -q "parity: max |loss difference| = 0e0" <<<"$out" \
    || { echo "$out"; echo "ci/multihost: demo ($label) across the link lost parity"; exit 1; }
  step=$(sed -n 's/^step time: \([0-9.]*\) ms.*/\1/p' <<<"$out")
  tflops=$(sed -n 's/.*sim --tflops \([0-9.e+-]*\);.*/\1/p' <<<"$out")
  host=$(sed -n 's/.*sim --host-overhead-us \([0-9.e+-]*\)$/\1/p' <<<"$out")
  sim=$(sim_step --topo "$work/link.json" --tflops "$tflops" --host-overhead-us "$host")
  # The same with the two collective streams sharing the link (`--shared-link`), as they do.
  shared=$(sim_step --topo "$work/link.json" --tflops "$tflops" --host-overhead-us "$host" --shared-link)
  # (1000 GB/s: the time did not grow from 4 KiB to 64 KiB; latency is all there is to it.)
  echo "ci/multihost: $label link as a collective sees it: latency $a_us us, bandwidth $bw GB/s;" \
    "demo step: measured $step ms, simulated $sim ms (ratio $(ratio "$sim" "$step"));" \
    "with a shared link $shared ms (ratio $(ratio "$shared" "$step"))"
  # Any figure missing or not positive (a parse failure, a NaN) is a failure; the ratios are
  # printed only.
  awk -v m="$step" -v s="$sim" -v h="$shared" 'BEGIN { exit !(m > 0 && s > 0 && h > 0) }' \
    || { echo "ci/multihost: no measured ($step) or simulated ($sim, $shared) step time on the $label link"; exit 1; }
  # The same link calibrated (`collsched calibrate --backend mpi`: each kind's fixed and per-byte
  # cost fitted over the demo's bucket sizes, or its latency alone where the time is flat over
  # them; the host time per collective; how compute shares the cores) and the simulator priced
  # by that profile (`--cost`) instead of the topology. A kind the probe could not fit is a
  # timing's outcome: said, and the prediction left out; any other failure fails the step.
  if ! cal=$(across calibrate --backend mpi -b 4K -e 64K -f 4 --iters 20 --warmup 3 --demo-steps 10 \
    --out "$work/profile.json" 2>&1); then
    grep -q 'no collective kind could be fitted' <<<"$cal" \
      || { echo "$cal"; echo "ci/multihost: calibrate failed on the $label link"; exit 1; }
  fi
  if [ -n "${MULTIHOST_VERBOSE:-}" ]; then echo "$cal"; fi
  grep -E '^# (all_gather|reduce_scatter|launch|sharing|host):|^# no fit' <<<"$cal" \
    | sed "s|^# |ci/multihost: $label link calibrated: |" || true
  if ! grep -q '^# wrote ' <<<"$cal"; then
    echo "ci/multihost: $label link: no prediction from a calibrated profile (no kind could be fitted)"
    return 0
  fi
  if ! cal=$("$exe" sim --workload "$work/demo.json" --world 2 --cost "$work/profile.json" --tflops "$tflops" \
    --bucket-by size --bucket-mb 0.00390625 --steps 6 --json 2>&1); then
    grep -q 'has no fit for' <<<"$cal" || { echo "$cal"; echo "ci/multihost: sim --cost failed on the $label link"; exit 1; }
    echo "ci/multihost: $label link: no prediction from the calibrated profile: $(tail -n 1 <<<"$cal")"
    return 0
  fi
  cal=$(grep -o '"step_ms":[0-9.e+-]*' <<<"$cal" | cut -d: -f2 || true)
  shared=$(sim_step --cost "$work/profile.json" --tflops "$tflops" --shared-link)
  echo "ci/multihost: $label link, demo step simulated from the calibrated profile: $cal ms" \
    "(ratio $(ratio "$cal" "$step")); with a shared link $shared ms (ratio $(ratio "$shared" "$step"))"
  awk -v c="$cal" -v h="$shared" 'BEGIN { exit !(c > 0 && h > 0) }' \
    || { echo "ci/multihost: no step time simulated from the calibrated profile on the $label link"; exit 1; }
}
# The demo's workload simulated with the given pricing and options: its step in ms.
sim_step() {
  local out
  out=$("$exe" sim --workload "$work/demo.json" --world 2 --bucket-by size --bucket-mb 0.00390625 --steps 6 \
    --json "$@")
  grep -o '"step_ms":[0-9.e+-]*' <<<"$out" | cut -d: -f2 || true
}
ratio() { awk -v s="$1" -v m="$2" 'BEGIN { printf "%.2f", s / m }'; }
predict() {
  predict_once "$1"
}
predict plain

# The parts skipped for want of a kernel feature: the step then ends skipped, naming them.
skipped_parts=()
skip_part() { echo "ci/multihost: not run: $1"; skipped_parts+=("$1"); }

# A slower link where the kernel has a token bucket (tbf): 50 Mbit/s each way, where bandwidth
# and latency both count in the demo's step.
if ip netns exec "$ns0" tc qdisc add dev "$dev0" root tbf rate 50mbit burst 2kb latency 200ms 2>/dev/null; then
  ip netns exec "$ns1" tc qdisc add dev "$dev1" root tbf rate 50mbit burst 2kb latency 200ms
  predict "50 Mbit/s (tbf)"
  ip netns exec "$ns0" tc qdisc del dev "$dev0" root
  ip netns exec "$ns1" tc qdisc del dev "$dev1" root
else
  skip_part "the rate-limited run (this kernel has no tbf queueing discipline)"
fi

# A link with 2 ms of delay each way: `tc netem` on the veth pair where the kernel has it, else
# a second link of two TAP devices whose frames ci/delaylink.py relays 2 ms late.
delayed=1
if ip netns exec "$ns0" tc qdisc add dev "$dev0" root netem delay 2ms 2>/dev/null; then
  ip netns exec "$ns1" tc qdisc add dev "$dev1" root netem delay 2ms
  echo "ci/multihost: delayed link: netem, 2 ms each way"
elif [ ! -c /dev/net/tun ]; then
  delayed=0
  skip_part "the delayed run (no netem (sch_netem) and no /dev/net/tun)"
elif ! command -v python3 >/dev/null; then
  delayed=0
  skip_part "the delayed run (no netem and no python3)"
else
  tap0="${tag}d0" tap1="${tag}d1"
  python3 ci/delaylink.py "$tap0" "$tap1" 2 "$work/relay.ready" 1800 &
  relay=$!
  for _ in $(seq 50); do [ -e "$work/relay.ready" ] && break; sleep 0.1; done
  [ -e "$work/relay.ready" ] || { echo "ci/multihost: ci/delaylink.py did not start"; exit 1; }
  ip link set "$tap0" netns "$ns0"
  ip link set "$tap1" netns "$ns1"
  ip -n "$ns0" addr add "$dnet.1/24" dev "$tap0"
  ip -n "$ns1" addr add "$d1/24" dev "$tap1"
  ip -n "$ns0" link set "$tap0" up
  ip -n "$ns1" link set "$tap1" up
  a0="$dnet.1" a1="$d1" net="$dnet"
  echo "ci/multihost: delayed link: no netem in this kernel; TAP devices relayed by ci/delaylink.py, 2 ms each way"
fi
if [ "$delayed" = 1 ]; then
  check_demo even
  check_bench all_gather
  predict "2 ms delay"
fi
if [ "${#skipped_parts[@]}" -gt 0 ]; then
  parts=$(printf '%s; ' "${skipped_parts[@]}")
  skip "${parts%; }; the other runs passed"
fi
