package ratelimit

import (
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// What operators see of the cross-region layer: the status's propagation
// section, GET /ratelimit/blocklist, the foreign counts of a key's cells,
// and the metrics.

// currentProp is the propagator the engine uses now, or nil.
var currentProp atomic.Pointer[propagation.Propagator]

// propagationStatus is the status's propagation section.
type propagationStatus struct {
	// Region is the identity rows are written under: the region, or
	// region/node for a node without Redis.
	Region   string `json:"region"`
	Database string `json:"database"`
	// Ready is false until the schema is known to exist.
	Ready             bool       `json:"ready"`
	Breaker           string     `json:"breaker"`
	LastPush          *time.Time `json:"last_push"`
	LastPull          *time.Time `json:"last_pull"`
	LastBlocklistPull *time.Time `json:"last_blocklist_pull"`
	RowsEmitted       struct {
		Blocklist    int64 `json:"blocklist"`
		GlobalCounts int64 `json:"global_counts"`
	} `json:"rows_emitted"`
	RowsApplied struct {
		Blocklist    int64 `json:"blocklist"`
		GlobalCounts int64 `json:"global_counts"`
	} `json:"rows_applied"`
	DenialsFiltered  int64 `json:"denials_filtered"`
	DenialsExpired   int64 `json:"denials_expired"`
	DenialQueueDrops int64 `json:"denial_queue_drops"`
	PendingDenials   int64 `json:"pending_denials"`
	DroppedBatches   int64 `json:"dropped_batches"`
	Errors           struct {
		Write   int64 `json:"write"`
		Read    int64 `json:"read"`
		Migrate int64 `json:"migrate"`
	} `json:"errors"`
	Imports        int64 `json:"imports"`
	ImportDrops    int64 `json:"import_drops"`
	CleanupDeleted int64 `json:"cleanup_deleted"`
}

// propagationStatusDoc returns the section, or nil (JSON null) when the
// layer is not configured.
func propagationStatusDoc() any {
	p := currentProp.Load()
	if p == nil {
		return nil
	}
	s := p.Stats()
	doc := &propagationStatus{
		Region: s.Region, Database: s.Database, Ready: s.Ready, Breaker: s.Breaker,
		LastPush: timeOrNull(s.LastPush), LastPull: timeOrNull(s.LastPull), LastBlocklistPull: timeOrNull(s.LastBlocklistPull),
		DenialsFiltered: s.DenialsFiltered, DenialsExpired: s.DenialsExpired, DenialQueueDrops: s.DenialQueueDrops,
		PendingDenials: s.PendingDenials, DroppedBatches: s.DroppedBatches,
		Imports: s.Imports, ImportDrops: s.ImportDrops, CleanupDeleted: s.CleanupDeleted,
	}
	doc.RowsEmitted.Blocklist, doc.RowsEmitted.GlobalCounts = s.DenialsEmitted, s.CountsPublished
	doc.RowsApplied.Blocklist, doc.RowsApplied.GlobalCounts = s.DenialsApplied, s.CountsApplied
	doc.Errors.Write, doc.Errors.Read, doc.Errors.Migrate = s.WriteErrors, s.ReadErrors, s.MigrateErrors
	return doc
}

// blocklistDoc is GET /ratelimit/blocklist: the denial rows this node
// wrote and applied most recently. Identifiers are as rows hold them (an
// HMAC under identifier_secret); without a secret they are shown as the
// admin API shows identifiers.
type blocklistDoc struct {
	Region  string                     `json:"region"`
	Emitted []propagation.BlocklistRow `json:"emitted"`
	Applied []propagation.BlocklistRow `json:"applied"`
}

func handleBlocklist(w http.ResponseWriter, r *http.Request) error {
	if err := allowMethods(w, r, http.MethodGet); err != nil {
		return err
	}
	if _, err := parseQuery(r); err != nil {
		return err
	}
	if _, err := runningState(); err != nil {
		return err
	}
	p := currentProp.Load()
	if p == nil {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: errNoPropagation}
	}
	out, in := p.Recent()
	if out == nil {
		out = []propagation.BlocklistRow{}
	}
	if in == nil {
		in = []propagation.BlocklistRow{}
	}
	return writeJSON(w, blocklistDoc{Region: p.Region(), Emitted: out, Applied: in})
}

var errNoPropagation = errString("the cross-region layer is not configured (no mysql line in the ratelimit global option)")

type errString string

func (e errString) Error() string { return string(e) }

// foreignCounts returns what each foreign region counted in the cell, for
// the counters route; nil without the layer.
func foreignCounts(key engine.Key, seq int64) map[string]int64 {
	p := currentProp.Load()
	if p == nil {
		return nil
	}
	return p.ForeignCounts(key, seq)
}

// retired adds up the counters of propagators that have stopped, so the
// metrics stay monotonic across reloads, which replace the propagator.
var retired struct {
	sync.Mutex
	s propagation.Stats
}

func retire(s propagation.Stats) {
	retired.Lock()
	defer retired.Unlock()
	r := &retired.s
	r.DenialsEmitted += s.DenialsEmitted
	r.DenialsApplied += s.DenialsApplied
	r.DenialsFiltered += s.DenialsFiltered
	r.DenialsExpired += s.DenialsExpired
	r.DenialQueueDrops += s.DenialQueueDrops
	r.CountsPublished += s.CountsPublished
	r.CountsApplied += s.CountsApplied
	r.DroppedBatches += s.DroppedBatches
	r.WriteErrors += s.WriteErrors
	r.ReadErrors += s.ReadErrors
	r.MigrateErrors += s.MigrateErrors
	r.ImportDrops += s.ImportDrops
	r.CleanupDeleted += s.CleanupDeleted
}

var (
	propagationBreakerTransitions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: metricName("propagation_breaker_transitions_total"),
		Help: "State changes of the MySQL write breaker (ratelimit_propagation_writes), by the state entered.",
	}, []string{"state"})

	descPropRows = newDesc("propagation_rows_written_total",
		"Rows written to MySQL, by table (ratelimit_blocklist, ratelimit_global_counts).", "table")
	descPropApplied = newDesc("propagation_rows_applied_total",
		"Rows read from MySQL that raised another region's count here, by table.", "table")
	descPropDropped = newDesc("propagation_dropped_batches_total",
		"Write batches dropped because MySQL failed or the write breaker was open (denial rows are retried until they expire; counts are published again).")
	descPropErrors = newDesc("propagation_errors_total",
		"Failed MySQL operations, by operation (write, read, migrate).", "op")
	descPropDenials = newDesc("propagation_denials_not_written_total",
		"First denials not written, by reason (filtered: below half the limit regionally; expired: MySQL down until the row expired; queue_full).", "reason")
	descPropPending = newDesc("propagation_pending_denials",
		"Denial rows waiting to be written.")
	descPropImports = newDesc("propagation_imported_cells",
		"Cells holding counts imported from other regions (including imports waiting for a key's first request).")
	descPropCleanup = newDesc("propagation_cleanup_deleted_rows_total",
		"Expired rows this node deleted.")
	descPropBreaker = newDesc("propagation_breaker_state",
		"1 for the state the MySQL write breaker is in (closed, half-open, open), 0 for the others.", "state")
	descPropReady = newDesc("propagation_ready",
		"1 once the MySQL schema is known to exist; 0 while MySQL has not answered since start.")
	descPropLastPush = newDesc("propagation_last_push_timestamp_seconds",
		"Unix time of the last successful MySQL write; 0 if none.")
	descPropLastPull = newDesc("propagation_last_pull_timestamp_seconds",
		"Unix time of the last successful read of published counts; 0 if none.")

	propDescs = []*prometheus.Desc{descPropRows, descPropApplied, descPropDropped, descPropErrors, descPropDenials,
		descPropPending, descPropImports, descPropCleanup, descPropBreaker, descPropReady, descPropLastPush, descPropLastPull}
)

func init() {
	collectors = append(collectors, propagationBreakerTransitions, propagationCollector{})
	caddy.RegisterModule(new(propagationAdmin))
}

func observePropagationBreaker(_, to string) {
	propagationBreakerTransitions.WithLabelValues(to).Inc()
}

// propagationCollector exports the layer's counters at scrape time.
type propagationCollector struct{}

// Describe implements prometheus.Collector.
func (propagationCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range propDescs {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (propagationCollector) Collect(ch chan<- prometheus.Metric) {
	p := currentProp.Load()
	retired.Lock()
	s := retired.s
	retired.Unlock()
	if p == nil && s == (propagation.Stats{}) {
		return
	}
	var cur propagation.Stats
	if p != nil {
		cur = p.Stats()
	}
	counter := func(d *prometheus.Desc, v int64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter(descPropRows, s.DenialsEmitted+cur.DenialsEmitted, "ratelimit_blocklist")
	counter(descPropRows, s.CountsPublished+cur.CountsPublished, "ratelimit_global_counts")
	counter(descPropApplied, s.DenialsApplied+cur.DenialsApplied, "ratelimit_blocklist")
	counter(descPropApplied, s.CountsApplied+cur.CountsApplied, "ratelimit_global_counts")
	counter(descPropDropped, s.DroppedBatches+cur.DroppedBatches)
	counter(descPropErrors, s.WriteErrors+cur.WriteErrors, "write")
	counter(descPropErrors, s.ReadErrors+cur.ReadErrors, "read")
	counter(descPropErrors, s.MigrateErrors+cur.MigrateErrors, "migrate")
	counter(descPropDenials, s.DenialsFiltered+cur.DenialsFiltered, "filtered")
	counter(descPropDenials, s.DenialsExpired+cur.DenialsExpired, "expired")
	counter(descPropDenials, s.DenialQueueDrops+cur.DenialQueueDrops, "queue_full")
	counter(descPropCleanup, s.CleanupDeleted+cur.CleanupDeleted)
	if p == nil {
		return
	}
	gauge(descPropPending, float64(cur.PendingDenials))
	gauge(descPropImports, float64(cur.Imports))
	for _, state := range []string{"closed", "half-open", "open"} {
		v := 0.0
		if cur.Breaker == state {
			v = 1
		}
		gauge(descPropBreaker, v, state)
	}
	ready := 0.0
	if cur.Ready {
		ready = 1
	}
	gauge(descPropReady, ready)
	gauge(descPropLastPush, unixSeconds(cur.LastPush))
	gauge(descPropLastPull, unixSeconds(cur.LastPull))
}

// propagationAdmin is the admin API extension `admin.api.ratelimit_propagation`:
// GET /ratelimit/blocklist. A module of its own so the rate limiter's admin
// module stays as it is.
type propagationAdmin struct{}

// CaddyModule returns the Caddy module information.
func (*propagationAdmin) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.ratelimit_propagation",
		New: func() caddy.Module { return new(propagationAdmin) },
	}
}

// Routes returns GET /ratelimit/blocklist.
func (*propagationAdmin) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{Pattern: "/ratelimit/blocklist", Handler: caddy.AdminHandlerFunc(handleBlocklist)}}
}

// Interface guards.
var (
	_ prometheus.Collector = propagationCollector{}
	_ caddy.AdminRouter    = (*propagationAdmin)(nil)
)
