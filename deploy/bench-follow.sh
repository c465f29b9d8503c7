#!/bin/bash
# usage: deploy/bench-follow.sh ROUNDS — what warm standbys cost the write path (issue 15, BENCHMARKS.md):
# per round, a fresh `make run-ha` cluster (three masters on etcd, two agents, the gateway) with the
# agents following the two standbys (--follow-standbys, the default) and one without (every
# registration after a failover then sends the whole table), and the same crescentctl bench
# workloads against each. Needs `make build bin/etcd`. BINS="bin /tmp/old/bin" compares builds: every
# round runs follow and cold for each directory in turn (each needs etcd too). WORKLOADS and MODES
# narrow a run (see below). Each line ends with the CPU µs per object of the leader, the standbys and
# the agents, which the machine's other load changes far less than objects/s.
set -u
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
BINS=${BINS:-bin}
WORKLOADS=${WORKLOADS:-put 4KiB 128 8;put 64B 1024 4;put 1MiB 1 4;get 4KiB 128 8} # mode size batch concurrency;...
MODES=${MODES:-follow cold}
# cpus: the CPU seconds used so far by the leader, the standbys (both) and
# the agents (both), from their process_cpu_seconds_total.
cpus() {
  local l=0 s=0 a=0 p m v
  for p in 9003 9103 9203; do
    m=$(curl -s localhost:$p/metrics)
    v=$(echo "$m" | awk '/^process_cpu_seconds_total /{print $2}')
    if echo "$m" | grep -q '^crescent_master_leader 1'; then l=$(awk "BEGIN{print $l+${v:-0}}"); else s=$(awk "BEGIN{print $s+${v:-0}}"); fi
  done
  for p in 9004 9014; do
    v=$(curl -s localhost:$p/metrics | awk '/^process_cpu_seconds_total /{print $2}')
    a=$(awk "BEGIN{print $a+${v:-0}}")
  done
  echo "$l $s $a"
}
run() { # name follow(true|false) bin
  local name=$1 bin=$3
  rm -rf /tmp/bf-data
  CRESCENT_FOLLOW_STANDBYS=$2 HA=1 DATA=/tmp/bf-data BIN=$bin LOG_LEVEL=warn setsid deploy/run-local.sh > /tmp/bf-cluster.log 2>&1 &
  local pid=$!
  for i in $(seq 60); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' localhost:9004/readyz)" = 200 ] && [ "$(curl -s -o /dev/null -w '%{http_code}' localhost:9014/readyz)" = 200 ] && break
    sleep 0.5
  done
  sleep 3 # the leader elected, the follow streams up
  local w
  IFS=';' read -ra ws <<< "$WORKLOADS"
  for w in "${ws[@]}"; do
    set -- $w
    load=$(cut -d' ' -f1 /proc/loadavg)
    c0=$(cpus)
    out=$($bin/crescentctl --master 127.0.0.1:50051,127.0.0.1:50151,127.0.0.1:50251 bench --mode $1 --size $2 --batch $3 --concurrency $4 --duration 10s 2>&1 | tail -3 | tr '\n' ' ')
    c1=$(cpus)
    # CPU µs per object of the leader, the standbys and the agents: what
    # the machine's other load does not change much, unlike objects/s.
    per=$(echo "$c0 $c1 $(echo "$out" | grep -o 'objects: [0-9]*' | cut -d' ' -f2)" |
      awk '{n=$7>0?$7:1; printf "cpu us/obj leader %.1f standbys %.1f agents %.1f", ($4-$1)*1e6/n, ($5-$2)*1e6/n, ($6-$3)*1e6/n}')
    echo "$name | $1 $2 batch $3 x$4 | load $load | $out | $per"
  done
  # run-local.sh stops its processes on SIGINT; only this cluster's process group is signalled
  kill -INT -- -$pid 2>/dev/null
  for i in $(seq 20); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- -$pid 2>/dev/null; wait $pid 2>/dev/null; true
}
for r in $(seq "$ROUNDS"); do
  echo "== round $r"
  for b in $BINS; do
    for mode in $MODES; do
      run "$mode $b" "$([ "$mode" = follow ] && echo true || echo false)" "$b"
    done
  done
done
