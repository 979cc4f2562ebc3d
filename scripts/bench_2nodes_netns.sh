#!/usr/bin/env bash
# 2 nodes x 2 ranks on one machine, with a real slow link between the nodes: each node is a
# network namespace of its own, the two joined by a veth pair that tc's tbf limits to RATE in
# each direction. Everything that crosses the nodes (our hierarchical all-reduce, our flat ring,
# gloo) goes over that one paced link; inside a node each has its own loopback (and our shared
# memory). NCCL_DDP_HOST_THROTTLE_BPS, by contrast, paces only our links. Needs root, ip and tc.
# --rails 2: a paced veth pair per local rank instead (a network card per rank, as GPU clusters
# have one per GPU: "rails"), local rank l on 10.(77+l).0.(node+1) for our links and gloo's.
#   bash scripts/bench_2nodes_netns.sh [--rate 800mbit] [--rails 1|2] [-- bench_allreduce.py args...]
# Default bench args: a 25 MiB float32 sum (issue 44's size). Rank 0's table is printed; node
# 1's output goes to $OUT_DIR/node1.log (OUT_DIR default out/bench_2nodes_netns).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rate=800mbit
rails=1
while [[ $# -gt 0 ]]; do
  case $1 in
    --rate) rate=$2; shift 2 ;;
    --rails) rails=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "bench_2nodes_netns.sh: unknown argument $1 (use --rate R, --rails N, then -- and bench args)" >&2; exit 2 ;;
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
[[ $rails == 1 || $rails == 2 ]] || { echo "bench_2nodes_netns.sh: --rails is 1 or 2, got $rails" >&2; exit 2; }
ns0=ndbench0-$$ ns1=ndbench1-$$
cleanup() { ip netns del "$ns0" 2>/dev/null || true; ip netns del "$ns1" 2>/dev/null || true; }
trap cleanup EXIT
ip netns add "$ns0"
ip netns add "$ns1"
for ((l = 0; l < rails; l++)); do  # rail l: veth ndv<node><l>-PID, subnet 10.(77+l).0.0/24
  ip link add ndv0$l-$$ netns "$ns0" type veth peer name ndv1$l-$$ netns "$ns1"
  for i in 0 1; do
    ns=ns$i
    ip -n "${!ns}" addr add "10.$((77 + l)).0.$((i + 1))/24" dev ndv$i$l-$$
    ip -n "${!ns}" link set ndv$i$l-$$ up
    ip netns exec "${!ns}" tc qdisc add dev ndv$i$l-$$ root tbf rate "$rate" burst 256kb latency 100ms
  done
done
ip -n "$ns0" link set lo up
ip -n "$ns1" link set lo up
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1 NCCL_DDP_NO_PROGRESS=1
export NCCL_DDP_SECRET=$(head -c16 /dev/urandom | od -An -tx1 | tr -d ' \n')
port=29611
echo "# 2 nodes x 2 ranks, network namespaces $ns0 and $ns1, $rails veth pair(s) between them (rail l: 10.(77+l).0.0/24), each end paced by tbf at $rate"
printf '%s\n' --nodes 2 "${bench_args[@]}" >"$out/args.txt"  # (the launcher's parser takes --max for its own)
# each worker: its rail's address for our links (NCCL_DDP_SOCKET_ADDR) and its rail's card for gloo's
{
  echo '#!/usr/bin/env bash'
  echo "l=\$(( LOCAL_RANK % $rails ))"
  echo "export NCCL_DDP_SOCKET_ADDR=10.\$((77 + l)).0.\$((GROUP_RANK + 1)) GLOO_SOCKET_IFNAME=ndv\${GROUP_RANK}\${l}-$$"
  echo "exec \"$PY\" scripts/bench_allreduce.py \"@$out/args.txt\""
} >"$out/rank.sh"
chmod +x "$out/rank.sh"
launch() {  # node rank, namespace
  ip netns exec "$2" "$RUN" --nnodes 2 --node-rank "$1" --nproc-per-node 2 \
    --master-addr 10.77.0.1 --master-port $port --no-python "$out/rank.sh"
}
launch 1 "$ns1" >"$out/node1.log" 2>&1 &
node1=$!
rc=0
launch 0 "$ns0" || rc=$?
wait $node1 || { rc=1; echo "bench_2nodes_netns.sh: node 1 failed, see $out/node1.log" >&2; tail -20 "$out/node1.log" >&2; }
exit $rc
