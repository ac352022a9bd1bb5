# make test   vet, formatting, allocation counts, then every test with the race detector
# make bench  every benchmark, with allocations
# make compare   the load harness: this module and mholt/caddy-ratelimit against
#                plain Caddy under wrk (scripts/loadtest.sh); make loadtest is
#                the same
# make pair A=<variant> B=<variant>  two load-harness variants served side by side on one
#                core, each by its own wrk: B's CPU per request over A's, rounds in the same
#                seconds, so a noisy machine's swings fall on both (scripts/pair.sh)
# make busy      how busy Caddy, wrk and Redis are under one load-harness variant, and Caddy's
#                CPU, system calls and context switches per request (VARIANT; scripts/busy.sh)
# make soak      the long multi-region scenarios (default intervals, minutes of load; SOAK_MINUTES)
# make regions   the scale harness: 2–3 regions × 1, 2, 4 nodes of real Caddy with a Redis
#                each, a MariaDB primary and replica; prints admitted/limit and what it cost
#                MySQL and Redis (SCALE_REGIONS, SCALE_NODES: comma lists)
# make mixed     a rolling deploy: cmd/caddy built at OLD (a commit, default 55dbc13) beside
#                this build on one Redis and one MySQL (integration/mixed_test.go)
# make bench-engine-vs REF=<commit>  the engine's decision benchmarks against another
#                commit's, builds alternated in one sitting, medians (scripts/bench-engine-vs.sh;
#                BENCH=<regexp> and PKG=<package> pick other benchmarks)
# make property  the multi-node reference test for PROPERTY_DURATION (default 10m) of random seeds
# make sim       the simulator's tables (cmd/ratelimit-sim): accuracy and cost as regions and nodes
#                grow, sensitivity, failures, the recommended settings (SIM_SEED; about an hour, up to 12 GB)

GO       ?= go
TIMEOUT  ?= 20m

.PHONY: test vet fmt-check servers allocs bench bench-engine-vs compare loadtest pair busy soak regions mixed property sim

test: vet fmt-check servers allocs
	GO=$(GO) TIMEOUT=$(TIMEOUT) scripts/test.sh ./...

# Allocation counts are only meaningful without the race detector, so the
# tests that pin them (their names contain "Alloc") run once without it.
allocs:
	$(GO) test -count=1 -run 'Alloc' ./engine .

vet:
	$(GO) vet ./...

# gofmt -l lists the files whose formatting differs; any is a failure.
fmt-check:
	@files="$$(gofmt -l .)"; \
	if [ -n "$$files" ]; then echo "gofmt needed on:"; echo "$$files"; exit 1; fi

# The Redis and MariaDB tests start private servers; make sure they exist.
servers:
	@scripts/ensure-servers.sh

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./...

bench-engine-vs:
	GO=$(GO) REF=$(REF) scripts/bench-engine-vs.sh

# Real Caddy under wrk, this module and the peer module side by side with
# plain Caddy; ROUNDS, DURATION, SCENARIOS, PEER, RESULTS, PROFILE tune it
# (see the script's header). Writes loadtest/results/compare.{md,tsv,svg}.
compare:
	GO=$(GO) scripts/loadtest.sh

loadtest: compare

# Two variants side by side on one core (scripts/pair.sh): A, B, ROUNDS,
# DURATION tune it.
pair:
	GO=$(GO) A=$(A) B=$(B) scripts/pair.sh

# How busy Caddy, wrk and Redis are under one variant's load, and Caddy's
# CPU, system calls and context switches per request (scripts/busy.sh):
# VARIANT, KEYS, REDIS_CPU, REDIS_IDLE, NEIGHBOUR, BASE (a commit, alternated) tune it.
busy:
	GO=$(GO) scripts/busy.sh

# The long forms of the multi-region scenarios (integration/soak_test.go):
# default intervals, one-minute windows, SOAK_MINUTES (default 4) of load.
soak: servers
	PATH="$$PATH:/usr/sbin:/usr/local/sbin" $(GO) test -tags soak -count=1 -timeout 60m -run 'TestSoak_' -v ./integration

# The scale harness (integration/scale_test.go): tables of admitted/limit,
# MySQL statements and rows read per second and Redis commands per second
# for R regions × N nodes, and one region's MySQL load with no traffic.
regions: servers
	PATH="$$PATH:/usr/sbin:/usr/local/sbin" $(GO) test -tags scale -count=1 -timeout 30m -run 'TestScale_' -v ./integration

# A rolling deploy (integration/mixed_test.go): cmd/caddy built at OLD (a
# commit, in a temporary git worktree) beside this build on one Redis and
# one MySQL.
OLD ?= 55dbc13
mixed: servers
	@dir="$$(mktemp -d)"; trap 'git worktree remove --force "$$dir/src" >/dev/null 2>&1; rm -rf "$$dir"' EXIT; \
	git worktree add --detach "$$dir/src" $(OLD) >/dev/null && \
	(cd "$$dir/src" && $(GO) build -o "$$dir/caddy" ./cmd/caddy) && \
	RATELIMIT_OLD_CADDY="$$dir/caddy" PATH="$$PATH:/usr/sbin:/usr/local/sbin" $(GO) test -tags mixed -count=1 -timeout 20m -run 'TestMixedBuilds_' -v ./integration

# The multi-node reference test (internal/nodecheck) on new random seeds
# for PROPERTY_DURATION; a failure prints its seed and shortest run.
PROPERTY_DURATION ?= 10m
property:
	RATELIMIT_PROPERTY_DURATION=$(PROPERTY_DURATION) $(GO) test -count=1 -timeout 0 -run 'TestProperty_NodesAgreeWithOneCounter' -v ./internal/nodecheck

# The simulator's tables (README, "Simulator"): each is one command,
# `go run ./cmd/ratelimit-sim -table <name>`; one seed prints one output.
SIM_SEED ?= 1
SIM_TABLES ?= regions nodes sensitivity failure recommended bars
sim:
	@for t in $(SIM_TABLES); do $(GO) run ./cmd/ratelimit-sim -table $$t -seed $(SIM_SEED) || exit 1; echo; done
