package sim

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// TestConfig_DefaultsFillOnlyWhatIsUnset: the zero Config is the
// command's defaults and the propagation layer's settings; what is set
// stays, and a negative hot count means none.
func TestConfig_DefaultsFillOnlyWhatIsUnset(t *testing.T) {
	d := Config{}.Defaults()
	p := propagation.Config{}.WithDefaults()
	if d.Regions != 10 || d.Nodes != 10 || d.Keys != 10_000 || d.Hot != 20 || d.Scenario != Even ||
		d.Limit != 1000 || d.Window != time.Minute || d.Duration != 10*time.Minute ||
		d.Flush != p.Flush || d.GlobalSync != p.GlobalSync || d.PublishFloor != p.PublishFloor || d.Batch != p.Batch {
		t.Fatalf("defaults %+v", d)
	}
	if err := d.Validate(); err != nil {
		t.Fatalf("the defaults do not validate: %v", err)
	}
	c := Config{Regions: 3, Keys: 5, Hot: 8, Flush: 300 * time.Millisecond, Background: -1}.Defaults()
	if c.Regions != 3 || c.Nodes != 10 || c.Hot != 5 || c.Flush != 300*time.Millisecond || c.Background != -1 {
		t.Fatalf("set fields changed: %+v (want regions 3, hot capped at the 5 keys, flush 300ms, background -1)", c)
	}
	if c := (Config{Hot: -1}).Defaults(); c.Hot != 0 {
		t.Fatalf("hot -1 gave %d hot keys, want none", c.Hot)
	}
}

// TestConfig_ValidateNamesWhatIsWrong: each invalid field is refused with
// a message that names it.
func TestConfig_ValidateNamesWhatIsWrong(t *testing.T) {
	for _, tc := range []struct {
		set  func(*Config)
		want string
	}{
		{func(c *Config) { c.Nodes = -1 }, "regions"},
		{func(c *Config) { c.Keys = -1 }, "keys"},
		{func(c *Config) { c.Duration = 30 * time.Second }, "shorter than a window"},
		{func(c *Config) { c.Limit = -5 }, "limit"},
		{func(c *Config) { c.Load = -1 }, "load"},
		{func(c *Config) { c.Load = math.NaN() }, "load"},
		{func(c *Config) { c.Background = math.Inf(1) }, "background"},
		{func(c *Config) { c.CrossRTT = -time.Second }, "round trip"},
		{func(c *Config) { c.ReplicaLag = -time.Second }, "replica lag"},
		{func(c *Config) { c.ReplicaLagP99 = time.Millisecond }, "99th percentile"},
		{func(c *Config) { c.RedisLoss = 1.5 }, "redis loss"},
		{func(c *Config) { c.RedisLoss = -0.1 }, "redis loss"},
		{func(c *Config) { c.Scenario = "sideways" }, "scenario"},
		{func(c *Config) { c.Faults = []Fault{{Kind: RedisOutage, Region: 10}} }, "fault in region 10"},
		{func(c *Config) { c.Faults = []Fault{{Kind: PrimaryDown, At: time.Second, For: -time.Second}} }, "fault from 1s for -1s"},
		{func(c *Config) { c.Faults = []Fault{{Kind: PrimaryDown, At: -time.Second, For: time.Second}} }, "fault from -1s for 1s"},
		{func(c *Config) { c.Faults = []Fault{{Kind: FaultKind(9), For: time.Second}} }, "fault of kind 9"},
		// A trace's request at a region or node the fleet has not
		// panicked the run (index out of range [5] with length 2).
		{func(c *Config) { c.Requests = []Request{{Key: "k", Region: 10}} }, "request 0 at region 10 node 0 of 10 × 10"},
		{func(c *Config) { c.Requests = []Request{{Key: "k"}, {Key: "k", Node: -1}} }, "request 1 at region 0 node -1 of 10 × 10"},
		{func(c *Config) { c.Requests = []Request{{Key: "k", At: -time.Second}} }, "request 0 at -1s, before the start"},
	} {
		c := Config{}.Defaults()
		tc.set(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: want an error naming %q", err, tc.want)
		}
	}
	// An explicit trace sets its own length: a run shorter than a window
	// is fine.
	c := Config{Requests: []Request{{Key: "k"}}, Duration: time.Second}.Defaults()
	if err := c.Validate(); err != nil {
		t.Fatalf("a short trace: %v", err)
	}
}

// TestConfig_FailureScenariosBringTheirFaults: each failure scenario adds
// its outage a third of the way in, on skewed traffic; the others add
// none, and a Config's own faults are kept.
func TestConfig_FailureScenariosBringTheirFaults(t *testing.T) {
	own := Fault{Kind: Cutoff, Region: 1, At: time.Second, For: time.Second}
	for _, tc := range []struct {
		sc     Scenario
		spread Scenario
		want   []Fault
	}{
		{Even, Even, nil},
		{Moving, Moving, nil},
		{MySQLDown, Skewed, []Fault{{Kind: PrimaryDown, At: time.Minute, For: time.Minute}}},
		{RedisDown, Skewed, []Fault{{Kind: RedisOutage, Region: 2, At: time.Minute, For: 30 * time.Second, Empty: true}}},
		{Partition, Skewed, []Fault{{Kind: Cutoff, Region: 3, At: time.Minute, For: time.Minute}}},
	} {
		c := Config{Regions: 4, Duration: 3 * time.Minute, Scenario: tc.sc, Faults: []Fault{own}}
		got := c.faults()
		if len(got) != 1+len(tc.want) || got[0] != own {
			t.Errorf("%s: faults %+v, want %+v then %+v", tc.sc, got, own, tc.want)
			continue
		}
		for i, f := range tc.want {
			if got[1+i] != f {
				t.Errorf("%s: fault %+v, want %+v", tc.sc, got[1+i], f)
			}
		}
		if s := tc.sc.spread(); s != tc.spread {
			t.Errorf("%s runs %s traffic, want %s", tc.sc, s, tc.spread)
		}
	}
	if f := (Config{Regions: 1, Duration: time.Minute, Scenario: Partition}).faults(); len(f) != 0 {
		t.Errorf("a partition of a single region: %+v, want none", f)
	}
}
