#!/usr/bin/env bash
# A local Crescent cluster as plain processes: one master, two agents on
# distinct host ids and ports, one gateway. Logs are prefixed per process.
# Ctrl-C (or SIGTERM) stops every process cleanly and waits for them.
#
# Ports: master gRPC 50051 admin 9003 |
#        agent-a gRPC 50052 transfer 50054 admin 9004 |
#        agent-b gRPC 50062 transfer 50064 admin 9014 |
#        gateway PUB 5557 replay 5558 snapshot 5559 admin 9005 gRPC 50053
#        (gateway state in $DATA/gateway: a restart continues the stream;
#        the master's in $DATA/master: removals its restart must not undo)
#
# HA=1 (`make run-ha`) runs three masters instead of one, electing a
# leader on a real etcd process ($BIN/etcd, built from etcd's own module;
# data in $DATA/etcd, client 127.0.0.1:2379): masters on 50051, 50151 and
# 50251 (admin 9003, 9103, 9203); agents, gateway and crescentctl are given
# all three and follow the leader. Kill the leader to watch a standby take
# over.
#
# SHM=1 (`SHM=1 make run`) has both agents share their memory on Unix
# sockets ($DATA/agent-a/shm.sock, $DATA/agent-b/shm.sock) for same-host
# clients (crescentctl --shm-socket; issue 18): memory segments are then
# memfd-backed, which gets huge pages only where the kernel's
# transparent_hugepage/shmem_enabled allows (docs/OPERATIONS.md). Not
# with TLS=1.
#
# TLS=1 (`make run-secure`) runs the same cluster with mTLS on every gRPC
# and admin port: development certificates for every role are made once in
# $CERTS (`crescentctl certs init`; delete the directory for new ones) and
# each process is given its own. The ZMQ endpoints stay plaintext.
set -euo pipefail

BIN=${BIN:-bin}
DATA=${DATA:-.run}
MEMORY=${MEMORY:-512MiB}
LOG_LEVEL=${LOG_LEVEL:-info}
STREAM_FORMAT=${STREAM_FORMAT:-mooncake}
TLS=${TLS:-0}
HA=${HA:-0}
SHM=${SHM:-0}
CERTS=${CERTS:-$DATA/certs}
mkdir -p "$DATA/agent-a" "$DATA/agent-b" "$DATA/gateway"

# tls ROLE NAME: the TLS flags of the process holding ROLE/NAME's certificate.
tls() { :; }
scheme=http
if [ "$TLS" = 1 ]; then
  if [ ! -f "$CERTS/ca.pem" ]; then
    # Agents' certificates are named after their host ids (the master binds
    # an agent to the host id in its certificate).
    "$BIN/crescentctl" certs init "$CERTS" --agents host-a,host-b --tenants default,demo >/dev/null
    echo "[run] development certificates written to $CERTS"
  fi
  tls() { echo "--tls-ca $CERTS/ca.pem --tls-cert $CERTS/$1-$2.pem --tls-key $CERTS/$1-$2-key.pem"; }
  scheme=https
fi

pids=()
declare -A names ports
# start NAME CMD...: runs CMD, its output prefixed with [NAME]. ports[NAME]
# are the TCP ports it listens on (preflight, await_listening).
start() {
  local name=$1; shift
  "$@" > >(sed -u "s/^/[$name] /") 2>&1 &
  pids+=($!)
  names[$!]=$name
}

# held PORT: the states of the TCP sockets whose local end is PORT, one
# per line (0A: listening, 06: TIME_WAIT). From /proc, so it needs no ss
# or lsof.
held() {
  local f files=()
  for f in /proc/net/tcp /proc/net/tcp6; do [ -r "$f" ] && files+=("$f"); done
  awk -v p="$(printf '%04X' "$1")" 'FNR > 1 { n = split($2, a, ":"); if (a[n] == p) print $4 }' "${files[@]}"
}

# preflight NAME...: refuses to start when a port the cluster needs is
# taken by a listener (another cluster, or another program). Any other
# socket there is the local end of a recent outgoing connection: Linux
# picks those ports from net.ipv4.ip_local_port_range (32768-60999 by
# default), which holds 50051-50264, and a connection that ended keeps its
# port in TIME_WAIT for 60 s, during which a listener cannot bind it (Go's
# SO_REUSEADDR does not help: the connection's socket did not set it).
# After a test run that is likely for one of a dozen ports, so wait it
# out; `sysctl net.ipv4.ip_local_reserved_ports` prevents it for good
# (docs/OPERATIONS.md, "Ports and endpoints").
preflight() {
  local name port states deadline
  [ -r /proc/net/tcp ] || return 0
  for name in "$@"; do
    for port in ${ports[$name]}; do
      deadline=
      while states=$(held "$port") && [ -n "$states" ]; do
        if grep -q '^0A$' <<<"$states"; then
          echo "[run] port $port ($name) is already taken by a listening socket: is another cluster running? Stop it first (Ctrl-C where it runs)." >&2
          exit 1
        fi
        if [ -z "$deadline" ]; then
          deadline=$((SECONDS + 65))
          echo "[run] port $port ($name) is held by a recent outgoing connection (Linux's ephemeral ports include this cluster's); waiting for the kernel to release it, at most 60 s (docs/OPERATIONS.md, \"Ports and endpoints\")"
        elif [ "$SECONDS" -ge "$deadline" ]; then
          echo "[run] port $port ($name) is still held by a connection after 65 s: something keeps opening connections from it (a test run?); not starting." >&2
          exit 1
        fi
        sleep 0.2
      done
    done
  done
}

# await_listening: waits until every process listens on its ports. A
# process that exits first (a port taken after all, a bad flag) stops the
# whole cluster: a cluster missing a part is not what `make run` promises.
await_listening() {
  local pid name port i rc
  [ -r /proc/net/tcp ] || return 0
  for pid in "${pids[@]}"; do
    name=${names[$pid]}
    for port in ${ports[$name]}; do
      for ((i = 0; i < 600; i++)); do
        grep -q '^0A$' <<<"$(held "$port")" && break
        if ! kill -0 "$pid" 2>/dev/null; then
          rc=0
          wait "$pid" || rc=$?
          echo "[run] $name exited while starting (status $rc); its log is above. Stopping the cluster." >&2
          kill -TERM "${pids[@]}" 2>/dev/null || true
          wait "${pids[@]}" 2>/dev/null || true
          exit 1
        fi
        sleep 0.1
      done
      grep -q '^0A$' <<<"$(held "$port")" || echo "[run] $name does not listen on port $port after 60s; going on" >&2
    done
  done
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

ports=([agent-a]="50052 50054 9004" [agent-b]="50062 50064 9014" [gateway]="50053 9005 5557 5558 5559")
if [ "$HA" = 1 ]; then
  ports+=([etcd]="2379 2380" [master-0]="50051 9003" [master-1]="50151 9103" [master-2]="50251 9203")
else
  ports+=([master]="50051 9003")
fi
preflight "${!ports[@]}"

# $(tls ...) is split into words on purpose (no paths with blanks in $CERTS).
MASTERS=127.0.0.1:50051
if [ "$HA" = 1 ]; then
  mkdir -p "$DATA/etcd"
  start etcd "$BIN/etcd" --name crescent-etcd --data-dir "$DATA/etcd" \
    --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster crescent-etcd=http://127.0.0.1:2380 --log-level warn
  MASTERS=127.0.0.1:50051,127.0.0.1:50151,127.0.0.1:50251
  for i in 0 1 2; do
    # shellcheck disable=SC2046
    start "master-$i" "$BIN/crescent-master" --grpc-addr "127.0.0.1:50${i}51" --admin-addr "127.0.0.1:9${i}03" \
      --master-id "master-$i" --etcd-endpoints 127.0.0.1:2379 --advertise-addr "127.0.0.1:50${i}51" \
      --log-level "$LOG_LEVEL" $(tls master master-1)
  done
else
  # shellcheck disable=SC2046
  start master  "$BIN/crescent-master" --grpc-addr 127.0.0.1:50051 --admin-addr 127.0.0.1:9003 --log-level "$LOG_LEVEL" \
    --state-dir "$DATA/master" $(tls master master-1)
fi
# shm NAME: agent NAME's same-host shared-memory socket flags, with SHM=1
# on a plaintext cluster only (a shared-memory peer maps every tenant's
# bytes, which a cluster with tenant certificates must not allow;
# docs/OPERATIONS.md).
shm() { :; }
if [ "$SHM" = 1 ] && [ "$TLS" != 1 ]; then
  shm() { echo "--shm-socket $DATA/$1/shm.sock"; }
fi
# shellcheck disable=SC2046
start agent-a "$BIN/crescent-agent" --master "$MASTERS" --grpc-addr 127.0.0.1:50052 --transfer-addr 127.0.0.1:50054 --admin-addr 127.0.0.1:9004 \
  --host-id host-a --memory "$MEMORY" --disk-dir "$DATA/agent-a" --disk-size 256MiB --log-level "$LOG_LEVEL" $(tls agent host-a) $(shm agent-a)
# shellcheck disable=SC2046
start agent-b "$BIN/crescent-agent" --master "$MASTERS" --grpc-addr 127.0.0.1:50062 --transfer-addr 127.0.0.1:50064 --admin-addr 127.0.0.1:9014 \
  --host-id host-b --memory "$MEMORY" --disk-dir "$DATA/agent-b" --disk-size 256MiB --log-level "$LOG_LEVEL" $(tls agent host-b) $(shm agent-b)
# shellcheck disable=SC2046
start gateway "$BIN/crescent-gateway" --master "$MASTERS" --pub 'tcp://*:5557' --replay 'tcp://*:5558' \
  --snapshot-endpoint 'tcp://*:5559' --state-dir "$DATA/gateway" --stream-format "$STREAM_FORMAT" \
  --admin-addr 127.0.0.1:9005 --grpc-addr 127.0.0.1:50053 --backend-id local --log-level "$LOG_LEVEL" $(tls gateway gateway-1)

await_listening
echo "[run] cluster up: master $MASTERS, agents :50052 :50062 (transfer :50054 :50064), gateway tcp://127.0.0.1:5557 (snapshots :5559, $STREAM_FORMAT format), admin $scheme://127.0.0.1:9003 (Ctrl-C to stop)"
if [ "$SHM" = 1 ] && [ "$TLS" != 1 ]; then
  echo "[run] same-host shared memory: crescentctl --shm-socket $DATA/agent-a/shm.sock,$DATA/agent-b/shm.sock (or CRESCENT_SHM_SOCKETS)"
fi
if [ "$HA" = 1 ]; then
  echo "[run] HA on (etcd 127.0.0.1:2379): the leader answers, the others say NOT_LEADER; try:"
  echo "[run]   $BIN/crescentctl --master $MASTERS put k v    # follows the leader"
  echo "[run]   curl -s -o /dev/null -w '%{http_code}\\n' http://127.0.0.1:9103/readyz   # 200 on the leader only"
fi
if [ "$TLS" = 1 ]; then
  echo "[run] mTLS on; try:"
  echo "[run]   grpcurl -cacert $CERTS/ca.pem -cert $CERTS/admin-admin.pem -key $CERTS/admin-admin-key.pem 127.0.0.1:50051 crescent.master.v1.AdminService/ListSegments"
  echo "[run]   $BIN/crescentctl --tls-ca $CERTS/ca.pem --tls-cert $CERTS/tenant-demo.pem --tls-key $CERTS/tenant-demo-key.pem --tenant demo ls"
  echo "[run]   curl --cacert $CERTS/ca.pem --cert $CERTS/admin-admin.pem --key $CERTS/admin-admin-key.pem https://127.0.0.1:9003/metrics"
fi
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
