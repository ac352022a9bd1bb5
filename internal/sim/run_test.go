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
