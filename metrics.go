package ratelimit

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/edgelimit/caddy-ratelimit/origin"
)

// The collectors live at package level: Caddy makes a new metrics registry
// for every config it loads, and a collector made per config would start
// from zero at every reload (or vanish with the old registry). Each config
// registers the same collectors into its own registry instead.
//
// No metric has an identifier label: identifiers are unbounded and often
// secret. Labels are zones, results, origin operations, outcomes and
// endpoint addresses, all bounded by the configuration.

const (
	metricsNamespace = "caddy"
	metricsSubsystem = "ratelimit"
)

// Results of a zone's decision, the values of the decisions' result label.
const (
	// resultAllowed: the request passed and was charged to the zone.
	resultAllowed = "allowed"
	// resultDenied: the zone denied the request (429).
	resultDenied = "denied"
	// resultDryRunDenied: the zone would have denied the request; dry_run
	// served and charged it.
	resultDryRunDenied = "dry_run_denied"
	// resultSkipped: the key was empty and on_missing_key is skip.
	resultSkipped = "skipped"
	// resultNotCharged: the zone admitted the request but another zone of
	// the same directive denied it, so nothing was charged.
	resultNotCharged = "not_charged"
	// resultMissingKey: the key was empty and on_missing_key is deny.
	resultMissingKey = "missing_key"
)

// latencySampleMask makes one decision in 32 timed. A pair of time.Now
// calls costs about as much as a warm decision itself on a virtual machine
// (measured: 80–130 ns against a ~240 ns request), and a sample of one in
// 32 describes the distribution just as well at any real request rate.
const latencySampleMask = 31

// decisionBuckets run from 100 ns (a warm local decision) to 100 ms (a
// decision that waited out a slow origin read, whose timeout defaults to
// 50 ms).
var decisionBuckets = []float64{
	100e-9, 250e-9, 500e-9,
	1e-6, 2.5e-6, 5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6,
	1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3,
}

// originBuckets run from 100 µs (a pipelined round trip on loopback) to 1 s
// (beyond any call timeout).
var originBuckets = []float64{
	100e-6, 250e-6, 500e-6,
	1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1,
}

func metricName(name string) string {
	return prometheus.BuildFQName(metricsNamespace, metricsSubsystem, name)
}

var (
	decisionsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: metricName("decisions_total"),
		Help: "Decisions per zone by result: allowed, denied, dry_run_denied, skipped, not_charged (another zone of the directive denied), missing_key (on_missing_key deny).",
	}, []string{"zone", "result"})

	decisionSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    metricName("decision_duration_seconds"),
		Help:    "Time the engine took to decide a request (all zones of a directive together), origin reads included; sampled, one decision in 32.",
		Buckets: decisionBuckets,
	}, []string{"result"})

	invalidCostsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: metricName("invalid_costs_total"),
		Help: "Requests whose cost placeholder was not a non-negative integer and were charged the zone's default cost.",
	}, []string{"zone"})

	clampedCostsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: metricName("clamped_costs_total"),
		Help: "Requests whose cost placeholder evaluated to an integer outside the zone's [min_cost, max_cost] and were charged the bound (bound: min, max).",
	}, []string{"zone", "bound"})

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

	// engineMetrics reads the pooled engine (and origin) at scrape time.
	engineMetrics = new(engineCollector)
)

// collectors are what every config registers.
var collectors = []prometheus.Collector{
	decisionsTotal, decisionSeconds, invalidCostsTotal, clampedCostsTotal,
	originCallsTotal, originCallSeconds, breakerTransitionsTotal,
	engineMetrics,
}

// The latency observers, resolved once: an observation on the request path
// does no label lookup.
var (
	decisionAllowedSeconds = decisionSeconds.WithLabelValues(resultAllowed)
	decisionDeniedSeconds  = decisionSeconds.WithLabelValues(resultDenied)
)

// registerMetrics registers every collector into reg, a config's registry.
// A collector already there (another handler of the same config registered
// it) is success.
func registerMetrics(reg *prometheus.Registry) error {
	if reg == nil {
		return nil
	}
	for _, c := range collectors {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if errors.As(err, &are) {
				continue
			}
			return fmt.Errorf("registering ratelimit metrics: %w", err)
		}
	}
	return nil
}

// zoneMetrics are one zone's counters, resolved when the handler is
// provisioned so that counting a decision is one atomic add.
type zoneMetrics struct {
	allowed, denied, dryRunDenied, skipped, notCharged, missingKey prometheus.Counter
	invalidCost, clampedMin, clampedMax                            prometheus.Counter
}

func newZoneMetrics(zone string) zoneMetrics {
	c := func(result string) prometheus.Counter { return decisionsTotal.WithLabelValues(zone, result) }
	return zoneMetrics{
		allowed:      c(resultAllowed),
		denied:       c(resultDenied),
		dryRunDenied: c(resultDryRunDenied),
		skipped:      c(resultSkipped),
		notCharged:   c(resultNotCharged),
		missingKey:   c(resultMissingKey),
		invalidCost:  invalidCostsTotal.WithLabelValues(zone),
		clampedMin:   clampedCostsTotal.WithLabelValues(zone, boundMin),
		clampedMax:   clampedCostsTotal.WithLabelValues(zone, boundMax),
	}
}

// observeDecision records a sampled decision's duration.
func observeDecision(allowed bool, d time.Duration) {
	if allowed {
		decisionAllowedSeconds.Observe(d.Seconds())
	} else {
		decisionDeniedSeconds.Observe(d.Seconds())
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

// engineCollector exports the pooled engine's state at scrape time: nothing
// on the request path maintains these values, and a scrape with no config
// using the limiter exports none of them.
type engineCollector struct{}

func newDesc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(metricName(name), help, labels, nil)
}

var (
	descEntries = newDesc("entries",
		"Live keys (zone, identifier, window) held in memory.")
	descStrictKeys = newDesc("strict_keys",
		"Keys in strict mode: denied recently, so a decision that would allow them reads the origin first.")
	descEvictions = newDesc("evictions_total",
		"Keys evicted because live entries reached the cap (in local-only mode an eviction forgets a count).")
	descFirstDenials = newDesc("first_denials_total",
		"Cells (key and window) that denied their first request: how many keys hit their limit.")
	descPendingCells = newDesc("replay_pending_cells",
		"Cells queued for replay to the origin.")
	descReplayDrops = newDesc("replay_drops_total",
		"Cells a full replay queue could not take; their units stay pending and are replayed later.")
	descReplayBatches = newDesc("replay_batches_total",
		"Replay batches flushed to the origin, by outcome (ok, error).", "outcome")
	descCellReads = newDesc("cell_reads_total",
		"Reads of a cell pair from the origin, by outcome (ok, error).", "outcome")
	descSyncReads = newDesc("sync_reads_total",
		"Decisions that waited for an origin read (a cold key, or a stale one at half its limit or more): request-path round trips.")
	descReservations = newDesc("reservations_total",
		"Requests decided at the origin (a key other processes also count, near its limit or in strict mode), by verdict (admitted, denied; error: the reservation failed and the request was decided locally). Requests that arrive while a reservation is in flight share the next one: one request-path round trip decides them all.", "result")
	descSharedReads = newDesc("shared_reads_total",
		"Decisions that joined an origin read already in flight instead of starting one.")
	descBackgroundReads = newDesc("background_reads_total",
		"Origin reads started in the background, without holding up a request.")
	descReadWaitTimeouts = newDesc("read_wait_timeouts_total",
		"Decisions that stopped waiting for an origin read at the read timeout and decided on local counts.")
	descLastRead = newDesc("last_read_timestamp_seconds",
		"Unix time of the last successful origin read; 0 if none.")
	descLastFlush = newDesc("last_flush_timestamp_seconds",
		"Unix time of the last successful replay flush; 0 if none.")
	descBreakerState = newDesc("origin_breaker_state",
		"1 for the state each origin endpoint's circuit breakers are in (closed, half-open, open), 0 for the others; breaker ratelimit_origin guards the request path, ratelimit_origin_replay replay.", "endpoint", "breaker", "state")
	descResends = newDesc("resends_total",
		"Cells whose whole count was sent to Redis again because it restarted empty (a new run ID).")
	descLostUnits = newDesc("replay_lost_units_total",
		"Admitted units given up unsent when Redis was let go (a reload without it, or shutdown) and could not take them.")
	descOriginRestarts = newDesc("origin_restarts_total",
		"Redis servers seen restarted (their run ID changed), after each of which every live key's count is sent again.")
	descSlowCalls = newDesc("origin_slow_calls_total",
		"Request-path calls to an endpoint that answered slower than breaker_slow_call (each a failure for its breaker).", "endpoint")

	engineDescs = []*prometheus.Desc{
		descEntries, descStrictKeys, descEvictions, descFirstDenials,
		descPendingCells, descReplayDrops, descReplayBatches, descCellReads,
		descSyncReads, descSharedReads, descBackgroundReads, descReadWaitTimeouts,
		descLastRead, descLastFlush, descBreakerState, descSlowCalls, descReservations,
		descResends, descLostUnits, descOriginRestarts,
	}
	breakerStates = []origin.BreakerState{origin.BreakerClosed, origin.BreakerHalfOpen, origin.BreakerOpen}
)

// Describe implements prometheus.Collector.
func (*engineCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range engineDescs {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (*engineCollector) Collect(ch chan<- prometheus.Metric) {
	st := lookupState()
	if st == nil {
		return
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v int64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	s := st.engine.Stats()
	gauge(descEntries, float64(s.Entries))
	gauge(descStrictKeys, float64(s.StrictKeys))
	counter(descEvictions, s.Evictions)
	counter(descFirstDenials, s.FirstDenials)
	gauge(descPendingCells, float64(s.PendingCells))
	counter(descReplayDrops, s.ReplayDrops)
	counter(descReplayBatches, s.Flushes, "ok")
	counter(descReplayBatches, s.FlushErrors, "error")
	counter(descCellReads, s.Reads, "ok")
	counter(descCellReads, s.ReadErrors, "error")
	counter(descSyncReads, s.SyncReads)
	counter(descSharedReads, s.SharedReads)
	counter(descBackgroundReads, s.BackgroundReads)
	counter(descReadWaitTimeouts, s.ReadWaitTimeouts)
	counter(descReservations, s.ReservationsAdmitted, "admitted")
	counter(descReservations, s.ReservationsDenied, "denied")
	counter(descReservations, s.ReservationErrors, "error")
	gauge(descLastRead, unixSeconds(s.LastRead))
	gauge(descLastFlush, unixSeconds(s.LastFlush))
	counter(descResends, s.Resends)
	counter(descLostUnits, s.LostUnits)

	o := st.apps.currentOrigin()
	if o == nil {
		return
	}
	os := o.Stats()
	ch <- prometheus.MustNewConstMetric(descOriginRestarts, prometheus.CounterValue, float64(os.Restarts))
	for _, ep := range os.Endpoints {
		for _, b := range []struct {
			name  string
			state origin.BreakerState
		}{{origin.BreakerName, ep.Breaker}, {origin.ReplayBreakerName, ep.ReplayBreaker}} {
			for _, bs := range breakerStates {
				v := 0.0
				if b.state == bs {
					v = 1
				}
				gauge(descBreakerState, v, ep.Address, b.name, string(bs))
			}
		}
		ch <- prometheus.MustNewConstMetric(descSlowCalls, prometheus.CounterValue, float64(ep.SlowCalls), ep.Address)
	}
}

func unixSeconds(t time.Time) float64 {
	if t.IsZero() {
		return 0
	}
	return float64(t.UnixMilli()) / 1e3
}

// Interface guards.
var _ prometheus.Collector = (*engineCollector)(nil)
