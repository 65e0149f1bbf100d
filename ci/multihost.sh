#!/usr/bin/env bash
# Two "hosts" on one machine: two network namespaces joined by a veth pair, each with its own
# address and host name, and an Open MPI job across them over TCP (mpirun's rsh agent enters
# the other namespace with `ip netns exec`). Runs the demo (parity with the unsharded reference)
# and checked benches over the link with the mpi backend, then again with `tc netem` delaying
# the link (where the kernel has netem). Needs root, iproute2 and namespaces: otherwise it says
# why and skips. MULTIHOST_VERBOSE=1 prints the bench tables.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh

skip() { echo "ci/multihost: skipped: $1"; exit 0; }
[ "$(id -u)" = 0 ] || skip "not root (network namespaces need it)"
command -v ip >/dev/null || skip "no ip command (apt install iproute2)"
command -v tc >/dev/null || skip "no tc command (apt install iproute2)"
command -v unshare >/dev/null || skip "no unshare command (util-linux)"
command -v mpirun >/dev/null || skip "no mpirun (apt install openmpi-bin)"

tag="cs$$"
ns0="$tag-h0" ns1="$tag-h1" dev0="${tag}a" dev1="${tag}b"
net=10.77.$(( $$ % 200 + 20 ))
a0="$net.1" a1="$net.2"
work=$(mktemp -d)
cleanup() {
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
  $a1) exec ip netns exec $ns1 unshare --uts sh -c 'hostname $ns1; exec sh -c "\$0"' "\$*" ;;
  *) exec sh -c "\$*" ;;
esac
AGENT
chmod +x "$work/agent"

# The binary as the test step built it (every feature, so nothing to build after that step).
cargo build -q --all-features --bin collsched
exe=$(realpath "${CARGO_TARGET_DIR:-target}/debug/collsched")

run_across() {
  ip netns exec "$ns0" timeout 300 mpirun --allow-run-as-root --host "$a0:1,$a1:1" -np 2 \
    --mca plm_rsh_agent "$work/agent" --mca btl tcp,self \
    --mca btl_tcp_if_include "$net.0/24" --mca oob_tcp_if_include "$net.0/24" \
    -x COLLSCHED_TIMEOUT_SECS "$@"
}
across() { run_across "$exe" "$@"; }
export COLLSCHED_TIMEOUT_SECS=120

check_demo() {
  local out
  out=$(across demo --backend mpi --steps 3 --strategy "$1")
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
check_bench all_gather
check_bench reduce_scatter

# The same with 2 ms of delay each way on the link, where the kernel has netem.
if ! ip netns exec "$ns0" tc qdisc add dev "$dev0" root netem delay 2ms 2>/dev/null; then
  echo "ci/multihost: no delayed run: this kernel has no netem queueing discipline (sch_netem)"
  exit 0
fi
ip netns exec "$ns1" tc qdisc add dev "$dev1" root netem delay 2ms
echo "ci/multihost: netem: 2 ms each way"
check_demo even
check_bench all_gather
