package ratelimit

import (
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
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
	// resultChargedAnyway: the region's Redis admitted and charged the
	// zone, then another zone of the same directive denied the request:
	// the units stay counted (an over-count on the strict side).
	resultChargedAnyway = "charged_anyway"
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

func metricName(name string) string {
	return prometheus.BuildFQName(metricsNamespace, metricsSubsystem, name)
}

var (
	decisionsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: metricName("decisions_total"),
		Help: "Decisions per zone by result: allowed, denied, dry_run_denied, skipped, not_charged (another zone of the directive denied), charged_anyway (Redis charged this zone, another zone denied), missing_key (on_missing_key deny).",
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

	overrideChanges = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: metricName("override_changes_total"),
		Help: "Runtime overrides set or removed through this node's admin API, by change (set, removed) and the scope it reached (node, region, global).",
	}, []string{"change", "scope"})

	resetsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: metricName("resets_total"),
		Help: "Keys reset beyond this node through its admin API, by scope (region, global).",
	}, []string{"scope"})

	overridesActive = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: metricName("overrides_active"),
		Help: "Runtime overrides this process holds now, from every scope (those of a zone no loaded config defines included).",
	}, func() float64 { return float64(overrides.active()) })

	// engineMetrics reads the pooled engine (and origin) at scrape time.
	engineMetrics = new(engineCollector)
)

// collectors are the limiter's metrics, which every config registers as
// one (limiterMetrics): the handler's and the engine's, then each backend
// kind's.
var collectors = func() []prometheus.Collector {
	cs := []prometheus.Collector{decisionsTotal, decisionSeconds, invalidCostsTotal, clampedCostsTotal, overrideChanges, overridesActive, resetsTotal, engineMetrics}
	for _, k := range backendKinds {
		cs = append(cs, k.collectors...)
	}
	return cs
}()

// The latency observers, resolved once: an observation on the request path
// does no label lookup.
var (
	decisionAllowedSeconds = decisionSeconds.WithLabelValues(resultAllowed)
	decisionDeniedSeconds  = decisionSeconds.WithLabelValues(resultDenied)
)

// registerMetrics registers the collectors into reg, a config's registry.
// Already there (the config's admin endpoint, or another handler of the
// config, registered them) is success.
func registerMetrics(reg *prometheus.Registry) error {
	if reg == nil {
		return nil
	}
	if err := reg.Register(limiterMetrics{}); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			return nil
		}
		return fmt.Errorf("registering ratelimit metrics: %w", err)
	}
	return nil
}

// limiterMetrics are the collectors as one, exported only while a loaded
// config uses the limiter. Every config registers them from its admin
// endpoint on (AdminAPI.Provision), whether it uses the limiter or not:
// Caddy serves /metrics from the registry of the config it loaded last,
// made before its apps are provisioned, and a reload that fails before a
// rate limit module is provisioned keeps the old config running behind
// it. The gate keeps a config that does not use the limiter, when it is
// the only one, free of caddy_ratelimit_ series, as before.
type limiterMetrics struct{}

// Describe implements prometheus.Collector.
func (limiterMetrics) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range collectors {
		c.Describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (limiterMetrics) Collect(ch chan<- prometheus.Metric) {
	if lookupState() == nil {
		return
	}
	for _, c := range collectors {
		c.Collect(ch)
	}
}

// zoneMetrics are one zone's counters, resolved when the handler is
// provisioned so that counting a decision is one atomic add.
type zoneMetrics struct {
	allowed, denied, dryRunDenied, skipped, notCharged, chargedAnyway, missingKey prometheus.Counter
	invalidCost, clampedMin, clampedMax                                           prometheus.Counter
}

func newZoneMetrics(zone string) zoneMetrics {
	c := func(result string) prometheus.Counter { return decisionsTotal.WithLabelValues(zone, result) }
	return zoneMetrics{
		allowed:       c(resultAllowed),
		denied:        c(resultDenied),
		dryRunDenied:  c(resultDryRunDenied),
		skipped:       c(resultSkipped),
		notCharged:    c(resultNotCharged),
		chargedAnyway: c(resultChargedAnyway),
		missingKey:    c(resultMissingKey),
		invalidCost:   invalidCostsTotal.WithLabelValues(zone),
		clampedMin:    clampedCostsTotal.WithLabelValues(zone, boundMin),
		clampedMax:    clampedCostsTotal.WithLabelValues(zone, boundMax),
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

// engineCollector exports the pooled engine's state at scrape time: nothing
// on the request path maintains these values, and a scrape with no config
// using the limiter exports none of them.
type engineCollector struct{}

func newDesc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(metricName(name), help, labels, nil)
}

// Describe implements prometheus.Collector.
func (*engineCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range engineStats.descs() {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (*engineCollector) Collect(ch chan<- prometheus.Metric) {
	st := lookupState()
	if st == nil {
		return
	}
	s := engineStatsOf(st)
	engineStats.collect(ch, &s, nil)
}

func unixSeconds(t time.Time) float64 {
	if t.IsZero() {
		return 0
	}
	return float64(t.UnixMilli()) / 1e3
}

// Interface guards.
var (
	_ prometheus.Collector = (*engineCollector)(nil)
	_ prometheus.Collector = limiterMetrics{}
)
