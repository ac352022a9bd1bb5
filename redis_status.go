package ratelimit

import (
	"maps"
	"slices"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/edgelimit/caddy-ratelimit/origin"
)

// What operators see of the Redis backend: the status's origin section and
// the origin's metrics (calls and their durations by endpoint, breaker
// states and transitions, slow calls, restarts).

// endpointStats are one origin endpoint's numbers, labelled by endpoint.
var endpointStats = statSet[origin.EndpointStats]{labels: []string{"endpoint"}, stats: []stat[origin.EndpointStats]{
	// Address has scheme, hosts, port and database: never credentials.
	{json: "address", value: func(s *origin.EndpointStats) any { return s.Address }},
	{json: "kind", value: func(s *origin.EndpointStats) any { return s.Kind }},
	{json: "breaker", value: func(s *origin.EndpointStats) any { return s.Breaker }},
	{json: "replay_breaker", value: func(s *origin.EndpointStats) any { return s.ReplayBreaker }},
	{json: "calls", value: func(s *origin.EndpointStats) any { return s.Calls }},
	{json: "round_trips", value: func(s *origin.EndpointStats) any { return s.RoundTrips }},
	{json: "slow_calls", metric: "origin_slow_calls_total", value: func(s *origin.EndpointStats) any { return s.SlowCalls },
		help: "Request-path calls to an endpoint that answered slower than breaker_slow_call (each a failure for its breaker)."},
	{json: "last_read", value: func(s *origin.EndpointStats) any { return s.LastRead }},
	{json: "last_flush", value: func(s *origin.EndpointStats) any { return s.LastFlush }},
	// Why the last failed call failed: what Redis answered (READONLY, OOM,
	// WRONGPASS…) or what the connection did; never credentials.
	{json: "last_error", value: func(s *origin.EndpointStats) any { return s.LastError }},
	{json: "last_error_at", value: func(s *origin.EndpointStats) any { return s.LastErrorAt }},
}}

// originStats are the origin's own numbers.
var originStats = statSet[origin.Stats]{stats: []stat[origin.Stats]{
	{json: "restarts", metric: "origin_restarts_total", value: func(s *origin.Stats) any { return s.Restarts },
		help: "Redis servers seen restarted (their run ID changed), emptied (FLUSHALL, FLUSHDB: their mark key is gone) or failed over (in a Cluster, a master that was not one at the last check), after each of which every live key's count is sent again."},
	{json: "override_notices", metric: "origin_override_notices", gauge: true, value: func(s *origin.Stats) any { return s.OverrideNotices },
		help: "1 while this node is subscribed to the region's notices of runtime override changes (it checks the region's change counter each slow_tick), 0 while not (each fast_tick)."},
	{json: "processes", metric: "origin_processes", gauge: true, value: func(s *origin.Stats) any { return s.Processes },
		help: "The region's processes that share this Redis, this one included, as their records in it counted them at this node's last heartbeat (every second; 0 before one answered and after 5 s of failures): a young key (one that has not heard from Redis since the processes that met it with this node registered) counts that many near its limit."},
	{json: "builds", value: func(s *origin.Stats) any { return buildsDoc(s.Builds) }},
	{metric: "origin_builds", gauge: true, value: func(s *origin.Stats) any { return int64(len(s.Builds)) },
		help: "How many builds of the module the region's processes run, as their records in Redis name them (read every 30 s; 0 before the first read): more than 1 in a deploy, and after it when a node was left behind."},
	{json: "clock_offset_ms", metric: "origin_clock_offset_ms", gauge: true, value: func(s *origin.Stats) any { return s.ClockOffsetMs },
		help: "Redis's clock less this node's, in milliseconds, as its heartbeats measured it (every second; 0 within 50 ms, and before one answered): this node decides on its own clock plus this, so that the region's nodes count in the same windows whatever their own clocks say. Far from 0, this node's clock (or Redis's) is off: check NTP."},
}}

// redisStatus is the status's origin section: null when local-only.
func redisStatus(st *state) any {
	o := st.currentOrigin()
	if o == nil {
		return nil
	}
	s := o.Stats()
	doc := new(object)
	eps := make([]*object, len(s.Endpoints))
	for i := range s.Endpoints {
		eps[i] = endpointStats.section(&s.Endpoints[i])
	}
	doc.set("endpoints", eps)
	own := originStats.section(&s)
	for _, k := range own.keys {
		doc.set(k, own.vals[k])
	}
	base, _ := otherOrigins(o)
	doc.set("restarts", s.Restarts+uint64(base[restartsStat]))
	return doc
}

// restartsStat is the index of origin_restarts_total in originStats.
var restartsStat = slices.IndexFunc(originStats.stats, func(s stat[origin.Stats]) bool { return s.json == "restarts" })

// origins keeps the metrics monotonic across reloads, each of which makes
// a new origin (a reload once took origin_restarts_total back to 0): an
// origin's counters are read from it while its config is started, and
// added to the retired totals when it closes, so each counts once
// throughout, however the configs overlap.
var origins = struct {
	sync.Mutex
	live map[*origin.Redis]struct{}
	// base and endpoints are the retired totals, the origin's own and
	// each endpoint's by its address.
	base      []float64
	endpoints map[string][]float64
}{live: map[*origin.Redis]struct{}{}, base: make([]float64, len(originStats.stats)), endpoints: map[string][]float64{}}

// startedOrigin counts o among the live origins.
func startedOrigin(o *origin.Redis) {
	origins.Lock()
	defer origins.Unlock()
	origins.live[o] = struct{}{}
}

// retireOrigin moves a closing origin's counters to the retired totals.
func retireOrigin(o *origin.Redis) {
	origins.Lock()
	defer origins.Unlock()
	if _, ok := origins.live[o]; !ok {
		return
	}
	delete(origins.live, o)
	s := o.Stats()
	origins.base = originStats.retire(&s, origins.base)
	for i := range s.Endpoints {
		ep := &s.Endpoints[i]
		origins.endpoints[ep.Address] = endpointStats.retire(ep, origins.endpoints[ep.Address])
	}
}

// others returns the counters of every origin but cur, the retired and
// the live ones added up: the origin's own, and each endpoint's by
// address.
func otherOrigins(cur originView) ([]float64, map[string][]float64) {
	origins.Lock()
	defer origins.Unlock()
	base := slices.Clone(origins.base)
	eps := make(map[string][]float64, len(origins.endpoints))
	for a, b := range origins.endpoints {
		eps[a] = slices.Clone(b)
	}
	for o := range origins.live {
		if originView(o) == cur {
			continue
		}
		s := o.Stats()
		base = originStats.retire(&s, base)
		for i := range s.Endpoints {
			ep := &s.Endpoints[i]
			eps[ep.Address] = endpointStats.retire(ep, eps[ep.Address])
		}
	}
	return base, eps
}

var (
	originCallsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: metricName("origin_calls_total"),
		Help: "Calls to the regional origin (Redis) per endpoint, by operation (read, flush, reserve) and outcome (ok, error, timeout, rejected by the breaker).",
	}, []string{"endpoint", "op", "outcome"})

	originCallSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    metricName("origin_call_duration_seconds"),
		Help:    "Duration of calls to the regional origin, batching included, by operation and outcome.",
		Buckets: originBuckets,
	}, []string{"op", "outcome"})

	breakerTransitionsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: metricName("origin_breaker_transitions_total"),
		Help: "Circuit breaker state changes per origin endpoint and breaker (ratelimit_origin: the request path; ratelimit_origin_replay: replay), by the state entered (open, half-open, closed).",
	}, []string{"endpoint", "breaker", "state"})

	descBreakerState = newDesc("origin_breaker_state",
		"1 for the state each origin endpoint's circuit breakers are in (closed, half-open, open), 0 for the others; breaker ratelimit_origin guards the request path, ratelimit_origin_replay replay.", "endpoint", "breaker", "state")

	breakerStates = []origin.BreakerState{origin.BreakerClosed, origin.BreakerHalfOpen, origin.BreakerOpen}

	// originCollectors are the Redis backend's metrics.
	originCollectors = []prometheus.Collector{originCallsTotal, originCallSeconds, breakerTransitionsTotal, redisCollector{}}
)

// originBuckets run from 100 µs (a pipelined round trip on loopback) to 1 s
// (beyond any call timeout).
var originBuckets = []float64{
	100e-6, 250e-6, 500e-6,
	1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1,
}

// redisCollector exports the origin's state at scrape time.
type redisCollector struct{}

// Describe implements prometheus.Collector.
func (redisCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range append(append(endpointStats.descs(), originStats.descs()...), descBreakerState) {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (redisCollector) Collect(ch chan<- prometheus.Metric) {
	st := lookupState()
	if st == nil {
		return
	}
	o := st.currentOrigin()
	if o == nil {
		return
	}
	s := o.Stats()
	base, eps := otherOrigins(o)
	originStats.collect(ch, &s, base)
	for i := range s.Endpoints {
		ep := &s.Endpoints[i]
		endpointStats.collect(ch, ep, eps[ep.Address], ep.Address)
		for _, b := range []struct {
			name  string
			state origin.BreakerState
		}{{origin.BreakerName, ep.Breaker}, {origin.ReplayBreakerName, ep.ReplayBreaker}} {
			for _, bs := range breakerStates {
				v := 0.0
				if b.state == bs {
					v = 1
				}
				ch <- prometheus.MustNewConstMetric(descBreakerState, prometheus.GaugeValue, v, ep.Address, b.name, string(bs))
			}
		}
	}
}

// originCallMetrics caches the resolved series of one endpoint: origin
// calls can be on the request path (a synchronous read), so they too do no
// label lookup after an endpoint's first call.
type originCallMetrics struct {
	calls [numOriginOps][numOriginOutcomes]prometheus.Counter
}

// The origin's ops and outcomes, as the label values index them.
const (
	numOriginOps      = int(origin.OpReserve) + 1
	numOriginOutcomes = int(origin.OutcomeRejected) + 1
)

var (
	originEndpointMetrics sync.Map // endpoint address → *originCallMetrics
	originDurations       = func() (o [numOriginOps][numOriginOutcomes]prometheus.Observer) {
		for op := range numOriginOps {
			for oc := range numOriginOutcomes {
				o[op][oc] = originCallSeconds.WithLabelValues(origin.Op(op).String(), origin.Outcome(oc).String())
			}
		}
		return o
	}()
)

func endpointMetrics(endpoint string) *originCallMetrics {
	if m, ok := originEndpointMetrics.Load(endpoint); ok {
		return m.(*originCallMetrics)
	}
	m := new(originCallMetrics)
	for op := range numOriginOps {
		for oc := range numOriginOutcomes {
			m.calls[op][oc] = originCallsTotal.WithLabelValues(endpoint, origin.Op(op).String(), origin.Outcome(oc).String())
		}
	}
	actual, _ := originEndpointMetrics.LoadOrStore(endpoint, m)
	return actual.(*originCallMetrics)
}

// observeOriginCall counts one origin call and its duration.
func observeOriginCall(ci origin.CallInfo) {
	op, oc := int(ci.Op), int(ci.Outcome)
	if op >= numOriginOps || oc >= numOriginOutcomes {
		return
	}
	endpointMetrics(ci.Endpoint).calls[op][oc].Inc()
	originDurations[op][oc].Observe(ci.Duration.Seconds())
}

// observeBreakerChange counts a breaker transition.
func observeBreakerChange(endpoint, breaker string, to origin.BreakerState) {
	breakerTransitionsTotal.WithLabelValues(endpoint, breaker, string(to)).Inc()
}

// Interface guards.
var _ prometheus.Collector = redisCollector{}

// buildDoc is one build of the region's processes in the status: its
// name ("" for a build before 2026-11-28, which names none) and how many
// processes run it.
type buildDoc struct {
	Build     string `json:"build"`
	Processes int64  `json:"processes"`
}

// buildsDoc lists the builds in the order of their names; nil (null)
// before the first read.
func buildsDoc(builds map[string]int64) []buildDoc {
	if builds == nil {
		return nil
	}
	out := make([]buildDoc, 0, len(builds))
	for _, b := range slices.Sorted(maps.Keys(builds)) {
		out = append(out, buildDoc{b, builds[b]})
	}
	return out
}
