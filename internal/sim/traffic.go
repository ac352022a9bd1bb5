package sim

import (
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"strconv"
)

// Traffic: each source yields its requests in time order; the event loop
// merges them. Hot keys come from one fluid source per key and region
// (arrivals spaced by the inverse of the rate, so a window is offered
// exactly its share), background and cold keys from one Poisson source
// each. Where a request lands among a region's nodes is drawn uniformly,
// as a load balancer spreads it.

// request is one request of the simulation.
type request struct {
	at     int64 // Unix ms
	key    int32 // see keyspace
	region int32
	node   int32
}

// source yields requests in time order; ok is false when it is done.
type source interface {
	next() (r request, ok bool)
}

// keyspace names keys: [0, hot) are the hot keys, [hot, keys) the
// background keys, keys + n the n-th cold key or trace key.
type keyspace struct {
	hot, keys int
	names     []string
	extra     []string // trace keys by index − keys
}

func newKeyspace(hot, keys int) *keyspace {
	ks := &keyspace{hot: hot, keys: keys, names: make([]string, keys)}
	for i := range keys {
		if i < hot {
			ks.names[i] = "h" + strconv.Itoa(i)
		} else {
			ks.names[i] = "b" + strconv.Itoa(i-hot)
		}
	}
	return ks
}

// name is key i's identifier.
func (ks *keyspace) name(i int32) string {
	switch {
	case int(i) < ks.keys:
		return ks.names[i]
	case int(i)-ks.keys < len(ks.extra):
		return ks.extra[int(i)-ks.keys]
	}
	return "c" + strconv.Itoa(int(i)-ks.keys)
}

// isHot reports whether i is a hot key (or a trace key: both are
// measured per window).
func (ks *keyspace) isHot(i int32) bool {
	return int(i) < ks.hot || (int(i) >= ks.keys && int(i)-ks.keys < len(ks.extra))
}

// spread says how a key's traffic falls over the regions at a time.
type spread struct {
	scenario Scenario
	regions  int
	duration float64 // ms, the moving peak's period
	zipf     []float64
	phase    []float64 // per key, the moving peak's start
	sigma    float64
	norm     float64
}

func newSpread(s Scenario, regions int, duration float64, keys int, rng *rand.Rand) *spread {
	sp := &spread{scenario: s, regions: regions, duration: duration, sigma: max(float64(regions)/8, 0.5)}
	h := 0.0
	for i := range regions {
		h += 1 / float64(i+1)
	}
	sp.zipf = make([]float64, regions)
	acc := 0.0
	for i := range regions {
		acc += 1 / float64(i+1) / h
		sp.zipf[i] = acc
	}
	if s == Moving {
		sp.phase = make([]float64, keys)
		for i := range sp.phase {
			sp.phase[i] = rng.Float64()
		}
		for r := range regions {
			sp.norm += sp.gauss(float64(r), 0)
		}
	}
	return sp
}

// gauss is the moving peak's weight at region r when it stands at c.
func (sp *spread) gauss(r, c float64) float64 {
	d := math.Abs(r - c)
	d = math.Min(d, float64(sp.regions)-d)
	return math.Exp(-d * d / (2 * sp.sigma * sp.sigma))
}

// center is where key k's moving peak stands at t (ms from the start).
func (sp *spread) center(k int, t float64) float64 {
	f := sp.phase[k%len(sp.phase)] + t/sp.duration
	return (f - math.Floor(f)) * float64(sp.regions)
}

// weight is region r's share of key k's traffic at t (ms from the start).
func (sp *spread) weight(k, r int, t float64) float64 {
	switch sp.scenario {
	case Skewed:
		j := ((r-k)%sp.regions + sp.regions) % sp.regions
		lo := 0.0
		if j > 0 {
			lo = sp.zipf[j-1]
		}
		return sp.zipf[j] - lo
	case Moving:
		return sp.gauss(float64(r), sp.center(k, t)) / sp.norm
	}
	return 1 / float64(sp.regions)
}

// pick draws a region for a request of key k at t.
func (sp *spread) pick(k int, t float64, rng *rand.Rand) int {
	switch sp.scenario {
	case Skewed:
		j := sort.SearchFloat64s(sp.zipf, rng.Float64())
		return (k + min(j, sp.regions-1)) % sp.regions
	case Moving:
		c := sp.center(k, t) + sp.sigma*rng.NormFloat64()
		r := int(math.Round(c)) % sp.regions
		return (r + sp.regions) % sp.regions
	}
	return rng.IntN(sp.regions)
}

// fluid is one hot key's traffic in one region: arrivals at the rate of
// the moment, exactly spaced.
type fluid struct {
	key, region int
	nodes       int
	base        int64
	t, end      float64 // ms from the start
	phase       float64
	rate        func(t float64) float64 // requests per ms
	rng         *rand.Rand
}

func (f *fluid) next() (request, bool) {
	for f.t < f.end {
		if r := f.rate(f.t); r > 0 {
			if need := (1 - f.phase) / r; need <= 1000 {
				f.t += max(need, 0)
				f.phase = 0
				if f.t >= f.end {
					break
				}
				return request{at: f.base + int64(f.t), key: int32(f.key), region: int32(f.region), node: int32(f.rng.IntN(f.nodes))}, true
			}
			f.phase += r * 1000
		}
		// Slow or idle: move a second on, keeping the phase.
		f.t += 1000
	}
	return request{}, false
}

// burst is one hot key's bursts: once a window, at a region drawn at
// random, from a time in the window's first half to its end.
type burst struct {
	key, regions, nodes int
	base                int64
	window, end         float64
	rate                float64 // per ms
	w                   int     // the current window
	t, stop             float64
	region              int
	rng                 *rand.Rand
}

func (b *burst) next() (request, bool) {
	for {
		if b.t < b.stop {
			at := b.t
			b.t += 1 / b.rate
			if at >= b.end {
				return request{}, false
			}
			return request{at: b.base + int64(at), key: int32(b.key), region: int32(b.region), node: int32(b.rng.IntN(b.nodes))}, true
		}
		start := float64(b.w) * b.window
		if start >= b.end {
			return request{}, false
		}
		b.region = b.rng.IntN(b.regions)
		b.t = start + b.rng.Float64()*b.window/2
		b.stop = start + b.window
		b.w++
	}
}

// poisson is the background: requests at a constant total rate, each to
// a key drawn by popularity and a region drawn by the key's spread.
type poisson struct {
	base      int64
	t, end    float64
	rate      float64 // per ms
	nodes     int
	sp        *spread
	key       func() int // the next key
	rng       *rand.Rand
	keyOffset int // the spread's key index of key 0
}

func (p *poisson) next() (request, bool) {
	p.t += -math.Log(1-p.rng.Float64()) / p.rate
	if p.t >= p.end {
		return request{}, false
	}
	k := p.key()
	r := p.sp.pick(k+p.keyOffset, p.t, p.rng)
	return request{at: p.base + int64(p.t), key: int32(k), region: int32(r), node: int32(p.rng.IntN(p.nodes))}, true
}

// popularity draws background keys: P(rank i) ∝ 1/(i + 1 + s), with the
// shift s set so that the busiest key gets at most cap requests a second
// of a total of rate (a Zipf–Mandelbrot law).
type popularity struct {
	cdf []float64
}

func newPopularity(n int, rate, capRate float64) *popularity {
	weights := func(s float64) (first, sum float64) {
		for i := range n {
			sum += 1 / (float64(i) + 1 + s)
		}
		return 1 / (1 + s), sum
	}
	share := func(s float64) float64 { f, sum := weights(s); return f / sum }
	s := 0.0
	if rate > 0 && share(0)*rate > capRate {
		lo, hi := 0.0, 1e9
		for range 60 {
			mid := (lo + hi) / 2
			if share(mid)*rate > capRate {
				lo = mid
			} else {
				hi = mid
			}
		}
		s = hi
	}
	_, sum := weights(s)
	p := &popularity{cdf: make([]float64, n)}
	acc := 0.0
	for i := range n {
		acc += 1 / (float64(i) + 1 + s) / sum
		p.cdf[i] = acc
	}
	return p
}

func (p *popularity) draw(rng *rand.Rand) int {
	return min(sort.SearchFloat64s(p.cdf, rng.Float64()), len(p.cdf)-1)
}

// trace is an explicit list of requests.
type trace struct {
	reqs []request
	i    int
}

func (t *trace) next() (request, bool) {
	if t.i >= len(t.reqs) {
		return request{}, false
	}
	t.i++
	return t.reqs[t.i-1], true
}

// traffic makes the sources of the scenario (or of the explicit trace).
func (s *sim) traffic() {
	c := s.cfg
	stream := func(n uint64) *rand.Rand { return rand.New(rand.NewPCG(c.Seed, 0x7a11c+n)) }
	defer func() { s.pending = make([]request, len(s.sources)) }()
	if c.Requests != nil {
		index := map[string]int32{}
		for i, k := range s.ks.extra {
			index[k] = int32(s.ks.keys + i)
		}
		reqs := make([]request, len(c.Requests))
		for i, r := range c.Requests {
			reqs[i] = request{at: s.base + r.At.Milliseconds(), key: index[r.Key], region: int32(r.Region), node: int32(r.Node)}
		}
		slices.SortStableFunc(reqs, func(a, b request) int { return int(a.at - b.at) })
		s.sources = append(s.sources, &trace{reqs: reqs})
		return
	}
	dur := float64(c.Duration.Milliseconds())
	sp := newSpread(c.Scenario.spread(), c.Regions, dur, c.Keys, stream(1))
	perMs := float64(c.Limit) / float64(c.Window.Milliseconds())
	load := c.Load
	if c.Scenario == Abuse {
		load *= 10
	}
	phases := stream(2)
	for k := range c.Hot {
		if c.Scenario == Burst {
			s.sources = append(s.sources, &burst{key: k, regions: c.Regions, nodes: c.Nodes, base: s.base,
				window: float64(c.Window.Milliseconds()), end: dur, rate: 10 * perMs, rng: stream(uint64(10 + k))})
			continue
		}
		for r := range c.Regions {
			total := load * perMs
			rate := func(t float64) float64 { return total * sp.weight(k, r, t) }
			s.sources = append(s.sources, &fluid{key: k, region: r, nodes: c.Nodes, base: s.base, end: dur,
				phase: phases.Float64(), rate: rate, rng: stream(uint64(10 + k*c.Regions + r))})
		}
	}
	if c.Background <= 0 {
		return
	}
	rng := stream(3)
	bgs := &poisson{base: s.base, end: dur, rate: c.Background / 1000, nodes: c.Nodes, sp: sp, rng: rng}
	switch n := c.Keys - c.Hot; {
	case c.Scenario == Cold:
		next := s.ks.keys
		bgs.key = func() int { next++; return next - 1 }
	case n > 0:
		pop := newPopularity(n, c.Background, 0.5*perMs*1000)
		bgs.key = func() int { return c.Hot + pop.draw(rng) }
	default:
		return
	}
	s.sources = append(s.sources, bgs)
}
