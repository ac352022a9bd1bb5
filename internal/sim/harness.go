package sim

import (
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
)

// The scale harness's configurations (integration/scale_test.go, `make
// regions`), request for request, on this machine's network: every server
// on loopback, a replica that applies within milliseconds. Their figures
// are what the simulator must agree with.

// Harness settings (integration/scale_test.go).
const (
	harnessLimit = 300
	harnessRate  = 80 // requests a second
	harnessFlush = 200 * time.Millisecond
	harnessSync  = time.Second
	// harnessStart leaves the fleet time to take its roles and read the
	// tables whole before the load, as the harness's cluster has before
	// its first scenario.
	harnessStart = 10 * time.Second
)

// harnessNet is loopback, its round trips as long as the real processes'
// calls took on this 2-core machine beside the load (the holder's flush
// ticks, timed step by step in 2026-11-27's burst runs): a Redis call
// about 0.3 ms, a MySQL statement about a millisecond, the client's and
// the server's work with the wire's. The wire alone (0.1 ms and 0.2–0.3
// ms, as modelled before) made each flush tick a few milliseconds short,
// and each loop's next tick waits for the last to end.
func harnessNet(c Config) Config {
	c.CrossRTT = time.Millisecond
	c.LocalRTT = time.Millisecond
	c.RedisRTT = simmodel.Dist{Median: 0.3, P99: 1.5}
	c.ReplicaLag = 5 * time.Millisecond
	c.Flush, c.GlobalSync, c.BlocklistSync = harnessFlush, harnessSync, harnessSync
	c.Window = time.Hour // the harness picks windows of an hour or more: one cell
	c.Limit = harnessLimit
	c.Keys, c.Hot, c.Background = 1, -1, -1
	return c
}

// HarnessLoad is the scale harness's load of one scenario: 80 requests a
// second for 2 × 300 / 80 + 0.5 s, round robin over the nodes weighted by
// shares (region r gets shares[r] parts, spread evenly over its nodes),
// on regions × nodes with a replica for the regions after the first.
// Costs are measured over the load.
func HarnessLoad(regions, nodes int, shares []int) Config {
	c := harnessNet(Config{Regions: regions, Nodes: nodes, Seed: 1})
	d := time.Duration(float64(2*harnessLimit)/harnessRate*float64(time.Second)) + 500*time.Millisecond
	total := int(harnessRate * d.Seconds())
	type place struct{ region, node int }
	var order []place
	for turn := range nodes {
		for r, share := range shares {
			for range share {
				order = append(order, place{r, turn})
			}
		}
	}
	interval := time.Second / harnessRate
	for i := range total {
		p := order[i%len(order)]
		c.Requests = append(c.Requests, Request{At: harnessStart + time.Duration(i)*interval, Key: "scale", Region: p.region, Node: p.node})
	}
	c.Measure = simmodel.Span{From: harnessStart.Milliseconds(), To: (harnessStart + d).Milliseconds()}
	c.Duration = harnessStart + d + time.Second
	return c
}

// HarnessSteady is the harness's steady region (issue 17): one region of
// nodes, 400 keys at 60 % of a limit of 10 (six requests each, request i
// of key k at node (k + i) mod nodes), then no traffic; MySQL's load is
// measured over 10 s once the region stopped changing.
func HarnessSteady(nodes int) Config {
	c := harnessNet(Config{Regions: 1, Nodes: nodes, Seed: 1})
	c.Limit = 10
	const keys = 400
	for k := range keys {
		for i := range 6 {
			at := time.Second + time.Duration(k*6+i)*time.Second/(keys*6)
			c.Requests = append(c.Requests, Request{At: at, Key: "load-" + itoa(k), Region: 0, Node: (k + i) % nodes})
		}
	}
	c.Measure = simmodel.Span{From: 15_000, To: 25_000}
	c.Duration = 26 * time.Second
	return c
}

// HarnessIdle is one region of nodes with no traffic at all: what the
// region costs its Redis and MySQL by its loops alone (the restart
// watch, the runtime overrides' looks, the heartbeats, the role and its
// pulls), measured over 10 s once the fleet has taken its role.
func HarnessIdle(nodes int) Config {
	c := harnessNet(Config{Regions: 1, Nodes: nodes, Seed: 1})
	c.Requests = []Request{} // a trace of none
	c.Measure = simmodel.Span{From: harnessStart.Milliseconds(), To: (harnessStart + 10*time.Second).Milliseconds()}
	c.Duration = harnessStart + 11*time.Second
	return c
}

// HarnessTrace replays requests recorded against real processes on this
// machine (integration's accuracy agreement tests): regions × nodes on
// loopback with every region reading the primary (the integration
// cluster has no replica), one limit per window, mysql_flush flush,
// global_sync and blocklist_sync sync and min_window 1s (the cluster's:
// its windows of seconds cross regions), run for settle after the last
// request. A request's At is its time from the start, the start lying on
// a border of window wherever the trace crosses one, and the fleet needs
// harnessStart before the first to take its roles, as the real one is
// given before its load.
func HarnessTrace(regions, nodes int, limit int64, window, flush, sync, settle time.Duration, reqs []Request, seed uint64) Config {
	c := harnessNet(Config{Regions: regions, Nodes: nodes, Seed: seed})
	c.NoReplicas = true
	c.Limit, c.Window = limit, window
	c.Flush, c.GlobalSync, c.BlocklistSync = flush, sync, sync
	c.MinWindow = time.Second
	c.Requests = reqs
	var last time.Duration
	for _, r := range reqs {
		last = max(last, r.At)
	}
	c.Duration = last + settle
	return c
}

// HarnessStart is how long the simulated fleet runs before a trace's
// first request may come (see HarnessTrace).
const HarnessStart = harnessStart

// HarnessFigures are a run's figures as the harness prints them.
type HarnessFigures struct {
	// Admitted is admitted / limit.
	Admitted float64
	// Statements and RowsRead are per second on the primary;
	// ReplicaStatements and ReplicaRowsRead per second on the replica,
	// per region that reads from it.
	Statements, RowsRead, ReplicaStatements, ReplicaRowsRead float64
	// Redis is the Redis commands a second (total_commands_processed) of
	// each region.
	Redis []float64
}

// Figures returns r's figures as the harness prints them.
func (r *Result) Figures() HarnessFigures {
	var f HarnessFigures
	if len(r.Windows) > 0 {
		f.Admitted = float64(r.Admitted) / float64(r.Config.Limit)
	}
	replicas := 0
	for i, rr := range r.Regions {
		f.Statements += r.PerSecond(rr.MySQL.Statements)
		f.RowsRead += r.PerSecond(rr.MySQL.RowsRead)
		if i > 0 && !r.Config.NoReplicas {
			replicas++
			f.ReplicaStatements += r.PerSecond(rr.MySQL.ReplicaStatements)
			f.ReplicaRowsRead += r.PerSecond(rr.MySQL.ReplicaRowsRead)
		}
		f.Redis = append(f.Redis, r.PerSecond(rr.Redis.Processed))
	}
	if replicas > 0 {
		f.ReplicaStatements /= float64(replicas)
		f.ReplicaRowsRead /= float64(replicas)
	}
	return f
}

func itoa(n int) string {
	if n == 0 {
		return "0"
	}
	var b [20]byte
	i := len(b)
	for ; n > 0; n /= 10 {
		i--
		b[i] = byte('0' + n%10)
	}
	return string(b[i:])
}
