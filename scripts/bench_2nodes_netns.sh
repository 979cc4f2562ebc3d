#!/usr/bin/env bash
# 2 nodes x 2 ranks on one machine, with a real slow link between the nodes: each node is a
# network namespace of its own, the two joined by a veth pair that tc's tbf limits to RATE in
# each direction. Everything that crosses the nodes (our hierarchical all-reduce, our flat ring,
# gloo) goes over that one paced link; inside a node each has its own loopback (and our shared
# memory). NCCL_DDP_HOST_THROTTLE_BPS, by contrast, paces only our links. Needs root, ip and tc.
#   bash scripts/bench_2nodes_netns.sh [--rate 800mbit] [-- bench_allreduce.py args...]
# Default bench args: a 25 MiB float32 sum (issue 44's size). Rank 0's table is printed; node
# 1's output goes to $OUT_DIR/node1.log (OUT_DIR default out/bench_2nodes_netns).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rate=800mbit
while [[ $# -gt 0 ]]; do
  case $1 in
    --rate) rate=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "bench_2nodes_netns.sh: unknown argument $1 (use --rate R, then -- and bench args)" >&2; exit 2 ;;
  esac
done
out=${OUT_DIR:-out/bench_2nodes_netns}
bench_args=("$@")
((${#bench_args[@]})) || bench_args=(--min 25M --max 25M --limit-min 0 --png "" --csv "$out/allreduce_2nodes_netns.csv")
for tool in ip tc; do
  command -v $tool >/dev/null || { echo "bench_2nodes_netns.sh: needs $tool (iproute2)" >&2; exit 2; }
done
[[ $(id -u) == 0 ]] || { echo "bench_2nodes_netns.sh: needs root (network namespaces, tc)" >&2; exit 2; }
PY=${PYTHON:-$PWD/.venv/bin/python}
RUN=$(dirname "$PY")/nccl-ddp-run
mkdir -p "$out"
ns0=ndbench0-$$ ns1=ndbench1-$$ addr0=10.77.0.1 addr1=10.77.0.2
cleanup() { ip netns del "$ns0" 2>/dev/null || true; ip netns del "$ns1" 2>/dev/null || true; }
trap cleanup EXIT
ip netns add "$ns0"
ip netns add "$ns1"
ip link add ndv0-$$ netns "$ns0" type veth peer name ndv1-$$ netns "$ns1"
for i in 0 1; do
  ns=ns$i addr=addr$i
  ip -n "${!ns}" addr add "${!addr}/24" dev ndv$i-$$
  ip -n "${!ns}" link set ndv$i-$$ up
  ip -n "${!ns}" link set lo up
  ip netns exec "${!ns}" tc qdisc add dev ndv$i-$$ root tbf rate "$rate" burst 256kb latency 100ms
done
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1 NCCL_DDP_NO_PROGRESS=1
export NCCL_DDP_SECRET=$(head -c16 /dev/urandom | od -An -tx1 | tr -d ' \n')
port=29611
echo "# 2 nodes x 2 ranks, network namespaces $ns0 ($addr0) and $ns1 ($addr1), veth paced by tbf at $rate each way"
printf '%s\n' --nodes 2 "${bench_args[@]}" >"$out/args.txt"  # (the launcher's parser takes --max for its own)
launch() {  # node rank, namespace, its veth
  GLOO_SOCKET_IFNAME=$3 ip netns exec "$2" "$RUN" --nnodes 2 --node-rank "$1" --nproc-per-node 2 \
    --master-addr $addr0 --master-port $port scripts/bench_allreduce.py "@$out/args.txt"
}
launch 1 "$ns1" ndv1-$$ >"$out/node1.log" 2>&1 &
node1=$!
rc=0
launch 0 "$ns0" ndv0-$$ || rc=$?
wait $node1 || { rc=1; echo "bench_2nodes_netns.sh: node 1 failed, see $out/node1.log" >&2; tail -20 "$out/node1.log" >&2; }
exit $rc
