package sim

import (
	"context"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

var bg = context.Background()

// epoch is where simulated time starts, rounded up to a window: a fixed
// date, so that runs do not depend on the day they run.
const epoch = int64(1_800_000_000_000)

const (
	evMeasure kind = iota + 100 // the measured span begins or ends
)

type sim struct {
	cfg       Config
	clk       *testclock.Clock
	base, end int64
	q         queue
	regions   []*region
	nodes     []*node
	phases    [][]*node
	mysql     *simmodel.MySQL
	ks        *keyspace
	m         *measure
	sources   []source
	pending   []request
	loops     *rand.Rand // the loops' jitter
	measuring bool
	span      [2]snapshot
}

// snapshot is what every region had cost at one time.
type snapshot struct {
	redis []simmodel.RedisCost
	mysql []simmodel.MySQLCost
}

// Run simulates cfg and returns what it measured.
func Run(cfg Config) (*Result, error) {
	cfg = cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	w := cfg.Window.Milliseconds()
	s := &sim{cfg: cfg, base: (epoch + w - 1) / w * w, loops: rand.New(rand.NewPCG(cfg.Seed, 0x10095))}
	s.end = s.base + cfg.Duration.Milliseconds()
	s.clk = testclock.New(time.UnixMilli(s.base))
	s.ks = newKeyspace(cfg.Hot, cfg.Keys)
	if cfg.Requests != nil {
		s.ks.hot = 0
		s.traceKeys()
	}
	s.m = newMeasure(s.ks, cfg.Limit, cfg.Window, cfg.Regions)
	if err := s.build(); err != nil {
		return nil, err
	}
	s.traffic()
	s.schedule()
	s.loop()
	return s.result(), nil
}

// key is key i as the engine names it.
func (s *sim) key(i int32) engine.Key {
	return engine.Key{Namespace: Namespace, Identifier: s.ks.name(i), Window: s.cfg.Window}
}

// schedule puts the first tick of every loop in the queue.
func (s *sim) schedule() {
	c := s.cfg
	s.phases = make([][]*node, fastTickMs)
	for _, n := range s.nodes {
		p := int64(n.index) % fastTickMs
		s.phases[p] = append(s.phases[p], n)
	}
	for p := range s.phases {
		if len(s.phases[p]) > 0 {
			s.q.push(s.base+int64(p)+1, evReplay, p)
		}
	}
	for _, n := range s.nodes {
		s.q.push(s.base+s.jitter(c.Flush), evFlush, n.index)
		s.q.push(s.base+s.jitter(c.GlobalSync), evGlobalSync, n.index)
		s.q.push(s.base+s.jitter(c.BlocklistSync), evBlocklistSync, n.index)
		s.q.push(s.base+s.jitter(5*time.Second), evCleanup, n.index)
		s.q.push(s.base+sweepMs*int64(n.index%10+1)/10, evSweep, n.index)
	}
	for _, f := range c.faults() {
		if f.Kind == RedisOutage && f.Empty {
			s.q.push(s.base+(f.At+f.For).Milliseconds(), evFault, f.Region)
		}
	}
	w := c.Window.Milliseconds()
	s.q.push(s.base+w, evWindow, 0)
	s.q.push(s.base+2*w-1000, evWindow, 1)
	from, to := s.base, s.end
	if c.Measure != (simmodel.Span{}) {
		from, to = s.base+c.Measure.From, s.base+c.Measure.To
	}
	s.q.push(from, evMeasure, 0)
	s.q.push(to, evMeasure, 1)
	for i, src := range s.sources {
		if r, ok := src.next(); ok {
			s.pending[i] = r
			s.q.push(r.at, evRequest, i)
		}
	}
}

// loop runs the events until the end.
func (s *sim) loop() {
	for {
		e, ok := s.q.pop()
		if !ok || e.at > s.end {
			break
		}
		s.clk.Set(time.UnixMilli(e.at))
		switch e.kind {
		case evRequest:
			s.request(int(e.idx))
		case evReplay:
			s.replay(e.at, int(e.idx))
		case evFlush, evGlobalSync, evBlocklistSync, evCleanup:
			s.propagate(e)
		case evSweep:
			s.nodes[e.idx].eng.Sweep()
			s.q.push(e.at+sweepMs, evSweep, int(e.idx))
		case evFault:
			// A Redis outage's end, where Redis comes back empty.
			s.regions[e.idx].redis.Restart()
		case evWindow:
			s.window(e)
		case evMeasure:
			s.snap(int(e.idx))
		}
	}
	if s.measuring {
		s.snap(1)
	}
}

// request decides the next request of source i.
func (s *sim) request(i int) {
	req := s.pending[i]
	r := s.regions[req.region]
	n := r.nodes[req.node]
	d := n.eng.Decide(bg, engine.Limit{Key: s.key(req.key), Zone: n.zone, Limit: s.cfg.Limit, Cost: 1})
	if s.measuring {
		r.requests++
		if d.Allowed {
			r.admitted++
		}
	}
	s.m.record(req, d.Allowed, s.arm)
	if next, ok := s.sources[i].next(); ok {
		s.pending[i] = next
		s.q.push(next.at, evRequest, i)
	}
}

// arm looks at every other region's view of a key that just denied for
// the first time in window k.seq at region first.
func (s *sim) arm(k winKey, first int) {
	now := s.clk.UnixMilli()
	id := simmodel.CellID{Key: s.key(k.key), Seq: k.seq}
	for i, r := range s.regions {
		if i == first {
			continue
		}
		cur, _ := r.redis.Cell(id)
		s.m.view(i, id, cur, now)
	}
}

// replay runs the replay ticks of the nodes of one phase; on their slow
// tick the origin's check of Redis's run ID (the restart watch, whose
// answer closes the origin's open breakers, and whose new run ID sends
// every cell again) and the node's look at the
// region's runtime overrides (overrides_sync.go), and every tenth slow
// tick its heartbeat and the restart watch's read of its mark.
func (s *sim) replay(at int64, phase int) {
	tick := (at - s.base) / fastTickMs
	for _, n := range s.phases[phase] {
		_, _ = n.eng.ReplayOnce(bg, engine.Fast)
		if tick%(slowTickMs/fastTickMs) == n.slow {
			_, _ = n.eng.ReplayOnce(bg, engine.Slow)
			if id, err := n.region.redis.Info(); err == nil {
				// The restart watch heard Redis: the breakers close; a new
				// run ID (Redis restarted empty) sends every cell the node
				// holds again, and the layer registers its cells and sends
				// its imports again (redis.go).
				if id != n.runID {
					n.runID = id
					n.eng.Resend()
					n.prop.RegionLost()
				}
				n.requests.Heard(at)
				n.replay.Heard(at)
			}
			_ = n.region.redis.OverridesState()
			if slow := tick / (slowTickMs / fastTickMs); slow%(heartbeatMs/slowTickMs) == n.beat {
				s.heartbeat(n, at)
				n.region.redis.Mark()
			}
		}
	}
	s.q.push(at+fastTickMs, evReplay, phase)
}

// heartbeat renews n's record among its region's processes and tells its
// engine how many there are, as redis.go does: a node that could not
// renew for a lapse counts none (0: the engine decides young cells as it
// does without the count) until a renewal succeeds.
func (s *sim) heartbeat(n *node, at int64) {
	count, err := n.region.redis.Heartbeat(n.id, heartbeatLapseMs, heartbeatMs)
	switch {
	case err == nil:
		n.beatOK, n.lost = at, false
		n.eng.SetProcesses(count)
	case !n.lost && at-n.beatOK >= heartbeatLapseMs:
		n.lost = true
		n.eng.SetProcesses(0)
	}
}

// propagate runs one of a node's cross-region ticks; the next starts a
// jittered interval after it ends, as the layer's loops do.
func (s *sim) propagate(e event) {
	n := s.nodes[e.idx]
	n.tick.Begin(e.at)
	var every time.Duration
	switch e.kind {
	case evFlush:
		n.prop.FlushOnce(bg)
		every = s.cfg.Flush
	case evGlobalSync:
		n.prop.GlobalSyncOnce(bg)
		every = s.cfg.GlobalSync
	case evBlocklistSync:
		n.prop.BlocklistSyncOnce(bg)
		every = s.cfg.BlocklistSync
	case evCleanup:
		n.prop.CleanupOnce(bg)
		every = time.Minute
	}
	s.q.push(max(n.tick.At(), e.at)+s.jitter(every), e.kind, int(e.idx))
}

// window runs at a window's end (idx 0: Redis expires its old cells) and
// a second before the end of the window after (idx 1: the window before
// both is checked while its cells still exist).
func (s *sim) window(e event) {
	w := s.cfg.Window.Milliseconds()
	if e.idx == 0 {
		for _, r := range s.regions {
			r.redis.Expire()
		}
		s.q.push(e.at+w, evWindow, 0)
		return
	}
	seq := (e.at+1000)/w - 2
	s.m.check(seq, s)
	s.q.push(e.at+w, evWindow, 1)
}

// snap takes the costs at the start (0) or the end (1) of the measured
// span.
func (s *sim) snap(i int) {
	var sn snapshot
	for _, r := range s.regions {
		sn.redis = append(sn.redis, r.redis.Cost())
		sn.mysql = append(sn.mysql, s.mysql.Cost(r.index))
	}
	s.span[i] = sn
	s.measuring = i == 0
	if i == 0 {
		s.span[1] = snapshot{}
	}
}

// traceKeys names the keys of an explicit trace.
func (s *sim) traceKeys() {
	seen := map[string]bool{}
	for _, r := range s.cfg.Requests {
		if !seen[r.Key] {
			seen[r.Key] = true
			s.ks.extra = append(s.ks.extra, r.Key)
		}
	}
	slices.Sort(s.ks.extra)
}
