package main

import (
	"io"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/sim"
)

// TestParse_FlagsFillTheConfig: without flags the command runs its
// documented defaults; each flag sets its field, minutes as a duration.
func TestParse_FlagsFillTheConfig(t *testing.T) {
	o, err := parse(nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	want := sim.Config{Regions: 10, Nodes: 10, Keys: 10_000, Hot: 20, Duration: 10 * time.Minute, Seed: 1,
		Scenario: sim.Even, Limit: 1000, Window: time.Minute, Load: 2, Background: 1000,
		CrossRTT: 250 * time.Millisecond, ReplicaLag: time.Second, Flush: time.Second,
		GlobalSync: 5 * time.Second, BlocklistSync: 10 * time.Second, PublishFloor: 0.2}
	if !reflect.DeepEqual(o, options{cfg: want}) {
		t.Fatalf("defaults %+v, want %+v", o.cfg, want)
	}
	o, err = parse(strings.Fields("-regions 3 -nodes 2 -minutes 1.5 -scenario burst -no-replicas -publish-floor 0.05 -redis-loss 0.01 -table regions -seed 9"), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	c := o.cfg
	if c.Regions != 3 || c.Nodes != 2 || c.Duration != 90*time.Second || c.Scenario != sim.Burst || !c.NoReplicas ||
		c.PublishFloor != 0.05 || c.RedisLoss != 0.01 || c.Seed != 9 || o.table != "regions" {
		t.Fatalf("flags gave %+v, table %q", c, o.table)
	}
}

// TestRun_PrintsOneRunTheSameEveryTime: a small run prints its
// description and tables, the same for the same seed.
func TestRun_PrintsOneRunTheSameEveryTime(t *testing.T) {
	args := strings.Fields("-regions 2 -nodes 1 -keys 50 -hot 1 -background 5 -minutes 1 -seed 3")
	var out [2]string
	for i := range out {
		var stdout, stderr strings.Builder
		if code := run(args, &stdout, &stderr); code != 0 {
			t.Fatalf("exit %d: %s", code, stderr.String())
		}
		out[i] = stdout.String()
	}
	if !strings.HasPrefix(out[0], "scenario even, 2 regions × 1 nodes, 50 keys") || !strings.Contains(out[0], "| total |") {
		t.Fatalf("output:\n%s", out[0])
	}
	if out[0] != out[1] {
		t.Fatalf("one seed, two outputs:\n%s\n---\n%s", out[0], out[1])
	}
}

// TestRun_ExitStatus: help is not an error; an unknown flag, an invalid
// config and an unknown table exit 2 with a message on stderr.
func TestRun_ExitStatus(t *testing.T) {
	for _, tc := range []struct {
		args string
		code int
		says string
	}{
		{"-h", 0, "-regions"},
		{"-bogus", 2, "flag provided but not defined"},
		{"-limit -1", 2, "ratelimit-sim: limit -1"},
		{"-scenario sideways", 2, `ratelimit-sim: scenario "sideways"`},
		{"-table nope", 2, `ratelimit-sim: no table "nope"`},
	} {
		var stdout, stderr strings.Builder
		code := run(strings.Fields(tc.args), &stdout, &stderr)
		if code != tc.code || !strings.Contains(stderr.String(), tc.says) || stdout.Len() != 0 {
			t.Errorf("%s: exit %d, stderr %q, stdout %q; want exit %d saying %q", tc.args, code, stderr.String(), stdout.String(), tc.code, tc.says)
		}
	}
}
