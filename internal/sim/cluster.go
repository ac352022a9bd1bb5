package sim

import (
	"fmt"
	"math"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
	"github.com/edgelimit/caddy-ratelimit/origin"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// The fleet: per region a Redis model and nodes; per node an engine on the
// region's Redis (engine.Origin) and a propagation layer on the region's
// Redis (propagation.Region) and on MySQL (propagation.Store), with a
// write breaker on the simulated clock.

// Namespace is the zone every simulated key belongs to.
const Namespace = "api"

// The engine's replay ticks (its defaults), which the loop drives.
const (
	fastTickMs = int64(engine.DefaultFastTick / time.Millisecond)
	slowTickMs = int64(engine.DefaultSlowTick / time.Millisecond)
	sweepMs    = int64(engine.DefaultJanitorInterval / time.Millisecond)
)

// The region's processes (origin/processes.go, redis.go): each node
// renews its record every second, the record lapsing after five.
const (
	heartbeatMs      = 1000
	heartbeatLapseMs = 5 * heartbeatMs
)

type region struct {
	index int
	name  string
	redis *simmodel.Redis
	nodes []*node
	// requests and admitted are the requests the region received in the
	// measured span and those it admitted.
	requests, admitted int64
}

type node struct {
	index  int // in the fleet
	id     string
	region *region
	eng    *engine.Engine
	zone   *engine.Zone
	prop   *propagation.Propagator
	gate   *simmodel.Gate
	// requests and replay are its origin's breakers (breakerOrigin).
	requests, replay *simmodel.Gate
	tick             simmodel.Tick
	slow             int64 // the fast tick, of ten, at which its slow tick runs
	// runID is the run ID of its region's Redis its restart watch last
	// heard.
	runID int64
	// beat is the slow tick, of ten, at which its heartbeat runs;
	// beatOK when one last succeeded, lost once it stopped counting.
	beat   int64
	beatOK int64
	lost   bool
}

// rtt is region i's round trip to the primary (region 0): by its distance
// on the ring of regions, from 0.28 × the farthest's to it.
func rtt(i, regions int, local, far time.Duration) float64 {
	if i == 0 {
		return float64(local) / float64(time.Millisecond)
	}
	d := float64(min(i, regions-i)) / float64(regions) // (0, 0.5]
	return float64(far) / float64(time.Millisecond) * (0.28 + 0.72*2*d)
}

// build makes the fleet and the models.
func (s *sim) build() error {
	c := s.cfg
	now := s.clk.UnixMilli
	timeout := propagation.Config{}.WithDefaults().Timeout
	var views []*simmodel.MySQLRegion
	for i := range c.Regions {
		r := &region{index: i, name: fmt.Sprintf("r%03d", i)}
		link := simmodel.Link{Latency: c.RedisRTT, Loss: c.RedisLoss}
		v := &simmodel.MySQLRegion{
			ToPrimary: simmodel.Link{Latency: jittered(rtt(i, c.Regions, c.LocalRTT, c.CrossRTT))},
			Replica:   i > 0 && !c.NoReplicas,
			Local:     simmodel.Link{Latency: jittered(float64(c.LocalRTT) / float64(time.Millisecond))},
			Lag:       simmodel.Dist{Median: float64(c.ReplicaLag.Milliseconds()), P99: float64(c.ReplicaLagP99.Milliseconds())},
		}
		for _, f := range c.faults() {
			span := simmodel.Span{From: s.base + f.At.Milliseconds(), To: s.base + (f.At + f.For).Milliseconds()}
			switch {
			case f.Kind == RedisOutage && f.Region == i && f.Empty:
				link.Refusals = append(link.Refusals, span)
			case f.Kind == RedisOutage && f.Region == i:
				link.Outages = append(link.Outages, span)
			case f.Kind == Cutoff && f.Region == i:
				v.ToPrimary.Outages = append(v.ToPrimary.Outages, span)
			}
		}
		r.redis = simmodel.NewRedis(now, c.Seed*1000+uint64(i)+1, link, simmodel.DefaultTimeouts)
		ri := i
		r.redis.Watch(func(id simmodel.CellID, cur, _ simmodel.Hash, at int64) { s.m.view(ri, id, cur, at) })
		views = append(views, v)
		s.regions = append(s.regions, r)
	}
	s.mysql = simmodel.NewMySQL(now, c.Seed*1000+999, float64(timeout.Milliseconds()), views)
	for _, f := range c.faults() {
		if f.Kind == PrimaryDown {
			s.mysql.SetPrimaryDown(simmodel.Span{From: s.base + f.At.Milliseconds(), To: s.base + (f.At + f.For).Milliseconds()})
		}
	}
	for _, r := range s.regions {
		for j := range c.Nodes {
			if err := s.addNode(r, j); err != nil {
				return err
			}
		}
	}
	return nil
}

// jittered is a round trip of about ms: statements vary by ±10 % or so.
func jittered(ms float64) simmodel.Dist { return simmodel.Dist{Median: ms, P99: ms * 1.25} }

func (s *sim) addNode(r *region, j int) error {
	c := s.cfg
	n := &node{index: len(s.nodes), id: fmt.Sprintf("%s-n%02d", r.name, j), region: r}
	n.slow = int64(n.index/int(slowTickMs/fastTickMs)) % (slowTickMs / fastTickMs)
	n.beat = int64(n.index) % (heartbeatMs / slowTickMs)
	// The read timeout is the engine's one bound on the wall clock: how
	// long a decision waits for a read's goroutine. Reads here are in
	// memory and the model fails those slower than the real timeout in
	// simulated time, so the wait is made long enough that a stalled
	// machine (a collection of a large heap) never decides differently.
	n.eng = engine.New(engine.Config{Now: s.clk.Now, Manual: true, ReadTimeout: time.Hour})
	now := s.clk.UnixMilli
	gate := func() *simmodel.Gate {
		return simmodel.NewGate(now, origin.DefaultBreakerInterval, origin.DefaultBreakerTimeout,
			origin.DefaultBreakerMinRequests, origin.DefaultBreakerFailureRatio)
	}
	n.requests, n.replay = gate(), gate()
	n.eng.SetOrigin(breakerOrigin{Origin: r.redis.Origin(n.id), requests: n.requests, replay: n.replay})
	// The fleet started before the run: every node's record is in the
	// region's set, and the engine counts them all; the heartbeats of the
	// run keep the count (replay).
	n.eng.SetProcesses(int64(c.Nodes))
	_, _ = r.redis.Heartbeat(n.id, heartbeatLapseMs, heartbeatMs)
	n.beatOK = s.base
	n.zone = n.eng.Zone(Namespace, c.Window)
	def := propagation.Config{}.WithDefaults()
	cfg := propagation.Config{
		DSN: "sim", Region: r.name,
		Flush: c.Flush, GlobalSync: c.GlobalSync, BlocklistSync: c.BlocklistSync,
		PublishFloor: c.PublishFloor, Batch: c.Batch, MinWindow: c.MinWindow,
	}
	if r.index > 0 && !c.NoReplicas {
		cfg.ReadDSN = "sim-replica"
	}
	n.gate = simmodel.NewGate(now, def.Breaker.Interval, def.Breaker.Timeout, def.Breaker.MinRequests, def.Breaker.FailureRatio)
	p, err := propagation.New(cfg, n.eng, propagation.Options{
		Now:       s.clk.Now,
		Region:    r.redis.Region(n.id, &n.tick),
		Store:     s.mysql.Client(r.index, &n.tick),
		WriteGate: n.gate.Do,
	})
	if err != nil {
		return err
	}
	if err := p.MigrateOnce(bg); err != nil {
		return err
	}
	n.prop = p
	n.eng.SetGlobal(p)
	r.nodes = append(r.nodes, n)
	s.nodes = append(s.nodes, n)
	return nil
}

// jitter spreads d by ±20 %, as the layer's loops do.
func (s *sim) jitter(d time.Duration) int64 {
	f := 0.8 + 0.4*s.loops.Float64()
	return int64(math.Round(float64(d.Milliseconds()) * f))
}
