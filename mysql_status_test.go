package ratelimit

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// TestPropagationStats_SectionKeepsItsKeys: the status's propagation
// section, keys and nesting as the dashboard and operators read them.
func TestPropagationStats_SectionKeepsItsKeys(t *testing.T) {
	s := propagation.Stats{Region: "eu", Database: "tcp(db:3306)/rl", Ready: true, Breaker: "closed",
		DenialsEmitted: 1, CountsPublished: 2, DenialsApplied: 3, CountsApplied: 4, WriteErrors: 5, Imports: 6,
		Role: "holder", Holder: "n1", NodeID: "n1", RoleTaken: 1, LeaseErrors: 7, LeaseRenewals: 10, CountRowsRead: 8, ChangeReads: 9,
		ReplicaLag: -1, NewestRowAge: 1500 * time.Millisecond}
	b, err := json.Marshal(propagationStats.section(&s))
	if err != nil {
		t.Fatal(err)
	}
	want := `{"region":"eu","database":"tcp(db:3306)/rl","ready":true,"breaker":"closed","last_push":null,"last_pull":null,` +
		`"last_blocklist_pull":null,"rows_emitted":{"blocklist":1,"global_counts":2},"rows_applied":{"blocklist":3,"global_counts":4},` +
		`"denials_filtered":0,"denials_expired":0,"denial_queue_drops":0,"pending_denials":0,"pending_overrides":0,"dropped_batches":0,` +
		`"errors":{"write":5,"read":0,"migrate":0,"lease":7,"region":0},"imports":6,"import_drops":0,"cleanup_deleted":0,` +
		`"role":"holder","holder":"n1","node_id":"n1","role_taken":1,"role_lost":0,"lease_renewals":10,"cells_registered":0,"denials_left":0,` +
		`"registry_cells":0,"registry_drops":0,"imports_sent":0,"rows_read":{"blocklist":0,"global_counts":8},` +
		`"pulls":{"changes":9,"whole":0},"clock_steps":0,"schema_remade":0,"own_rows_missing":0,"override_rows_missing":0,"replica_lag_seconds":null,"newest_row_age_seconds":1.5}`
	if string(b) != want {
		t.Fatalf("section\n%s\nwant\n%s", b, want)
	}
}

// TestPropagationCollector_CountersGoOnAfterAReload: a reload replaces the
// propagator; what the stopped one counted stays in the counters, and
// without a layer only the counters are exported.
func TestPropagationCollector_CountersGoOnAfterAReload(t *testing.T) {
	retired.Lock()
	saved := retired.base
	retired.base = nil
	retired.Unlock()
	t.Cleanup(func() {
		retired.Lock()
		retired.base = saved
		retired.Unlock()
	})
	if currentProp.Load() != nil {
		t.Fatal("a propagator is in use by another test")
	}
	if n := collectCount(propagationCollector{}, "caddy_ratelimit_propagation_rows_written_total"); n != 0 {
		t.Fatalf("%d series before any layer ran, want none", n)
	}
	retireProp(propagation.Stats{DenialsEmitted: 7, CountsPublished: 9, PendingDenials: 3})
	got := map[string]bool{}
	for _, name := range []string{"rows_written_total", "pending_denials", "ready"} {
		if collectCount(propagationCollector{}, "caddy_ratelimit_propagation_"+name) > 0 {
			got[name] = true
		}
	}
	if !got["rows_written_total"] || got["pending_denials"] || got["ready"] {
		t.Fatalf("after a retire: %v, want the counters and no gauge", got)
	}
	if v := seriesValue(t, propagationCollector{}, "caddy_ratelimit_propagation_rows_written_total", "ratelimit_blocklist"); v != 7 {
		t.Fatalf("denial rows written: %v, want the retired 7", v)
	}
}

// TestBlocklist_AnIdentifierThatIsNotUTF8IsShownInHex: the denial rows of
// a\x80 and a\x81 both read "a\ufffd" in GET /ratelimit/blocklist (an
// audit), where every other route puts identifier_hex beside them.
func TestBlocklist_AnIdentifierThatIsNotUTF8IsShownInHex(t *testing.T) {
	rows := []propagation.BlocklistRow{{Namespace: "z", Identifier: "a\x80"}, {Namespace: "z", Identifier: "a\x81"}, {Namespace: "z", Identifier: "plain"}}
	b, err := json.Marshal(blocklistDoc{Emitted: blocklistRows(rows), Applied: blocklistRows(nil)})
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Emitted []map[string]any `json:"emitted"`
		Applied []any            `json:"applied"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	if doc.Applied == nil || len(doc.Emitted) != 3 {
		t.Fatalf("%s", b)
	}
	for i, want := range []any{"6180", "6181", nil} {
		if got := doc.Emitted[i]["identifier_hex"]; got != want {
			t.Errorf("row %d: identifier_hex %v, want %v (%s)", i, got, want, b)
		}
		if doc.Emitted[i]["namespace"] != "z" {
			t.Errorf("row %d lost its fields: %v", i, doc.Emitted[i])
		}
	}
}
