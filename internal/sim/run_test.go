package sim

import (
	"strings"
	"testing"
	"time"
)

// TestRun_SameSeedSameTable runs a small fleet twice and compares the
// printed tables byte for byte.
func TestRun_SameSeedSameTable(t *testing.T) {
	cfg := Config{Regions: 3, Nodes: 2, Keys: 2000, Hot: 4, Background: 100, Duration: 2 * time.Minute, Scenario: Skewed, Seed: 7}
	var out [2]string
	for i := range out {
		res, err := Run(cfg)
		if err != nil {
			t.Fatal(err)
		}
		var b strings.Builder
		res.Print(&b)
		out[i] = b.String()
	}
	if out[0] != out[1] {
		t.Fatalf("one seed, two tables:\n%s\n---\n%s", out[0], out[1])
	}
	t.Log("\n" + out[0])
}

// TestRun_ExplicitTraceIsDecidedRequestForRequest: a trace's requests are
// each decided once, at their node, and one node alone with its limit
// admits exactly the limit; a Config that does not validate runs nothing.
func TestRun_ExplicitTraceIsDecidedRequestForRequest(t *testing.T) {
	var reqs []Request
	for i := range 5 {
		reqs = append(reqs, Request{At: time.Duration(i+1) * time.Second, Key: "k"})
	}
	reqs = append(reqs, Request{At: 1500 * time.Millisecond, Key: "j"}, Request{At: 2500 * time.Millisecond, Key: "j"})
	res, err := Run(Config{Regions: 1, Nodes: 1, Limit: 3, Requests: reqs, Duration: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if res.Decisions != 7 || res.Admitted != 5 || res.FalseAllows != 0 || res.FalseDenies != 0 {
		t.Fatalf("%d decisions, %d admitted, %d false allows, %d false denies; want 7, 5, 0, 0",
			res.Decisions, res.Admitted, res.FalseAllows, res.FalseDenies)
	}
	if len(res.Windows) != 2 || res.Windows[0] != 2.0/3 || res.Windows[1] != 1 {
		t.Fatalf("windows %v, want j at 2/3 of the limit and k at it", res.Windows)
	}
	if res.Total.Requests != 7 || res.Seconds != 10 {
		t.Fatalf("%d requests over %g s measured, want 7 over 10", res.Total.Requests, res.Seconds)
	}
	if _, err := Run(Config{Regions: 1, Nodes: 1, Scenario: "sideways"}); err == nil {
		t.Fatal("an unknown scenario ran")
	}
}

// TestRun_IdleNodesCostRedisWhatRealNodesDo: a real node with no traffic
// still talks to its region's Redis: INFO each slow_tick (the restart
// watch), the change counter and the region's mark of the runtime
// overrides each slow_tick (overrides_sync.go: GET and HGET, pipelined),
// its record among the region's processes each second (origin/processes.go:
// one script call running TIME, ZREMRANGEBYSCORE, ZADD, PTTL, PEXPIRE and
// ZCARD), and the role's holder takes the region's override changes each
// mysql_flush (one script call and its LRANGE). The simulator's Redis
// calls per request rest on the same: at 200 regions × 10 nodes these
// calls are most of them.
func TestRun_IdleNodesCostRedisWhatRealNodesDo(t *testing.T) {
	const nodes = 4
	res, err := Run(Config{Regions: 1, Nodes: nodes, Keys: 1, Hot: -1, Background: -1, Duration: time.Minute, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	rr := res.Regions[0]
	perNode := func(n int64) float64 { return res.PerSecond(n) / nodes }
	t.Logf("per node and second: %.1f calls, %.1f commands run; INFO %.1f, override looks %.1f, heartbeats %.1f, role %.1f",
		perNode(rr.Redis.Calls), perNode(rr.Redis.Processed), perNode(rr.Redis.Info), perNode(rr.Redis.Overrides),
		perNode(rr.Redis.Heartbeats), perNode(rr.Redis.Role))
	near := func(got, want float64) bool { return got >= 0.95*want && got <= 1.05*want }
	if !near(perNode(rr.Redis.Info), 10) || !near(perNode(rr.Redis.Overrides), 20) || !near(perNode(rr.Redis.Heartbeats), 1) {
		t.Errorf("per idle node and second: %.1f INFO, %.1f override looks, %.1f heartbeats; want 10, 20 (ten GET and HGET) and 1",
			perNode(rr.Redis.Info), perNode(rr.Redis.Overrides), perNode(rr.Redis.Heartbeats))
	}
	// What they and the role cost Redis: INFO 1, a look 2, a heartbeat 7.
	if rest := perNode(rr.Redis.Processed) - perNode(rr.Redis.Role) - 10 - 20 - 7; rest < -1 {
		t.Errorf("%.1f commands run a second per idle node, %.1f short of its INFO, looks and heartbeat", perNode(rr.Redis.Processed), -rest)
	}
}
