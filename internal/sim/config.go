package sim

import (
	"fmt"
	"math"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// Scenario names a traffic pattern and the fault it brings, if any.
type Scenario string

// The scenarios.
const (
	// Even: every key's traffic spread evenly over the regions.
	Even Scenario = "even"
	// Skewed: each key's traffic over the regions follows Zipf's law
	// (region i of the key's order gets 1/i of the first one's).
	Skewed Scenario = "skewed"
	// Burst: each hot key bursts at one region, drawn at random, once a
	// window, at ten times its limit's rate; the other regions see none
	// of it but what propagates.
	Burst Scenario = "burst"
	// Moving: each key's traffic follows the day around the world: its
	// peak moves over the regions once per simulated run.
	Moving Scenario = "moving"
	// Cold: the background is many keys of one request each.
	Cold Scenario = "cold"
	// Abuse: hot keys at ten times the load, far above their limit.
	Abuse Scenario = "abuse"
	// MySQLDown: skewed traffic; the MySQL primary is down for 60 s.
	MySQLDown Scenario = "mysql-down"
	// RedisDown: skewed traffic; one region's Redis is down for 30 s and
	// comes back empty, as one restarted without persistence does.
	RedisDown Scenario = "redis-down"
	// Partition: skewed traffic; one region is cut off from the others
	// (the primary, and replication to its replica) for 60 s, then
	// rejoins.
	Partition Scenario = "partition"
)

// spread is the traffic pattern of s: the failure scenarios run skewed
// traffic, under which the regions depend on each other's counts.
func (s Scenario) spread() Scenario {
	switch s {
	case MySQLDown, RedisDown, Partition:
		return Skewed
	}
	return s
}

// Scenarios lists every scenario, in the order tables show them.
var Scenarios = []Scenario{Even, Skewed, Burst, Moving, Cold, Abuse, MySQLDown, RedisDown, Partition}

// Config is one simulation: the fleet, the traffic, the network and the
// cross-region layer's settings.
type Config struct {
	// Regions and Nodes (per region) size the fleet.
	Regions, Nodes int
	// Keys is the number of distinct keys in the traffic: Hot keys at
	// Load times their limit's rate (zero: 20; negative: none), and
	// Keys − Hot background keys that share Background requests a second
	// by a Zipf law (the busiest at most half its limit's rate).
	Keys, Hot int
	// Duration is the simulated time.
	Duration time.Duration
	// Seed makes the run: one seed, one result.
	Seed uint64
	// Scenario is the traffic pattern and fault.
	Scenario Scenario
	// Limit and Window are every key's limit (units per sliding window).
	Limit  int64
	Window time.Duration
	// Load is the hot keys' offered rate, in multiples of Limit per
	// Window.
	Load float64
	// Background is the background keys' requests a second, all regions
	// together; negative: none.
	Background float64

	// CrossRTT is the round trip of a statement from the region farthest
	// from the primary; the others' fall between 0.28 × CrossRTT and it,
	// by their distance on a ring of regions (region 0 holds the primary).
	CrossRTT time.Duration
	// LocalRTT is a statement's round trip within a region (to the
	// region's replica, or to the primary from its own region).
	LocalRTT time.Duration
	// RedisRTT is the distribution of a Redis call's round trip (ms);
	// RedisLoss the share of calls lost.
	RedisRTT  simmodel.Dist
	RedisLoss float64
	// ReplicaLag is the replicas' median lag, ReplicaLagP99 their 99th
	// percentile (zero: three times the median; the median itself: every
	// replica that far behind, as one held by MASTER_DELAY). NoReplicas
	// sends every region's reads to the primary.
	ReplicaLag, ReplicaLagP99 time.Duration
	NoReplicas                bool

	// Flush, GlobalSync, BlocklistSync, PublishFloor, Batch and
	// MinWindow are the cross-region layer's settings (mysql_flush, …,
	// min_window: a window shorter than it stays in its region); zero
	// keeps the defaults of package propagation.
	Flush, GlobalSync, BlocklistSync, MinWindow time.Duration
	PublishFloor                                float64
	Batch                                       int

	// Requests, when set, replace the scenario's generated traffic: the
	// scale harness's loads, request for request.
	Requests []Request
	// Measure is the span (from the start) over which costs are counted;
	// zero: the whole run.
	Measure simmodel.Span
	// Faults are added to the scenario's.
	Faults []Fault
}

// Request is one request of an explicit trace.
type Request struct {
	// At is the time from the start.
	At time.Duration
	// Key is the identifier; Region and Node where it arrives.
	Key          string
	Region, Node int
}

// Fault is an outage.
type Fault struct {
	// Kind is what fails.
	Kind FaultKind
	// Region is the region whose Redis fails, or which is cut off.
	Region int
	// At and For place it, from the start.
	At, For time.Duration
	// Empty makes a RedisOutage a Redis killed and restarted without
	// persistence: every call refused at once while it is down, and back
	// empty, with a new run ID, which each node's restart watch sees.
	// Otherwise Redis cannot be reached (each call waits out its timeout,
	// as behind a partition) and comes back with what it held.
	Empty bool
}

// FaultKind is a kind of outage.
type FaultKind int

// The faults.
const (
	// PrimaryDown: the MySQL primary refuses every statement.
	PrimaryDown FaultKind = iota
	// RedisOutage: a region's Redis cannot be reached.
	RedisOutage
	// Cutoff: a region reaches neither the primary nor the other regions;
	// its replica applies nothing. Its own Redis still answers.
	Cutoff
)

// Defaults fills the zero fields of c with the defaults.
func (c Config) Defaults() Config {
	set := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	if c.Regions == 0 {
		c.Regions = 10
	}
	if c.Nodes == 0 {
		c.Nodes = 10
	}
	if c.Hot == 0 {
		c.Hot = 20
	}
	c.Hot = max(c.Hot, 0)
	if c.Keys == 0 {
		c.Keys = 10_000
	}
	c.Hot = min(c.Hot, c.Keys)
	set(&c.Duration, 10*time.Minute)
	if c.Scenario == "" {
		c.Scenario = Even
	}
	if c.Limit == 0 {
		c.Limit = 1000
	}
	set(&c.Window, time.Minute)
	if c.Load == 0 {
		c.Load = 2
	}
	if c.Background == 0 {
		c.Background = 1000
	}
	set(&c.CrossRTT, 250*time.Millisecond)
	set(&c.LocalRTT, time.Millisecond)
	if c.RedisRTT == (simmodel.Dist{}) {
		c.RedisRTT = simmodel.Dist{Median: 0.5, P99: 2}
	}
	set(&c.ReplicaLag, time.Second)
	set(&c.ReplicaLagP99, 3*c.ReplicaLag)
	d := propagation.Config{}.WithDefaults()
	set(&c.Flush, d.Flush)
	set(&c.GlobalSync, d.GlobalSync)
	set(&c.BlocklistSync, d.BlocklistSync)
	set(&c.MinWindow, d.MinWindow)
	if c.PublishFloor == 0 {
		c.PublishFloor = d.PublishFloor
	}
	if c.Batch == 0 {
		c.Batch = d.Batch
	}
	return c
}

// Validate reports what is wrong with c (after Defaults).
func (c Config) Validate() error {
	switch {
	case c.Regions < 1 || c.Nodes < 1:
		return fmt.Errorf("regions %d × nodes %d: want at least 1 × 1", c.Regions, c.Nodes)
	case c.Keys < 1 || c.Hot < 0:
		return fmt.Errorf("keys %d, hot %d: want at least one key", c.Keys, c.Hot)
	case c.Duration < c.Window && c.Requests == nil:
		return fmt.Errorf("duration %s is shorter than a window (%s)", c.Duration, c.Window)
	case c.Limit < 1 || c.Window < time.Millisecond:
		return fmt.Errorf("limit %d per %s: want a positive limit and window", c.Limit, c.Window)
	case !(c.Load >= 0) || math.IsInf(c.Load, 0) || math.IsNaN(c.Background) || math.IsInf(c.Background, 1):
		return fmt.Errorf("load %g, background %g: want finite rates, the load not negative", c.Load, c.Background)
	case c.CrossRTT < 0 || c.LocalRTT < 0 || c.ReplicaLag < 0:
		return fmt.Errorf("cross-region round trip %s, local %s, replica lag %s: want none negative", c.CrossRTT, c.LocalRTT, c.ReplicaLag)
	case c.ReplicaLagP99 < c.ReplicaLag:
		return fmt.Errorf("replica lag's 99th percentile %s below its median %s", c.ReplicaLagP99, c.ReplicaLag)
	case !(c.RedisLoss >= 0 && c.RedisLoss <= 1):
		return fmt.Errorf("redis loss %g: want a probability from 0 to 1", c.RedisLoss)
	}
	known := false
	for _, s := range Scenarios {
		known = known || s == c.Scenario
	}
	if !known {
		return fmt.Errorf("scenario %q: want one of %v", c.Scenario, Scenarios)
	}
	for _, f := range c.Faults {
		switch {
		case f.Region < 0 || f.Region >= c.Regions:
			return fmt.Errorf("fault in region %d of %d", f.Region, c.Regions)
		case f.At < 0 || f.For <= 0:
			return fmt.Errorf("fault from %s for %s: want a positive span from the start on", f.At, f.For)
		case f.Kind != PrimaryDown && f.Kind != RedisOutage && f.Kind != Cutoff:
			return fmt.Errorf("fault of kind %d: want PrimaryDown, RedisOutage or Cutoff", f.Kind)
		}
	}
	// A trace's request must arrive at a node of the fleet: one outside
	// it panicked the run, indexing past the regions or their nodes.
	for i, r := range c.Requests {
		switch {
		case r.Region < 0 || r.Region >= c.Regions || r.Node < 0 || r.Node >= c.Nodes:
			return fmt.Errorf("request %d at region %d node %d of %d × %d", i, r.Region, r.Node, c.Regions, c.Nodes)
		case r.At < 0:
			return fmt.Errorf("request %d at %s, before the start", i, r.At)
		}
	}
	return nil
}

// faults returns the scenario's faults and c's own.
func (c Config) faults() []Fault {
	at := c.Duration / 3
	out := append([]Fault(nil), c.Faults...)
	switch c.Scenario {
	case MySQLDown:
		out = append(out, Fault{Kind: PrimaryDown, At: at, For: time.Minute})
	case RedisDown:
		out = append(out, Fault{Kind: RedisOutage, Region: c.Regions / 2, At: at, For: 30 * time.Second, Empty: true})
	case Partition:
		if c.Regions > 1 {
			out = append(out, Fault{Kind: Cutoff, Region: c.Regions - 1, At: at, For: time.Minute})
		}
	}
	return out
}
