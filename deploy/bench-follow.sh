#!/bin/bash
# usage: deploy/bench-follow.sh ROUNDS — what warm standbys cost the write path (issue 15, BENCHMARKS.md):
# per round, a fresh `make run-ha` cluster (three masters on etcd, two agents, the gateway) with the
# agents following the two standbys (--follow-standbys, the default) and one without (every
# registration after a failover then sends the whole table), and the same crescentctl bench
# workloads against each. Needs `make build bin/etcd`. BINS="bin /tmp/old/bin" compares builds: every
# round runs follow and cold for each directory in turn (each needs etcd too).
set -u
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
BINS=${BINS:-bin}
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
  for w in "put 4KiB 128 8" "put 64B 1024 4" "put 1MiB 1 4" "get 4KiB 128 8"; do
    set -- $w
    load=$(cut -d' ' -f1 /proc/loadavg)
    out=$($bin/crescentctl --master 127.0.0.1:50051,127.0.0.1:50151,127.0.0.1:50251 bench --mode $1 --size $2 --batch $3 --concurrency $4 --duration 10s 2>&1 | tail -3 | tr '\n' ' ')
    echo "$name | $1 $2 batch $3 x$4 | load $load | $out"
  done
  # run-local.sh stops its processes on SIGINT; only this cluster's process group is signalled
  kill -INT -- -$pid 2>/dev/null
  for i in $(seq 20); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- -$pid 2>/dev/null; wait $pid 2>/dev/null; true
}
for r in $(seq "$ROUNDS"); do
  echo "== round $r"
  for b in $BINS; do
    run "follow $b" true "$b"
    run "cold $b" false "$b"
  done
done
