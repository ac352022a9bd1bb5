package ratelimit

import (
	"net/http"
	"slices"
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

// propagationStats are the layer's numbers: the status's propagation
// section and the layer's metrics.
var propagationStats = statSet[propagation.Stats]{stats: []stat[propagation.Stats]{
	// Region is the identity rows are written under: the region, or
	// region/node for a node without Redis.
	{json: "region", value: func(s *propagation.Stats) any { return s.Region }},
	{json: "database", value: func(s *propagation.Stats) any { return s.Database }},
	// Ready is false until the schema is known to exist.
	{json: "ready", metric: "propagation_ready", gauge: true, value: func(s *propagation.Stats) any { return s.Ready },
		help: "1 once the MySQL schema is known to exist; 0 while MySQL has not answered since start, and while a statement found a table, a column or the database gone until the schema is made again."},
	{json: "breaker", value: func(s *propagation.Stats) any { return s.Breaker }},
	{json: "last_push", metric: "propagation_last_push_timestamp_seconds", gauge: true, value: func(s *propagation.Stats) any { return s.LastPush },
		help: "Unix time of the last successful MySQL write; 0 if none."},
	{json: "last_pull", metric: "propagation_last_pull_timestamp_seconds", gauge: true, value: func(s *propagation.Stats) any { return s.LastPull },
		help: "Unix time of the last successful read of published counts; 0 if none."},
	{json: "last_blocklist_pull", value: func(s *propagation.Stats) any { return s.LastBlocklistPull }},
	{json: "rows_emitted.blocklist", metric: "propagation_rows_written_total", label: [2]string{"table", "ratelimit_blocklist"},
		value: func(s *propagation.Stats) any { return s.DenialsEmitted },
		help:  "Rows written to MySQL, by table (ratelimit_blocklist, ratelimit_global_counts)."},
	{json: "rows_emitted.global_counts", metric: "propagation_rows_written_total", label: [2]string{"table", "ratelimit_global_counts"},
		value: func(s *propagation.Stats) any { return s.CountsPublished }},
	{json: "rows_applied.blocklist", metric: "propagation_rows_applied_total", label: [2]string{"table", "ratelimit_blocklist"},
		value: func(s *propagation.Stats) any { return s.DenialsApplied },
		help:  "Rows read from MySQL that raised another region's count here, by table."},
	{json: "rows_applied.global_counts", metric: "propagation_rows_applied_total", label: [2]string{"table", "ratelimit_global_counts"},
		value: func(s *propagation.Stats) any { return s.CountsApplied }},
	{json: "denials_filtered", metric: "propagation_denials_not_written_total", label: [2]string{"reason", "filtered"},
		value: func(s *propagation.Stats) any { return s.DenialsFiltered },
		help:  "First denials not written, by reason (filtered: below half the limit regionally; expired: MySQL down until the row expired; queue_full)."},
	{json: "denials_expired", metric: "propagation_denials_not_written_total", label: [2]string{"reason", "expired"},
		value: func(s *propagation.Stats) any { return s.DenialsExpired }},
	{json: "denial_queue_drops", metric: "propagation_denials_not_written_total", label: [2]string{"reason", "queue_full"},
		value: func(s *propagation.Stats) any { return s.DenialQueueDrops }},
	{json: "pending_denials", metric: "propagation_pending_denials", gauge: true, value: func(s *propagation.Stats) any { return s.PendingDenials },
		help: "Denial rows waiting to be written."},
	{json: "pending_overrides", metric: "propagation_pending_overrides", gauge: true, value: func(s *propagation.Stats) any { return s.PendingOverrides },
		help: "Runtime override changes and global resets held for MySQL and not written yet (on the role's holder, or a process that is its own region): a change made while MySQL does not answer waits here."},
	{json: "dropped_batches", metric: "propagation_dropped_batches_total", value: func(s *propagation.Stats) any { return s.DroppedBatches },
		help: "Write batches dropped because MySQL failed or the write breaker was open (denial rows are retried until they expire; counts are published again)."},
	{json: "errors.write", metric: "propagation_errors_total", label: [2]string{"op", "write"}, value: func(s *propagation.Stats) any { return s.WriteErrors },
		help: "Failed MySQL operations, by operation (write, read, migrate, lease, region)."},
	{json: "errors.read", metric: "propagation_errors_total", label: [2]string{"op", "read"}, value: func(s *propagation.Stats) any { return s.ReadErrors }},
	{json: "errors.migrate", metric: "propagation_errors_total", label: [2]string{"op", "migrate"}, value: func(s *propagation.Stats) any { return s.MigrateErrors }},
	{json: "imports", metric: "propagation_imported_cells", gauge: true, value: func(s *propagation.Stats) any { return s.Imports },
		help: "Cells holding counts imported from other regions (including imports waiting for a key's first request)."},
	{json: "import_drops", value: func(s *propagation.Stats) any { return s.ImportDrops }},
	{json: "cleanup_deleted", metric: "propagation_cleanup_deleted_rows_total", value: func(s *propagation.Stats) any { return s.CleanupDeleted },
		help: "Expired rows this node deleted."},
	// The region's role: which node talks to MySQL for the region.
	{json: "role", value: func(s *propagation.Stats) any { return s.Role }},
	{metric: "propagation_role_held", gauge: true, value: func(s *propagation.Stats) any { return s.Role != "member" },
		help: "1 when this process talks to MySQL (it holds its region's role, or it has no Redis and is its own region); 0 for the region's other nodes."},
	{json: "holder", value: func(s *propagation.Stats) any { return s.Holder }},
	{json: "node_id", value: func(s *propagation.Stats) any { return s.NodeID }},
	{json: "role_taken", metric: "propagation_role_changes_total", label: [2]string{"change", "taken"},
		value: func(s *propagation.Stats) any { return s.RoleTaken },
		help:  "Times this process took its region's role (taken) or lost it to another node (lost)."},
	{json: "role_lost", metric: "propagation_role_changes_total", label: [2]string{"change", "lost"},
		value: func(s *propagation.Stats) any { return s.RoleLost }},
	{json: "lease_renewals", metric: "propagation_lease_renewals_total", value: func(s *propagation.Stats) any { return s.LeaseRenewals },
		help: "Times the role's holder renewed its lease during a flush, before a query that could have outlasted it (MySQL or the region's Redis slow or stalled)."},
	{json: "errors.lease", metric: "propagation_errors_total", label: [2]string{"op", "lease"}, value: func(s *propagation.Stats) any { return s.LeaseErrors }},
	{json: "errors.region", metric: "propagation_errors_total", label: [2]string{"op", "region"}, value: func(s *propagation.Stats) any { return s.RegionErrors }},
	{json: "cells_registered", metric: "propagation_cells_registered_total", value: func(s *propagation.Stats) any { return s.Registered },
		help: "Cells this node registered in its region's Redis for the role's holder to publish."},
	{json: "denials_left", metric: "propagation_denials_left_total", value: func(s *propagation.Stats) any { return s.DenialsLeft },
		help: "Denial rows this node left in its region's Redis for the role's holder to write."},
	{json: "registry_cells", metric: "propagation_registry_cells", gauge: true, value: func(s *propagation.Stats) any { return s.RegistryCells },
		help: "Cells the role's holder publishes for its region (0 on the other nodes)."},
	{json: "registry_drops", value: func(s *propagation.Stats) any { return s.RegistryDrops }},
	{json: "imports_sent", metric: "propagation_imports_sent_total", value: func(s *propagation.Stats) any { return s.ImportsSent },
		help: "Imported counts the role's holder wrote into its region's Redis."},
	{json: "rows_read.blocklist", metric: "propagation_rows_read_total", label: [2]string{"table", "ratelimit_blocklist"},
		value: func(s *propagation.Stats) any { return s.DenialRowsRead },
		help:  "Rows pulled from MySQL, by table."},
	{json: "rows_read.global_counts", metric: "propagation_rows_read_total", label: [2]string{"table", "ratelimit_global_counts"},
		value: func(s *propagation.Stats) any { return s.CountRowsRead }},
	{json: "pulls.changes", metric: "propagation_pulls_total", label: [2]string{"kind", "changes"},
		value: func(s *propagation.Stats) any { return s.ChangeReads },
		help:  "Pulls of a table, by kind (changes: the rows changed since the last pull; whole: the safety net)."},
	{json: "pulls.whole", metric: "propagation_pulls_total", label: [2]string{"kind", "whole"},
		value: func(s *propagation.Stats) any { return s.WholeReads }},
	{json: "clock_steps", metric: "propagation_database_clock_steps_total", value: func(s *propagation.Stats) any { return s.ClockSteps },
		help: "Times the database's clock was found behind the newest change pulled (it stepped back): the tables were read whole, and changes pulled from its clock on."},
	{json: "schema_remade", metric: "propagation_schema_remade_total", value: func(s *propagation.Stats) any { return s.SchemaRemade },
		help: "Times a MySQL statement found a table or the database gone (dropped by hand) and the schema was made again: every cell was published again and every table read whole."},
	{json: "own_rows_missing", metric: "propagation_own_rows_missing_total", value: func(s *propagation.Stats) any { return s.OwnRowsMissing },
		help: "Rows this region had published that a whole read found deleted (a table emptied by hand): their cells were published again."},
	{json: "override_rows_missing", metric: "propagation_override_rows_missing_total", value: func(s *propagation.Stats) any { return s.OverrideRowsMissing },
		help: "Runtime overrides (removals and resets included) held by this process that a whole read of ratelimit_overrides lacked or found older (the table emptied by hand): they were written back, the newest version winning."},
	{json: "replica_lag_seconds", value: func(s *propagation.Stats) any { return secondsOrNull(s.ReplicaLag) }},
	{metric: "propagation_replica_lag_seconds", gauge: true, value: func(s *propagation.Stats) any { return seconds(s.ReplicaLag) },
		help: "How far mysql_read's replica said it was behind at the last global sync (Seconds_Behind_Source); -1 when unknown: no replica, its SQL thread stopped, or no right to ask."},
	{json: "newest_row_age_seconds", value: func(s *propagation.Stats) any { return secondsOrNull(s.NewestRowAge) }},
	{metric: "propagation_newest_row_age_seconds", gauge: true, value: func(s *propagation.Stats) any { return seconds(s.NewestRowAge) },
		help: "Age of the newest change pulled from MySQL (-1 before the first): while other regions write, an upper bound of the replica's lag."},
}}

// seconds is d in seconds, -1 for a negative d (unknown).
func seconds(d time.Duration) float64 {
	if d < 0 {
		return -1
	}
	return d.Seconds()
}

// secondsOrNull is d in seconds, nil (JSON null) when unknown.
func secondsOrNull(d time.Duration) any {
	if d < 0 {
		return nil
	}
	return d.Seconds()
}

// propagationStatusDoc returns the section, or nil (JSON null) when the
// layer is not configured.
func propagationStatusDoc() any {
	p := currentProp.Load()
	if p == nil {
		return nil
	}
	s := p.Stats()
	return propagationStats.section(&s)
}

// blocklistDoc is GET /ratelimit/blocklist: the denial rows this node
// wrote and applied most recently. Identifiers are as rows hold them (an
// HMAC under identifier_secret, which leaves out the rows of raw
// identifiers written without it); without a secret they are shown as
// the admin API shows identifiers.
type blocklistDoc struct {
	Region  string            `json:"region"`
	Emitted []blocklistRowDoc `json:"emitted"`
	Applied []blocklistRowDoc `json:"applied"`
}

// blocklistRowDoc is a denial row with identifier_hex beside an
// identifier that is not valid UTF-8, as every other route shows one
// (showID): JSON shows a\x80 and a\x81 alike, as "a\ufffd".
type blocklistRowDoc struct {
	propagation.BlocklistRow
	IdentifierHex string `json:"identifier_hex,omitempty"`
}

// blocklistRows renders rows, never nil.
func blocklistRows(rows []propagation.BlocklistRow) []blocklistRowDoc {
	out := make([]blocklistRowDoc, len(rows))
	for i, r := range rows {
		out[i] = blocklistRowDoc{BlocklistRow: r, IdentifierHex: showID(r.Identifier).IdentifierHex}
	}
	return out
}

func handleBlocklist(w http.ResponseWriter, r *http.Request) error {
	if err := allowMethods(w, r, http.MethodGet); err != nil {
		return err
	}
	if _, err := parseQuery(r); err != nil {
		return err
	}
	st, err := runningState()
	if err != nil {
		return err
	}
	p := currentProp.Load()
	if p == nil {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: errNoPropagation}
	}
	out, in := p.Recent()
	if st.apps.view().ids.hashed() {
		// Rows written without the secret (by a region without it, or
		// before it was added) hold raw identifiers: they match no key
		// here, and showing them would show the identifier.
		out, in = hmacRows(out), hmacRows(in)
	}
	return writeJSON(w, blocklistDoc{Region: p.Region(), Emitted: blocklistRows(out), Applied: blocklistRows(in)})
}

// hmacRows keeps the rows whose identifier is an HMAC.
func hmacRows(rows []propagation.BlocklistRow) []propagation.BlocklistRow {
	return slices.DeleteFunc(rows, func(r propagation.BlocklistRow) bool { return !isHMAC(r.Identifier) })
}

var errNoPropagation = errString("the cross-region layer is not configured (no mysql line in the ratelimit global option)")

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
	base []float64
}

// retireProp adds a stopped propagator's counters to the retired totals.
func retireProp(s propagation.Stats) {
	retired.Lock()
	defer retired.Unlock()
	retired.base = propagationStats.retire(&s, retired.base)
}

var (
	propagationBreakerTransitions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: metricName("propagation_breaker_transitions_total"),
		Help: "State changes of the MySQL write breaker (ratelimit_propagation_writes), by the state entered.",
	}, []string{"state"})

	descPropBreaker = newDesc("propagation_breaker_state",
		"1 for the state the MySQL write breaker is in (closed, half-open, open), 0 for the others.", "state")

	// propagationCollectors are the MySQL backend's metrics.
	propagationCollectors = []prometheus.Collector{propagationBreakerTransitions, propagationCollector{}}
)

func init() {
	caddy.RegisterModule(new(propagationAdmin))
}

func observePropagationBreaker(_, to string) {
	propagationBreakerTransitions.WithLabelValues(to).Inc()
}

// propagationCollector exports the layer's numbers at scrape time: its
// counters go on from those of the propagators reloads retired.
type propagationCollector struct{}

// Describe implements prometheus.Collector.
func (propagationCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range append(propagationStats.descs(), descPropBreaker) {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (propagationCollector) Collect(ch chan<- prometheus.Metric) {
	p := currentProp.Load()
	retired.Lock()
	base := append([]float64(nil), retired.base...)
	retired.Unlock()
	if p == nil && base == nil {
		return
	}
	if p == nil {
		propagationStats.collect(ch, nil, base)
		return
	}
	cur := p.Stats()
	propagationStats.collect(ch, &cur, base)
	for _, state := range []string{"closed", "half-open", "open"} {
		v := 0.0
		if cur.Breaker == state {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(descPropBreaker, prometheus.GaugeValue, v, state)
	}
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

// Routes returns GET (and HEAD) /ratelimit/blocklist.
func (*propagationAdmin) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{Pattern: "/ratelimit/blocklist", Handler: headAsGet(handleBlocklist)}}
}

// Interface guards.
var (
	_ prometheus.Collector = propagationCollector{}
	_ caddy.AdminRouter    = (*propagationAdmin)(nil)
)
