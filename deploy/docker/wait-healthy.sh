#!/usr/bin/env bash
# Waits until every process of the compose cluster answers /readyz, probing
# with the binaries' own healthcheck subcommand (no curl needed). Works with
# both `docker compose` and the older `docker-compose`, which has no --wait.
set -euo pipefail
cd "$(dirname "$0")/../.."
deadline=$((SECONDS + ${WAIT_SECONDS:-60}))
for probe in "crescent-master http://127.0.0.1:9003/readyz" "crescent-agent http://127.0.0.1:9004/readyz" \
             "crescent-agent http://127.0.0.1:9014/readyz" "crescent-gateway http://127.0.0.1:9005/readyz"; do
  set -- $probe
  until "bin/$1" healthcheck "$2" 2>/dev/null; do
    if [ $SECONDS -ge $deadline ]; then
      echo "not ready after ${WAIT_SECONDS:-60}s: $2" >&2
      exit 1
    fi
    sleep 0.5
  done
  echo "ready: $2"
done
