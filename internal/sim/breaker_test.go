package sim

import (
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
)

// TestRun_AfterARedisOutageANodeWaitsForItsRestartWatch: a node whose
// flushes failed through its region's Redis outage (10–18 s, a request
// every 50 ms) has tripped its replay breaker, and writes nothing to Redis
// back up until its restart watch hears Redis at its next slow tick,
// which closes the breaker, as a real node's does (origin/breaker.go);
// then it flushes again. Before the simulator modelled the origin's
// breakers its node flushed again at once: 10 flushes between 18 and 19
// s, where real nodes decided alone until their breakers' probes, 5 s
// later (the window of the restart admitted 1.667 × the limit with real
// nodes and 1.242 × in the simulator, in integration's
// TestSimulator_RedisDownUnderSkewedTrafficAgrees). Since 2026-11-29 the
// real breakers close at the restart watch's next answer.
func TestRun_AfterARedisOutageANodeWaitsForItsRestartWatch(t *testing.T) {
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
	if n := flushes(18*time.Second, 18*time.Second+engine.DefaultFastTick); n != 0 {
		t.Errorf("%d flushes reached Redis in the fast tick after the outage, want none: the replay breaker was open", n)
	}
	if n := flushes(18*time.Second, 18*time.Second+engine.DefaultSlowTick+engine.DefaultFastTick); n == 0 {
		t.Error("no flush reached Redis within a slow tick after the outage: the restart watch should have closed the breaker")
	}
}

// TestRun_ARedisRestartedEmptyGetsEveryNodesCellsBack: two nodes of a
// region admit 40 of a key's limit of 100 before their Redis goes down
// and comes back empty (Fault.Empty); a third node, which never saw the
// key, then offers it 100 more. A real node's restart watch sees the new
// run ID and sends every cell it holds again (engine.Resend), so the third
// node reads the 40 and admits 60: 100 in all. Before the simulator
// modelled the resend its Redis kept what it held through the outage, and
// when made to come back empty the third node read nothing and admitted
// 100 more: 140 in all.
func TestRun_ARedisRestartedEmptyGetsEveryNodesCellsBack(t *testing.T) {
	var reqs []Request
	for i := range 40 {
		reqs = append(reqs, Request{At: time.Second + time.Duration(i)*100*time.Millisecond, Key: "k", Node: i % 2})
	}
	for i := range 100 {
		reqs = append(reqs, Request{At: 20*time.Second + time.Duration(i)*50*time.Millisecond, Key: "k", Node: 2})
	}
	cfg := HarnessTrace(1, 3, 100, time.Hour, 200*time.Millisecond, time.Second, time.Second, reqs, 1)
	cfg.Faults = []Fault{{Kind: RedisOutage, At: 10 * time.Second, For: 8 * time.Second, Empty: true}}
	res, err := Run(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got := res.Regions[0].Admitted; got != 100 {
		t.Errorf("admitted %d of 140 requests for a limit of 100: the third node should have read the 40 the others sent again", got)
	}
}
