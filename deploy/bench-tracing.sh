#!/bin/bash
# usage: deploy/bench-tracing.sh ROUNDS OLD_BIN_DIR — the tracing cost table of BENCHMARKS.md (issue 16):
# per round, per configuration (OLD_BIN_DIR, then bin/ with tracing off, at 1 % and at 100 %) a fresh
# `make run` cluster and four crescentctl bench workloads. Needs `go build -o /tmp/otlpsink ./internal/testutil/otlptest/otlpsink`.
set -u
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
OLD=${2:?old binaries directory (make build of the revision to compare with)}
/tmp/otlpsink --addr 127.0.0.1:4317 --every 0 > /tmp/trbench-sink.log 2>&1 &
SINK=$!
run() { # name bindir ratio(""=off)
  local name=$1 bin=$2 ratio=$3
  rm -rf /tmp/trb-data
  if [ -n "$ratio" ]; then
    export CRESCENT_OTLP_ENDPOINT=127.0.0.1:4317 CRESCENT_OTLP_INSECURE=true CRESCENT_TRACE_SAMPLE_RATIO=$ratio
  else
    unset CRESCENT_OTLP_ENDPOINT CRESCENT_OTLP_INSECURE CRESCENT_TRACE_SAMPLE_RATIO
  fi
  DATA=/tmp/trb-data BIN=$bin LOG_LEVEL=warn setsid deploy/run-local.sh > /tmp/trb-cluster.log 2>&1 &
  local pid=$!
  for i in $(seq 60); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' localhost:9004/readyz)" = 200 ] && [ "$(curl -s -o /dev/null -w '%{http_code}' localhost:9014/readyz)" = 200 ] && break
    sleep 0.5
  done
  sleep 2
  unset CRESCENT_OTLP_ENDPOINT CRESCENT_OTLP_INSECURE CRESCENT_TRACE_SAMPLE_RATIO
  for w in "put 4KiB 128 8" "get 4KiB 128 8" "put 1MiB 1 4" "get 1MiB 1 4"; do
    set -- $w
    load=$(cut -d' ' -f1 /proc/loadavg)
    keys=""; [ "$2" = 1MiB ] && [ "$1" = get ] && keys="--keys 256"
    out=$($bin/crescentctl --master 127.0.0.1:50051 bench --mode $1 --size $2 --batch $3 --concurrency $4 --duration 10s $keys 2>&1 | tail -3 | tr '\n' ' ')
    echo "$name | $1 $2 | load $load | $out"
  done
  kill -INT -- -$pid 2>/dev/null; sleep 3
  pkill -TERM -f "$bin/crescent-(master|agent|gateway)"; sleep 2
  pkill -KILL -f "$bin/crescent-(master|agent|gateway)"; true
}
for r in $(seq $ROUNDS); do
  echo "== round $r"
  run old "$OLD" ""
  run off bin ""
  run 1pct bin 0.01
  run 100pct bin 1
done
kill -INT $SINK; sleep 1; cat /tmp/trbench-sink.log
