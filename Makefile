# make test   vet, formatting, allocation counts, then every test with the race detector
# make bench  every benchmark, with allocations
# make loadtest  end-to-end throughput against plain Caddy (scripts/loadtest.sh)
# make soak  the long multi-region scenarios (default intervals, minutes of load; SOAK_MINUTES)

GO       ?= go
TIMEOUT  ?= 20m

.PHONY: test vet fmt-check servers allocs bench loadtest soak

test: vet fmt-check servers allocs
	PATH="$$PATH:/usr/sbin:/usr/local/sbin" $(GO) test -race -count=1 -timeout $(TIMEOUT) ./...

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

# Real Caddy under wrk: plain, allow, deny, 100k keys, Redis; ROUNDS, DURATION,
# OUT, PROFILE tune it (see the script's header).
loadtest:
	GO=$(GO) scripts/loadtest.sh

# The long forms of the multi-region scenarios (integration/soak_test.go):
# default intervals, one-minute windows, SOAK_MINUTES (default 4) of load.
soak: servers
	PATH="$$PATH:/usr/sbin:/usr/local/sbin" $(GO) test -tags soak -count=1 -timeout 60m -run 'TestSoak_' -v ./integration
