package sim

import (
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
)

// TestRun_AfterARedisOutageANodeWaitsForItsBreakersProbe: a node whose
// flushes failed through its region's Redis outage (10–18 s, a request
// every 50 ms) has tripped its replay breaker, and writes nothing to Redis
// back up until the breaker's timeout (5 s from its last failed probe)
// lets a probe through, as a real node does (origin/breaker.go); then it
// flushes again. Before the simulator modelled the origin's breakers its
// node flushed again at once: 10 flushes between 18 and 19 s. A Redis
// stopped for two windows of 4 s and started again
// (integration's TestSimulator_RedisDownUnderSkewedTrafficAgrees) showed
// it: the window of the restart admitted 1.667 × the limit with real
// nodes, deciding alone until their probes, and 1.242 × in the
// simulator.
func TestRun_AfterARedisOutageANodeWaitsForItsBreakersProbe(t *testing.T) {
	var reqs []Request
	for at := time.Second; at < 22*time.Second; at += 50 * time.Millisecond {
		reqs = append(reqs, Request{At: at, Key: "k"})
	}
	flushes := func(from, to time.Duration) int64 {
		t.Helper()
		cfg := HarnessTrace(1, 1, 1000, time.Hour, 200*time.Millisecond, time.Second, time.Second, reqs, 1)
		cfg.Faults = []Fault{{Kind: RedisOutage, At: 10 * time.Second, For: 8 * time.Second}}
		cfg.Measure = simmodel.Span{From: from.Milliseconds(), To: to.Milliseconds()}
		res, err := Run(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return res.Regions[0].Redis.Flushes
	}
	if n := flushes(18*time.Second, 19*time.Second); n != 0 {
		t.Errorf("%d flushes reached Redis in the second after the outage, want none: the replay breaker was open", n)
	}
	if n := flushes(20*time.Second, 22*time.Second); n == 0 {
		t.Error("no flush reached Redis between 20 and 22 s: the breaker's probe should have closed it")
	}
}
