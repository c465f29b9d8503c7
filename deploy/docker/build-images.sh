#!/usr/bin/env bash
# Builds crescent/<name>:dev images from the static binaries in bin/.
set -euo pipefail
cd "$(dirname "$0")/../.."
for b in crescent-master crescent-agent crescent-gateway; do
  [ -x "bin/$b" ] || { echo "bin/$b missing: run 'make build' first" >&2; exit 1; }
  if ! out=$(docker build -q -f deploy/docker/Dockerfile --build-arg BIN="$b" -t "crescent/${b#crescent-}:dev" . 2>&1); then echo "$out" >&2; exit 1; fi
  echo "built crescent/${b#crescent-}:dev"
done
