# Crescent — the two commands a newcomer needs are `make run` and `make test`.
# Every tool runs through `go tool` (pinned in tools/go.mod): nothing but Go is
# needed on the machine (Docker only for `make up`).

SHELL        := /usr/bin/env bash
GO           ?= go
# One module for the product (the repository root); tools/ is the second
# module of the workspace, for pinned `go tool` dependencies only.
PKGS         := ./...
UNIT_PKGS     = $(shell $(GO) list ./... | grep -v /e2e)
BINARIES     := crescent-master crescent-agent crescent-gateway crescentctl
BIN          := bin
GOFLAGS_BUILD := -trimpath -ldflags "-s -w"
TEST_TIMEOUT ?= 20m
TESTFLAGS    ?=
COMPOSE      := $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)

.PHONY: all gen check-gen lint build test test-unit test-e2e test-python run run-secure run-ha up up-ha down bench bench-gateway-state bench-restart bench-drain bench-offload bench-diskget bench-large bench-failover soak fuzz clean tidy check-observability

all: build

## gen: regenerate gen/ from proto/ (buf + protoc-gen-go + protoc-gen-go-grpc via go tool), then the Python client's stubs in clients/python/crescent/_gen (Debian's protoc and grpc_python_plugin: skipped with a warning where they are missing)
PY_GEN := clients/python/crescent/_gen
PROTOC ?= protoc
GRPC_PYTHON_PLUGIN ?= grpc_python_plugin
gen:
	@# Build buf before deleting anything: on a cold cache the build takes
	@# minutes, and gen/ must not stay empty (every package fails) meanwhile.
	$(GO) tool buf --version >/dev/null
	find gen -name '*.pb.go' -delete
	$(GO) tool buf generate
	@# Exit 3: the Python generators are missing (the script says what to
	@# install); a machine with only Go still regenerates the Go code.
	@PROTOC=$(PROTOC) GRPC_PYTHON_PLUGIN=$$(command -v $(GRPC_PYTHON_PLUGIN) || true) ./clients/python/gen.sh || { rc=$$?; [ $$rc = 3 ] || exit $$rc; }

## check-gen: fail when the committed gen/ (or the Python stubs) differ from what `make gen` produces; without protoc and grpc_python_plugin the Python stubs go unchecked, except under CI=true, where that fails
check-gen: gen
	@if [ -n "$$(git status --porcelain -- gen $(PY_GEN))" ]; then \
		echo "gen/ or $(PY_GEN) is stale: run 'make gen' and commit the result"; git status --porcelain -- gen $(PY_GEN); exit 1; \
	fi
	@if ! command -v $(PROTOC) >/dev/null || ! command -v $(GRPC_PYTHON_PLUGIN) >/dev/null; then \
		if [ "$${CI:-}" = true ]; then echo "check-gen: protoc and grpc_python_plugin are required under CI=true (apt-get install protobuf-compiler protobuf-compiler-grpc)"; exit 1; fi; \
		echo "gen/ is up to date ($(PY_GEN) NOT checked: protoc or grpc_python_plugin missing)"; \
	else \
		echo "gen/ and $(PY_GEN) are up to date"; \
	fi

## lint: gofmt, buf lint, go vet, staticcheck, and promtool on deploy/observability
lint:
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$unformatted" ]; then echo "not gofmt'd (run gofmt -w):"; echo "$$unformatted"; exit 1; fi
	$(GO) tool buf lint
	$(GO) vet $(PKGS)
	$(GO) tool staticcheck $(PKGS)
	@$(MAKE) --no-print-directory check-observability

## check-observability: promtool (pinned in tools/go.mod) checks deploy/observability: the scrape configs, the alert rules and their unit tests. The package's Go test (the dashboard decoded strictly, every query parsed, every metric named checked against a live cluster's /metrics) runs in `make test`.
# remove_all_sd leaves out the cloud service discoveries (AWS, Azure, GCE...)
# that nothing here uses: half promtool's build (kubernetes_sd stays).
# `go tool -n` builds it (or finds it in the build cache) and names the
# binary, so the four checks pay for one up-to-date check, not four.
OBS := deploy/observability
check-observability:
	@promtool=$$(GOFLAGS="$(GOFLAGS) -tags=remove_all_sd" $(GO) tool -n promtool) && set -x && \
	$$promtool check rules $(OBS)/alerts.yml && \
	$$promtool test rules $(OBS)/alerts_test.yml && \
	$$promtool check config $(OBS)/prometheus.yml $(OBS)/prometheus-ha.yml $(OBS)/prometheus-k8s.yml && \
	: the secure configs name certificate and token files that exist only beside a secure cluster && \
	$$promtool check config --syntax-only $(OBS)/prometheus-secure.yml $(OBS)/prometheus-token.yml

## build: static (CGO_ENABLED=0) binaries in bin/
build:
	@mkdir -p $(BIN)
	CGO_ENABLED=0 $(GO) build $(GOFLAGS_BUILD) -o $(BIN)/ \
		./services/master/cmd/crescent-master \
		./services/agent/cmd/crescent-agent \
		./services/gateway/cmd/crescent-gateway \
		./cli/cmd/crescentctl

## test: every module's tests with -race, then the end-to-end suite (real binaries), then the Python client's suite
test: test-unit test-e2e test-python

test-unit:
	$(GO) test -race -timeout $(TEST_TIMEOUT) $(TESTFLAGS) $(UNIT_PKGS)

## test-e2e: the end-to-end suite twice, plaintext and then with mTLS on every link (CRESCENT_E2E_TLS=1, issue 14)
test-e2e: build
	@echo "== e2e run 1 of 2: plaintext"
	CRESCENT_BIN=$(CURDIR)/$(BIN) $(GO) test -race -timeout $(TEST_TIMEOUT) $(TESTFLAGS) ./e2e/...
	@echo "== e2e run 2 of 2: mTLS (CRESCENT_E2E_TLS=1)"
	CRESCENT_E2E_TLS=1 CRESCENT_BIN=$(CURDIR)/$(BIN) $(GO) test -race -timeout $(TEST_TIMEOUT) $(TESTFLAGS) ./e2e/...

## test-python: the Python client's pytest suite (clients/python/tests) against a real local cluster of the binaries in bin/. Needs Debian's python3-grpcio, python3-protobuf, python3-pytest, python3-numpy, python3-zmq, python3-msgpack and libxxhash0: without them it says so and succeeds, except under CI=true, where it fails
PYTHON ?= /usr/bin/python3
test-python: build
	@if ! $(PYTHON) -c 'import grpc, google.protobuf, pytest, numpy, zmq, msgpack, ctypes; ctypes.CDLL("libxxhash.so.0")' 2>/dev/null; then \
		if [ "$${CI:-}" = true ]; then echo "test-python: $(PYTHON) lacks grpc, protobuf, pytest, numpy, zmq, msgpack or libxxhash, required under CI=true (apt-get install python3-grpcio python3-protobuf python3-pytest python3-numpy python3-zmq python3-msgpack libxxhash0)"; exit 1; fi; \
		echo "test-python: SKIPPED: $(PYTHON) lacks grpc, protobuf, pytest, numpy, zmq, msgpack or libxxhash (apt-get install python3-grpcio python3-protobuf python3-pytest python3-numpy python3-zmq python3-msgpack libxxhash0)"; exit 0; \
	fi; \
	CRESCENT_BIN=$(CURDIR)/$(BIN) $(PYTHON) -m pytest -q -p no:cacheprovider clients/python/tests

## run: a local cluster (master, two agents, gateway) as plain processes; Ctrl-C stops it (SHM=1: the agents also share their memory on Unix sockets for same-host clients)
run: build
	BIN=$(BIN) ./deploy/run-local.sh

## run-secure: the same cluster with mTLS on every gRPC and admin port (development certificates in .run/certs, made once)
run-secure: build
	BIN=$(BIN) TLS=1 ./deploy/run-local.sh

## run-ha: the cluster with three masters electing a leader on a real etcd process (bin/etcd, built from etcd's own module); kill the leader to watch a standby take over (issue 15)
run-ha: build $(BIN)/etcd
	BIN=$(BIN) HA=1 ./deploy/run-local.sh

## bin/etcd: etcd's own server binary, from the module version go.mod pins
$(BIN)/etcd: go.mod
	@mkdir -p $(BIN)
	CGO_ENABLED=0 $(GO) build -o $(BIN)/etcd go.etcd.io/etcd/server/v3

## up / down: the same cluster under Docker Compose, images built FROM scratch
up: build
	./deploy/docker/build-images.sh
	$(COMPOSE) up -d
	./deploy/docker/wait-healthy.sh
	$(COMPOSE) ps

## up-ha: the three-master cluster of `make run-ha` under Docker Compose (profile ha, its own ports; issue 15)
up-ha: build $(BIN)/etcd
	./deploy/docker/build-images.sh
	$(COMPOSE) --profile ha up -d etcd master-ha-0 master-ha-1 master-ha-2 agent-a-ha agent-b-ha gateway-ha
	$(COMPOSE) --profile ha ps

down:
	$(COMPOSE) --profile secure --profile ha down -v

## bench: the benchmarks recorded in BENCHMARKS.md
bench:
	$(GO) test -run '^$$' -bench . -benchmem -count 1 -timeout 60m $(UNIT_PKGS)

## bench-gateway-state: the gateway's snapshot and restart benchmarks with 1M objects (issue 13, BENCHMARKS.md), 3 runs, about 4 min
bench-gateway-state:
	$(GO) test -run '^$$' -bench GatewayState -benchtime 1x -count 3 -timeout 30m $(TESTFLAGS) ./internal/gateway/gateway/

## bench-restart: fill two agents with RESTART_OBJECTS (default 4M) 64 B objects, restart the master, report the time until every object is readable again (issue 15, BENCHMARKS.md)
RESTART_OBJECTS ?= 4000000
bench-restart:
	$(GO) test -run '^$$' -bench MasterRestart -benchtime 1x -count 3 -timeout 30m $(TESTFLAGS) ./internal/testcluster/ -args -restart-objects $(RESTART_OBJECTS)

## bench-drain: drain of one agent's 100k objects of 4 KiB into another against the same cluster's BatchPut objects/s, and agent-to-agent copy of 1 MiB objects (a drain, and the agent's copy alone) against raw loopback TCP (issue 17, BENCHMARKS.md), 3 runs each
DRAIN_OBJECTS ?= 100000
bench-drain:
	$(GO) test -run '^$$' -bench 'Drain|AgentCopy' -benchtime 1x -count 3 -timeout 30m $(TESTFLAGS) ./internal/testcluster/ -args -drain-objects $(DRAIN_OBJECTS)
	$(GO) test -run '^$$' -bench 'BenchmarkCopy' -benchtime 2s -count 3 $(TESTFLAGS) ./internal/agent/link/

## bench-large: single Puts and GetIntos of 1 MiB objects through the SDK from 4 goroutines against raw loopback TCP (one stream as iperf3 runs it, one and 4 streams answered per object), paired in the same run (issue 18 item 2, BENCHMARKS.md), 5 runs
bench-large:
	$(GO) test -run '^$$' -bench 'LargeObjects' -benchtime 4x -count 5 -timeout 30m $(TESTFLAGS) ./internal/testcluster/

## bench-diskget: a get of a disk-tier object with the page cache warm and cold (FADV_DONTNEED) against a get from memory, 1 MiB and 4 KiB objects (issue 17, BENCHMARKS.md), 3 runs each
bench-diskget:
	$(GO) test -run '^$$' -bench DiskGet -benchtime 1x -count 3 -timeout 30m $(TESTFLAGS) ./internal/testcluster/
	$(GO) test -run '^$$' -bench DiskGet -benchtime 1x -count 3 -timeout 30m $(TESTFLAGS) ./internal/testcluster/ -args -diskget-size 4096 -diskget-objects 2048

## bench-offload: offload on eviction (one agent's memory segment past the high watermark, moved to its disk segment) of 1 MiB and of 4 KiB objects against a plain sequential write of the same bytes to the same filesystem (issue 17 item 3, BENCHMARKS.md), 3 runs each
bench-offload:
	$(GO) test -run '^$$' -bench Offload -benchtime 1x -count 3 -timeout 30m $(TESTFLAGS) ./internal/testcluster/
	$(GO) test -run '^$$' -bench Offload -benchtime 1x -count 3 -timeout 30m $(TESTFLAGS) ./internal/testcluster/ -args -offload-size 4096 -offload-mem 64

## bench-failover: three masters on etcd, FAILOVER_OBJECTS (default 1M) objects, FAILOVERS (default 20) kills of the leader under load, with a strict subscriber compared after each (issue 15, BENCHMARKS.md)
FAILOVERS ?= 20
FAILOVER_OBJECTS ?= 1000000
bench-failover: build $(BIN)/etcd
	CRESCENT_BIN=$(CURDIR)/bin CRESCENT_E2E_ETCD=$(CURDIR)/$(BIN)/etcd CRESCENT_E2E_FAILOVERS=$(FAILOVERS) CRESCENT_E2E_FAILOVER_OBJECTS=$(FAILOVER_OBJECTS) CRESCENT_E2E_AGENT_MEMORY=256MiB \
		$(GO) test -count 1 -run '^TestMasterFailover$$' -timeout 60m -v ./e2e/

## soak: three masters on etcd, three agents, a gateway and a strict subscriber under a random workload and random faults (leader, agent and gateway kills, frozen agents, flipped disk bytes) for SOAK (default 10m), checking bytes, staleness, events and leaks (e2e TestSoak; SOAK_SEED repeats a run)
SOAK ?= 10m
SOAK_SEED ?=
soak: build $(BIN)/etcd
	CRESCENT_BIN=$(CURDIR)/$(BIN) CRESCENT_E2E_ETCD=$(CURDIR)/$(BIN)/etcd CRESCENT_SOAK=$(SOAK) CRESCENT_SOAK_SEED=$(SOAK_SEED) \
		$(GO) test -race -count 1 -run '^TestSoak$$' -timeout 3h -v ./e2e/

## fuzz: run every fuzz target briefly (FUZZTIME=30s for longer)
FUZZTIME ?= 10s
# Go minimizes each new interesting input for up to 60 s by default, and
# its execs/s reads 0 meanwhile: with FUZZTIME=10s most targets spent their
# time minimizing (41 new inputs in 15 s with 1 s, 1 without, FuzzUnmarshal).
FUZZMINIMIZE ?= 1s
fuzz:
	@for pkg in $$($(GO) list $(PKGS)); do \
		for f in $$($(GO) test -list '^Fuzz' $$pkg 2>/dev/null | grep '^Fuzz'); do \
			echo "== $$pkg $$f"; $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZE) $$pkg || exit 1; \
		done; \
	done

tidy:
	$(GO) mod tidy
	cd tools && $(GO) mod tidy

clean:
	rm -rf $(BIN) .run
