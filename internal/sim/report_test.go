package sim

import (
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
)

// TestResult_Figures: the window and burst figures of a result, and what
// they are when there is nothing to show.
func TestResult_Figures(t *testing.T) {
	var empty Result
	if empty.WindowMax() != 0 || empty.WindowMedian() != 0 || empty.BurstText() != "–" {
		t.Fatalf("empty result: max %g, median %g, burst %q", empty.WindowMax(), empty.WindowMedian(), empty.BurstText())
	}
	r := Result{Windows: []float64{0.5, 0.9, 1.02}, Latencies: make([]int64, 100), Unreached: 2}
	for i := range r.Latencies {
		r.Latencies[i] = int64(10 * (i + 1)) // 10 ms to 1 s
	}
	r.Latencies[98], r.Latencies[99] = 1234, 2000 // the p99 is the 99th of 100
	if r.WindowMax() != 1.02 || r.WindowMedian() != 0.9 {
		t.Fatalf("max %g, median %g; want 1.02 and 0.9", r.WindowMax(), r.WindowMedian())
	}
	if p50, p99 := r.Burst(); p50 != 510*time.Millisecond || p99 != 1234*time.Millisecond {
		t.Fatalf("burst p50 %s, p99 %s; want 510ms and 1.234s", p50, p99)
	}
	if got, want := r.BurstText(), "510 ms / 1.23 s (2 never)"; got != want {
		t.Fatalf("burst text %q, want %q", got, want)
	}
	if got := pct(1, 400); got != "0.250 %" || pct(1, 0) != "–" {
		t.Fatalf("pct: %q, %q", got, pct(1, 0))
	}
}

// TestRegionResult_RedisPerRequest splits a region's Redis calls per
// request into the request path's (reads and reservations) and the rest.
func TestRegionResult_RedisPerRequest(t *testing.T) {
	rr := RegionResult{Requests: 100, Redis: simmodel.RedisCost{Calls: 50, Reads: 10, Reserves: 5}}
	if rr.RedisPerRequest() != 0.5 {
		t.Fatalf("%g calls a request, want 0.5", rr.RedisPerRequest())
	}
	if path, rest := rr.RedisSplit(); path != 0.15 || rest != 0.35 {
		t.Fatalf("split %g + %g, want 0.15 + 0.35", path, rest)
	}
	idle := RegionResult{Redis: simmodel.RedisCost{Calls: 7}}
	if p, r := idle.RedisSplit(); idle.RedisPerRequest() != 0 || p != 0 || r != 0 {
		t.Fatal("a region without requests has no calls per request")
	}
}

// TestResult_PrintShowsEveryRegionAndTheTotal: the printed tables have the
// run's description, one accuracy row, a row per region and the total,
// per second of the measured span, and the warning of a run that may not
// repeat.
func TestResult_PrintShowsEveryRegionAndTheTotal(t *testing.T) {
	c := Config{Regions: 2, Nodes: 1, Scenario: Abuse, Seed: 9}.Defaults()
	r := &Result{Config: c, Seconds: 10, Decisions: 1000, FalseAllows: 5, Windows: []float64{1.001},
		Regions: []RegionResult{
			{Name: "r000", Requests: 100, Redis: simmodel.RedisCost{Calls: 40}, MySQL: simmodel.MySQLCost{Statements: 20}},
			{Name: "r001", Requests: 300, Redis: simmodel.RedisCost{Calls: 60}, MySQL: simmodel.MySQLCost{Statements: 10, ReplicaStatements: 30}},
		},
		Total:            RegionResult{Name: "total", Requests: 400, Redis: simmodel.RedisCost{Calls: 100}, MySQL: simmodel.MySQLCost{Statements: 30, ReplicaStatements: 30}},
		ReadWaitTimeouts: 1}
	var b strings.Builder
	r.Print(&b)
	out := b.String()
	for _, want := range []string{
		"scenario abuse, 2 regions × 1 nodes",
		"at 20 × the limit's rate", // abuse: ten times the load
		"| 1.001 | 1.001 | 0.500 % | 0.000 % | – | 0 / 0 |",
		"| r000 | 10.0 | 0.00 + 0.40 | 4 | 2.0 + 0.0 |",
		"| r001 | 30.0 | 0.00 + 0.20 | 6 | 1.0 + 3.0 |",
		"| total | 40.0 | 0.00 + 0.25 | 10 | 3.0 + 3.0 |",
		"warning: 1 decisions gave up waiting",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in\n%s", want, out)
		}
	}
	r.Config.Requests = []Request{{Key: "k"}, {Key: "k"}}
	if d := r.Describe(); !strings.HasPrefix(d, "explicit trace of 2 requests, 2 regions × 1 nodes") {
		t.Errorf("a trace's description: %q", d)
	}
}

// TestResult_DescribeTheRoundTripsOfOneRegion: with one region no other
// region's round trip exists; the description said "1–0 ms from the
// other regions".
func TestResult_DescribeTheRoundTripsOfOneRegion(t *testing.T) {
	for _, c := range []struct {
		regions int
		want    string
	}{
		{1, "round trip to the primary 1 ms, in its own region"},
		{4, "round trip to the primary 160–250 ms from the other regions"},
	} {
		cfg := Config{Regions: c.regions, Nodes: 1, Seed: 9, LocalRTT: time.Millisecond, CrossRTT: 250 * time.Millisecond}.Defaults()
		if d := (&Result{Config: cfg}).Describe(); !strings.Contains(d, c.want) {
			t.Errorf("%d regions: no %q in %q", c.regions, c.want, d)
		}
	}
}
