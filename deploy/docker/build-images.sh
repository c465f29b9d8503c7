#!/usr/bin/env bash
# Builds crescent/<name>:dev images from the static binaries in bin/ (crescentctl as crescent/ctl).
set -euo pipefail
cd "$(dirname "$0")/../.."
# crescent/ctl:dev runs `certs init` for the compose profile `secure`.
for b in crescent-master crescent-agent crescent-gateway crescentctl; do
  [ -x "bin/$b" ] || { echo "bin/$b missing: run 'make build' first" >&2; exit 1; }
  name=${b#crescent-}; [ "$b" = crescentctl ] && name=ctl
  if ! out=$(docker build -q -f deploy/docker/Dockerfile --build-arg BIN="$b" -t "crescent/$name:dev" . 2>&1); then echo "$out" >&2; exit 1; fi
  echo "built crescent/$name:dev"
done
# crescent/etcd:dev (etcd's own server, `make bin/etcd`) for the compose profile `ha`.
if [ -x bin/etcd ]; then
  if ! out=$(docker build -q -f deploy/docker/Dockerfile --build-arg BIN=etcd -t crescent/etcd:dev . 2>&1); then echo "$out" >&2; exit 1; fi
  echo "built crescent/etcd:dev"
fi
