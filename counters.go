package ratelimit

import (
	"bytes"
	"encoding/json"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Counters declared once. Each number a layer reports (the engine, the
// origin, the cross-region layer) is one stat: its key in the status
// document, its metric (name, help, kind, label) and how to read it from
// the layer's snapshot. The status section and the Prometheus collector
// are both made from the same list, so a new counter is one line.

// stat is one number of a snapshot S.
type stat[S any] struct {
	// json is the key in the status section, dotted for a nested object
	// ("errors.write"); empty when the number is a metric only.
	json string
	// metric is the metric's name without the caddy_ratelimit_ prefix;
	// empty when the number is in the status only. Several stats may
	// share a metric with different label values.
	metric string
	// help is the metric's help; one stat of a metric gives it.
	help string
	// gauge makes the metric a gauge; it is a counter otherwise.
	gauge bool
	// label is the metric's label name and this stat's value of it.
	label [2]string
	// value reads the number: an int64, a float64, a bool (1 or 0 as a
	// metric) or a time.Time (RFC 3339 or null in the status; Unix
	// seconds, 0 for none, as a metric).
	value func(*S) any
}

// statSet is a layer's stats, with the label names every metric of the
// set carries before its own (the endpoint of an origin's stats).
type statSet[S any] struct {
	labels []string
	stats  []stat[S]
}

// section renders the stats with a JSON key as the status section of s,
// in the list's order.
func (set *statSet[S]) section(s *S) *object {
	o := new(object)
	for i := range set.stats {
		st := &set.stats[i]
		if st.json == "" {
			continue
		}
		v := st.value(s)
		if t, ok := v.(time.Time); ok {
			v = timeOrNull(t)
		}
		o.setPath(st.json, v)
	}
	return o
}

// descs returns one descriptor per metric of the set, in order.
func (set *statSet[S]) descs() []*prometheus.Desc {
	var descs []*prometheus.Desc
	seen := map[string]bool{}
	for i := range set.stats {
		st := &set.stats[i]
		if st.metric == "" || seen[st.metric] {
			continue
		}
		seen[st.metric] = true
		descs = append(descs, set.desc(st))
	}
	return descs
}

// descCache holds the descriptors made, by metric name: a descriptor is
// made once whatever the number of scrapes.
var descCache sync.Map // string → *prometheus.Desc

func (set *statSet[S]) desc(st *stat[S]) *prometheus.Desc {
	if d, ok := descCache.Load(st.metric); ok {
		return d.(*prometheus.Desc)
	}
	labels := append([]string(nil), set.labels...)
	if st.label[0] != "" {
		labels = append(labels, st.label[0])
	}
	help := st.help
	for i := range set.stats { // the stat of the metric that gives its help
		if o := &set.stats[i]; o.metric == st.metric && o.help != "" {
			help = o.help
			break
		}
	}
	d, _ := descCache.LoadOrStore(st.metric, newDesc(st.metric, help, labels...))
	return d.(*prometheus.Desc)
}

// collect sends the set's metrics read from s, plus base for counters
// (those of snapshots retired before; nil for none), with the set's label
// values first. With a nil s only the counters go out, at base: what a
// layer that is gone counted.
func (set *statSet[S]) collect(ch chan<- prometheus.Metric, s *S, base []float64, values ...string) {
	for i := range set.stats {
		st := &set.stats[i]
		if st.metric == "" || (s == nil && st.gauge) {
			continue
		}
		var v float64
		if s != nil {
			v = asFloat(st.value(s))
		}
		kind := prometheus.CounterValue
		if st.gauge {
			kind = prometheus.GaugeValue
		} else if base != nil {
			v += base[i]
		}
		labels := values
		if st.label[0] != "" {
			labels = append(append([]string(nil), values...), st.label[1])
		}
		ch <- prometheus.MustNewConstMetric(set.desc(st), kind, v, labels...)
	}
}

// retire adds the counters of s to base (one number per stat), so that
// the metrics of a layer that reloads replace stay monotonic.
func (set *statSet[S]) retire(s *S, base []float64) []float64 {
	if base == nil {
		base = make([]float64, len(set.stats))
	}
	for i := range set.stats {
		if !set.stats[i].gauge {
			base[i] += asFloat(set.stats[i].value(s))
		}
	}
	return base
}

func asFloat(v any) float64 {
	switch x := v.(type) {
	case int64:
		return float64(x)
	case uint64:
		return float64(x)
	case float64:
		return x
	case bool:
		if x {
			return 1
		}
		return 0
	case time.Time:
		return unixSeconds(x)
	}
	return 0
}

// object is a JSON object that keeps its keys in the order they were set.
type object struct {
	keys []string
	vals map[string]any
}

// set sets key to v.
func (o *object) set(key string, v any) {
	if o.vals == nil {
		o.vals = map[string]any{}
	}
	if _, ok := o.vals[key]; !ok {
		o.keys = append(o.keys, key)
	}
	o.vals[key] = v
}

// setPath sets a dotted path, making the nested objects on the way.
func (o *object) setPath(path string, v any) {
	head, rest, nested := strings.Cut(path, ".")
	if !nested {
		o.set(head, v)
		return
	}
	child, ok := o.vals[head].(*object)
	if !ok {
		child = new(object)
		o.set(head, child)
	}
	child.setPath(rest, v)
}

// MarshalJSON writes the keys in order.
func (o *object) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, k := range o.keys {
		if i > 0 {
			b.WriteByte(',')
		}
		key, _ := json.Marshal(k)
		b.Write(key)
		b.WriteByte(':')
		v, err := json.Marshal(o.vals[k])
		if err != nil {
			return nil, err
		}
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// engineStats are the engine's numbers: the status's engine section and
// the engine's metrics.
var engineStats = statSet[engineSnapshot]{stats: []stat[engineSnapshot]{
	{json: "entries", metric: "entries", gauge: true, value: func(s *engineSnapshot) any { return s.Entries },
		help: "Live keys (zone, identifier, window) held in memory."},
	{json: "strict_keys", metric: "strict_keys", gauge: true, value: func(s *engineSnapshot) any { return s.StrictKeys },
		help: "Keys in strict mode: denied recently, so a decision that would allow them reads the origin first."},
	{json: "evictions", metric: "evictions_total", value: func(s *engineSnapshot) any { return s.Evictions },
		help: "Keys evicted because live entries reached the cap (in local-only mode an eviction forgets a count)."},
	{json: "evictions_deferred", metric: "evictions_deferred_total", value: func(s *engineSnapshot) any { return s.EvictionsDeferred },
		help: "Evicted keys whose units the eviction left to the replay: its writes to a slow origin ran out of their one-second budget."},
	{json: "first_denials", metric: "first_denials_total", value: func(s *engineSnapshot) any { return s.FirstDenials },
		help: "Cells (key and window) that denied their first request: how many keys hit their limit."},
	{json: "pending_cells", metric: "replay_pending_cells", gauge: true, value: func(s *engineSnapshot) any { return s.PendingCells },
		help: "Cells whose units the origin may not have yet: queued for replay, or in a write that has not returned."},
	{json: "replay_drops", metric: "replay_drops_total", value: func(s *engineSnapshot) any { return s.ReplayDrops },
		help: "Cells a full replay queue could not take; their units stay pending and are replayed later."},
	{json: "slow_overruns", metric: "replay_slow_overruns_total", value: func(s *engineSnapshot) any { return s.SlowOverruns },
		help: "Slow ticks that came while the slow tier still flushed an earlier tick's keys, one batch at a time: its replay falling behind slow_tick."},
	{json: "reads", metric: "cell_reads_total", label: [2]string{"outcome", "ok"}, value: func(s *engineSnapshot) any { return s.Reads },
		help: "Reads of a cell pair from the origin, by outcome (ok, error)."},
	{json: "read_errors", metric: "cell_reads_total", label: [2]string{"outcome", "error"}, value: func(s *engineSnapshot) any { return s.ReadErrors }},
	{json: "read_wait_timeouts", metric: "read_wait_timeouts_total", value: func(s *engineSnapshot) any { return s.ReadWaitTimeouts },
		help: "Decisions that stopped waiting for an origin read at the read timeout and decided on local counts."},
	{json: "shared_reads", metric: "shared_reads_total", value: func(s *engineSnapshot) any { return s.SharedReads },
		help: "Decisions that joined an origin read already in flight instead of starting one."},
	{json: "sync_reads", metric: "sync_reads_total", value: func(s *engineSnapshot) any { return s.SyncReads },
		help: "Decisions that waited for an origin read (a cold key; a stale key at half its limit or more, counted by other processes too, or of a limit under 1,024 times the request's cost; any key whose view predates the origin's return from an outage): request-path round trips."},
	{json: "background_reads", metric: "background_reads_total", value: func(s *engineSnapshot) any { return s.BackgroundReads },
		help: "Origin reads started in the background, without holding up a request."},
	{json: "unread_decisions", metric: "unread_decisions_total", value: func(s *engineSnapshot) any { return s.UnreadDecisions },
		help: "Decisions on a key this process had not read yet, made without waiting for a read: a limit at least 1024 times the request's cost, while this process's count stays within 1/1024 of it (its first replay reads the key)."},
	// Reservations are the round trips that decide requests at the origin
	// (shared keys near their limit, or in strict mode); the next three
	// count those requests by verdict.
	{json: "reservations", value: func(s *engineSnapshot) any { return s.Reservations }},
	{json: "reservations_admitted", metric: "reservations_total", label: [2]string{"result", "admitted"}, value: func(s *engineSnapshot) any { return s.ReservationsAdmitted },
		help: "Requests decided at the origin (a key other processes also count, near its limit or in strict mode), by verdict (admitted, denied; error: the reservation failed and the request was decided locally). Requests that arrive while a reservation is in flight share the next one: one request-path round trip decides them all."},
	{json: "reservations_denied", metric: "reservations_total", label: [2]string{"result", "denied"}, value: func(s *engineSnapshot) any { return s.ReservationsDenied }},
	{json: "reservation_errors", metric: "reservations_total", label: [2]string{"result", "error"}, value: func(s *engineSnapshot) any { return s.ReservationErrors }},
	{json: "flushes", metric: "replay_batches_total", label: [2]string{"outcome", "ok"}, value: func(s *engineSnapshot) any { return s.Flushes },
		help: "Replay batches flushed to the origin, by outcome (ok, error)."},
	{json: "flush_errors", metric: "replay_batches_total", label: [2]string{"outcome", "error"}, value: func(s *engineSnapshot) any { return s.FlushErrors }},
	{json: "resends", metric: "resends_total", value: func(s *engineSnapshot) any { return s.Resends },
		help: "Cells whose whole count was sent to Redis again because it restarted empty (a new run ID)."},
	{json: "lost_units", metric: "replay_lost_units_total", value: func(s *engineSnapshot) any { return s.LostUnits },
		help: "Admitted units given up unsent when Redis was let go (a reload without it, or shutdown) and could not take them."},
	{json: "last_read", metric: "last_read_timestamp_seconds", gauge: true, value: func(s *engineSnapshot) any { return s.LastRead },
		help: "Unix time of the last successful origin read; 0 if none."},
	{json: "last_flush", metric: "last_flush_timestamp_seconds", gauge: true, value: func(s *engineSnapshot) any { return s.LastFlush },
		help: "Unix time of the last successful replay flush; 0 if none."},
}}

// engineSnapshot is what the engine's stats read.
type engineSnapshot = engine.Stats
