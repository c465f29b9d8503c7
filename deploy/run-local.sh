#!/usr/bin/env bash
# A local Crescent cluster as plain processes: one master, two agents on
# distinct host ids and ports, one gateway. Logs are prefixed per process.
# Ctrl-C (or SIGTERM) stops every process cleanly and waits for them.
#
# Ports: master gRPC 50051 admin 9003 |
#        agent-a gRPC 50052 transfer 50054 admin 9004 |
#        agent-b gRPC 50062 transfer 50064 admin 9014 |
#        gateway PUB 5557 replay 5558 snapshot 5559 admin 9005 gRPC 50053
#        (gateway state in $DATA/gateway: a restart continues the stream)
set -euo pipefail

BIN=${BIN:-bin}
DATA=${DATA:-.run}
MEMORY=${MEMORY:-512MiB}
LOG_LEVEL=${LOG_LEVEL:-info}
STREAM_FORMAT=${STREAM_FORMAT:-mooncake}
mkdir -p "$DATA/agent-a" "$DATA/agent-b" "$DATA/gateway"

pids=()
declare -A names
start() {
  local name=$1; shift
  "$@" > >(sed -u "s/^/[$name] /") 2>&1 &
  pids+=($!)
  names[$!]=$name
}

stop() {
  trap - INT TERM
  echo "[run] stopping ${#pids[@]} processes"
  kill -TERM "${pids[@]}" 2>/dev/null || true
  wait "${pids[@]}" 2>/dev/null || true
  echo "[run] stopped"
  exit 0
}
trap stop INT TERM

start master  "$BIN/crescent-master" --grpc-addr 127.0.0.1:50051 --admin-addr 127.0.0.1:9003 --log-level "$LOG_LEVEL"
start agent-a "$BIN/crescent-agent" --master 127.0.0.1:50051 --grpc-addr 127.0.0.1:50052 --transfer-addr 127.0.0.1:50054 --admin-addr 127.0.0.1:9004 \
  --host-id host-a --memory "$MEMORY" --disk-dir "$DATA/agent-a" --disk-size 256MiB --log-level "$LOG_LEVEL"
start agent-b "$BIN/crescent-agent" --master 127.0.0.1:50051 --grpc-addr 127.0.0.1:50062 --transfer-addr 127.0.0.1:50064 --admin-addr 127.0.0.1:9014 \
  --host-id host-b --memory "$MEMORY" --disk-dir "$DATA/agent-b" --disk-size 256MiB --log-level "$LOG_LEVEL"
start gateway "$BIN/crescent-gateway" --master 127.0.0.1:50051 --pub 'tcp://*:5557' --replay 'tcp://*:5558' \
  --snapshot-endpoint 'tcp://*:5559' --state-dir "$DATA/gateway" --stream-format "$STREAM_FORMAT" \
  --admin-addr 127.0.0.1:9005 --grpc-addr 127.0.0.1:50053 --backend-id local --log-level "$LOG_LEVEL"

echo "[run] cluster up: master 127.0.0.1:50051, agents :50052 :50062 (transfer :50054 :50064), gateway tcp://127.0.0.1:5557 (snapshots :5559, $STREAM_FORMAT format) (Ctrl-C to stop)"
# A process that dies (say, an agent you killed to watch the master react)
# is reported and the rest keep running; Ctrl-C stops whatever is left.
set +e
while [ ${#names[@]} -gt 0 ]; do
  wait -n -p done_pid "${pids[@]}"
  rc=$?
  [ -n "${done_pid:-}" ] || continue
  echo "[run] ${names[$done_pid]:-process $done_pid} exited with status $rc"
  unset "names[$done_pid]"
  pids=("${!names[@]}")
done
