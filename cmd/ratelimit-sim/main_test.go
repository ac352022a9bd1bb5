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
		GlobalSync: 5 * time.Second, BlocklistSync: 10 * time.Second, MinWindow: time.Minute, PublishFloor: 0.2}
	if !reflect.DeepEqual(o, options{cfg: want}) {
		t.Fatalf("defaults %+v, want %+v", o.cfg, want)
	}
	o, err = parse(strings.Fields("-regions 3 -nodes 2 -minutes 1.5 -scenario burst -no-replicas -publish-floor 0.05 -min-window 1s -redis-loss 0.01 -hot -1 -background -1 -seed 9"), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	c := o.cfg
	if c.Regions != 3 || c.Nodes != 2 || c.Duration != 90*time.Second || c.Scenario != sim.Burst || !c.NoReplicas ||
		c.PublishFloor != 0.05 || c.MinWindow != time.Second || c.RedisLoss != 0.01 || c.Hot != -1 || c.Background != -1 || c.Seed != 9 || o.table != "" {
		t.Fatalf("flags gave %+v, table %q", c, o.table)
	}
	// A table takes its seed (and a profile), as `make sim` passes them.
	o, err = parse(strings.Fields("-table regions -seed 9 -cpuprofile cpu.out"), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.table != "regions" || o.cfg.Seed != 9 || o.profile != "cpu.out" {
		t.Fatalf("table flags gave %+v", o)
	}
}

// TestRun_RejectsWhatItCannotMean: a value that would become a default,
// fall outside its range, or be ignored exits 2 before any run starts,
// with a message naming the flag and what it wants; nothing goes to
// stdout.
func TestRun_RejectsWhatItCannotMean(t *testing.T) {
	for _, tc := range []struct {
		args string
		says []string
	}{
		{"-regions 0", []string{"-regions 0", "at least 1 region"}},
		{"-nodes 0", []string{"-nodes 0", "at least 1 node"}},
		{"-nodes -3", []string{"-nodes -3", "at least 1 node"}},
		{"-keys 0", []string{"-keys 0", "at least 1 key"}},
		{"-hot 0", []string{"-hot 0", "negative number for none"}},
		{"-keys 10 -hot 11", []string{"-hot 11", "more hot keys than -keys 10"}},
		{"-minutes 0", []string{"-minutes 0", "positive number of minutes"}},
		{"-minutes -2", []string{"-minutes -2", "positive number of minutes"}},
		{"-minutes NaN", []string{"-minutes NaN", "positive number of minutes"}},
		{"-minutes 1e300", []string{"-minutes 1e+300", "at most"}},
		{"-minutes 0.5", []string{"-minutes 0.5", "shorter than -window 1m0s"}},
		{"-scenario sideways", []string{`-scenario "sideways"`, "want one of"}},
		{"-scenario=", []string{`-scenario ""`, "want one of"}},
		{"-scenario partition -regions 1", []string{"-scenario partition", "at least 2 -regions"}},
		{"-limit 0", []string{"-limit 0", "positive limit"}},
		{"-limit -1", []string{"-limit -1", "positive limit"}},
		{"-regions 1 -nodes 1 -keys 1 -hot 1 -background -1 -minutes 1 -load 1e-14 -limit 9007199254740992", []string{"-limit 9007199254740992", "at most 9007199254740991"}},
		{"-window 0", []string{"-window 0s", "at least 1ms"}},
		{"-window -1m", []string{"-window -1m0s", "at least 1ms"}},
		{"-load 0", []string{"-load 0", "positive multiple"}},
		{"-load -1", []string{"-load -1", "positive multiple"}},
		{"-load +Inf", []string{"-load +Inf", "positive multiple"}},
		{"-background 0", []string{"-background 0", "negative one for none"}},
		{"-background NaN", []string{"-background NaN", "negative one for none"}},
		{"-cross-rtt 0", []string{"-cross-rtt 0s", "positive round trip"}},
		{"-cross-rtt -1s", []string{"-cross-rtt -1s", "positive round trip"}},
		{"-replica-lag 0", []string{"-replica-lag 0s", "positive lag"}},
		{"-replica-lag -1s", []string{"-replica-lag -1s", "positive lag"}},
		{"-mysql-flush 0", []string{"-mysql-flush 0s", "at least 10ms"}},
		{"-global-sync -5s", []string{"-global-sync -5s", "at least 10ms"}},
		{"-blocklist-sync 5ms", []string{"-blocklist-sync 5ms", "at least 10ms"}},
		{"-mysql-flush 2h", []string{"-mysql-flush 2h0m0s", "at most 1h0m0s"}},
		{"-global-sync 61m", []string{"-global-sync 1h1m0s", "at most 1h0m0s"}},
		{"-blocklist-sync 2562047h", []string{"-blocklist-sync 2562047h", "at most 1h0m0s"}},
		{"-min-window 0", []string{"-min-window 0s", "at least 10ms"}},
		{"-min-window 5ms", []string{"-min-window 5ms", "at least 10ms"}},
		{"-publish-floor 0", []string{"-publish-floor 0", "above 0 and at most 1"}},
		{"-publish-floor 1.5", []string{"-publish-floor 1.5", "above 0 and at most 1"}},
		{"-redis-loss 1.5", []string{"-redis-loss 1.5", "probability from 0 to 1"}},
		{"-redis-loss -0.1", []string{"-redis-loss -0.1", "probability from 0 to 1"}},
		{"foo -regions 3", []string{`unexpected argument "foo"`}},
		{"-regions 3 foo", []string{`unexpected argument "foo"`}},
		{"-table nope", []string{`-table "nope"`, "want one of"}},
		{"-table=", []string{`-table ""`, "want one of"}},
		{"-table= -regions 2", []string{`-table ""`, "want one of"}},
		{"-table regions -regions 3 -nodes 2", []string{"-table regions", "-nodes, -regions would not apply"}},
		{"-table bars -minutes 1", []string{"-table bars", "-minutes would not apply"}},
		{"-table failure -scenario even", []string{"-table failure", "-scenario would not apply"}},
	} {
		var stdout, stderr strings.Builder
		code := run(strings.Fields(tc.args), &stdout, &stderr)
		ok := code == 2 && stdout.Len() == 0 && strings.HasPrefix(stderr.String(), "ratelimit-sim: ")
		for _, s := range tc.says {
			ok = ok && strings.Contains(stderr.String(), s)
		}
		if !ok {
			t.Errorf("%s: exit %d, stderr %q, stdout %q; want exit 2 saying %q", tc.args, code, stderr.String(), stdout.String(), tc.says)
		}
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

// TestRun_NoHotKeysMeasureNoWindow: a run without hot keys measures no
// window of a hot key, so its admitted / limit columns say so ("–")
// rather than 0.000, which read as nothing admitted.
func TestRun_NoHotKeysMeasureNoWindow(t *testing.T) {
	var stdout, stderr strings.Builder
	if code := run(strings.Fields("-regions 1 -nodes 1 -keys 5 -hot -1 -background 2 -minutes 1"), &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if !strings.Contains(stdout.String(), "\n| – | – | ") {
		t.Fatalf("want the accuracy row to begin \"| – | – |\":\n%s", stdout.String())
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
		{"-limit -1", 2, "ratelimit-sim: -limit -1"},
		{"-scenario sideways", 2, `ratelimit-sim: -scenario "sideways"`},
		{"-table nope", 2, `ratelimit-sim: -table "nope"`},
	} {
		var stdout, stderr strings.Builder
		code := run(strings.Fields(tc.args), &stdout, &stderr)
		if code != tc.code || !strings.Contains(stderr.String(), tc.says) || stdout.Len() != 0 {
			t.Errorf("%s: exit %d, stderr %q, stdout %q; want exit %d saying %q", tc.args, code, stderr.String(), stdout.String(), tc.code, tc.says)
		}
	}
}

// TestParse_RejectsARunBeyondAnyMachine: a fleet, a keyspace or a number
// of requests no machine holds or finishes is an error naming the flags,
// before anything runs; such runs once died of an allocation of 32 GB
// (-keys 2000000000: "fatal error: out of memory" and every goroutine's
// stack) or ran for ever (-load 1e300).
func TestParse_RejectsARunBeyondAnyMachine(t *testing.T) {
	for _, tc := range []struct {
		args string
		says []string
	}{
		{"-keys 2000000000 -hot 5", []string{"-keys 2000000000", "at most 10000000"}},
		{"-regions 100000000 -nodes 1", []string{"-regions 100000000 × -nodes 1", "at most 20000"}},
		{"-regions 1 -nodes 100000000", []string{"-regions 1 × -nodes 100000000", "at most 20000"}},
		{"-regions 9223372036854775807 -nodes 2", []string{"-regions 9223372036854775807 × -nodes 2", "at most 20000"}},
		{"-load 1e300", []string{"requests", "at most 1e+09"}},
		{"-limit 9007199254740991", []string{"requests", "at most 1e+09"}},
		{"-background 1e300", []string{"requests", "at most 1e+09"}},
		{"-window 1ms -minutes 10", []string{"requests", "at most 1e+09"}},
		{"-minutes 153722867 -window 2562047h", []string{"requests", "at most 1e+09"}},
		// No request at all, for long enough that the nodes' loops do not
		// finish: 100,000,000 simulated minutes of one node.
		{"-regions 1 -nodes 1 -keys 1 -hot -1 -background -1 -minutes 1e8", []string{"-minutes 1e+08 × 1 nodes", "at most 1e+09"}},
		{"-regions 1 -nodes 1 -hot 1 -background -1 -window 2000000h -minutes 1.2e8", []string{"nodes", "at most 1e+09"}},
		{"-regions 200 -nodes 100 -hot -1 -background -1 -minutes 1000", []string{"-minutes 1000 × 20000 nodes", "at most 1e+09"}},
	} {
		_, err := parse(strings.Fields(tc.args), io.Discard)
		ok := err != nil
		for _, s := range tc.says {
			ok = ok && strings.Contains(err.Error(), s)
		}
		if !ok {
			t.Errorf("%s: %v; want an error saying %q", tc.args, err, tc.says)
		}
	}
	// The tables' largest runs stay within the bounds.
	for _, args := range []string{"-regions 200 -nodes 10 -keys 100000", "-regions 10 -nodes 50 -keys 100000", "-regions 50 -nodes 10 -keys 100000 -scenario abuse"} {
		if _, err := parse(strings.Fields(args), io.Discard); err != nil {
			t.Errorf("%s: %v", args, err)
		}
	}
}
