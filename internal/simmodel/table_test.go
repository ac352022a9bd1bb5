package simmodel

import (
	"fmt"
	"strings"
	"testing"

	"github.com/edgelimit/caddy-ratelimit/propagation"
)

func TestMySQL_ChangesPageInChangeOrder(t *testing.T) {
	clk := &clock{ms: 1000}
	m := newTestMySQL(clk, 0)
	s := m.Client(0, nil)
	_ = s.UpsertCounts(bg, []*propagation.CountRow{countRow("c", 1, 1), countRow("a", 1, 1)})
	clk.ms = 2000
	_ = s.UpsertCounts(bg, []*propagation.CountRow{countRow("b", 1, 1), countRow("c", 1, 2)})
	clk.ms = 3000
	var got []string
	r := propagation.Read{Changed: true, Since: 500, Limit: 2}
	for {
		rows, err := s.ReadCounts(bg, r)
		if err != nil {
			t.Fatal(err)
		}
		for _, row := range rows {
			got = append(got, row.Identifier)
		}
		if len(rows) < r.Limit {
			break
		}
		last := rows[len(rows)-1]
		r.After = &propagation.RowKey{Namespace: last.Namespace, Identifier: last.Identifier, WindowMs: last.WindowMs, Sequence: last.Sequence, Region: last.Region, UpdatedMs: last.UpdatedMs}
	}
	if want := "a b c"; strings.Join(got, " ") != want {
		t.Fatalf("pages read %v, want %s (c's change at 2000 moved it after a)", got, want)
	}
}

func TestMySQL_CleanupDeletesInExpiryOrder(t *testing.T) {
	clk := &clock{ms: 1000}
	m := newTestMySQL(clk, 0)
	s := m.Client(0, nil)
	rows := []*propagation.CountRow{countRow("a", 1, 1), countRow("b", 1, 1), countRow("c", 1, 1)}
	rows[0].ExpiresMs, rows[1].ExpiresMs, rows[2].ExpiresMs = 300, 100, 5000
	_ = s.UpsertCounts(bg, rows)
	clk.ms = 1010
	n, err := s.DeleteExpired(bg, propagation.Counts, 1000, 1)
	if err != nil || n != 1 || m.Count(propagation.Cell{Namespace: "z", Identifier: "b", WindowMs: 60_000, Sequence: 1}, "r1") != 0 {
		t.Fatalf("deleted %d (%v): want b first", n, err)
	}
	if m.Rows(propagation.Counts) != 2 {
		t.Fatalf("%d rows left, want 2", m.Rows(propagation.Counts))
	}
}

// TestTable_ReadsTheRowsAsTheyWereAtItsView: a read as of a view (a
// replica's) returns each row as the primary held it then, neither newer
// nor deleted since; compaction keeps the versions the oldest view needs
// and drops the others.
func TestTable_ReadsTheRowsAsTheyWereAtItsView(t *testing.T) {
	tb := &table{rows: map[rowKey]*row{}}
	tb.upsertCount(countRow("a", 1, 1), 100)
	tb.upsertCount(countRow("a", 1, 3), 200)
	tb.upsertCount(countRow("a", 1, 2), 250) // counts only rise: no new version
	tb.upsertCount(countRow("b", 1, 2), 300)
	read := func(asOf, oldest int64) string {
		vs, _ := tb.whole(propagation.Read{Limit: 10}, asOf, oldest)
		var out []string
		for _, v := range vs {
			out = append(out, fmt.Sprintf("%s=%d", v.row.key.id, v.count))
		}
		return strings.Join(out, " ")
	}
	for _, tc := range []struct {
		asOf int64
		want string
	}{{50, ""}, {150, "a=1"}, {250, "a=3"}, {350, "a=3 b=2"}} {
		if got := read(tc.asOf, 0); got != tc.want {
			t.Errorf("as of %d: %q, want %q", tc.asOf, got, tc.want)
		}
	}
	tb.compact(150)
	if got := read(150, 150); got != "a=1" {
		t.Fatalf("as of 150 after compacting up to it: %q, want a=1", got)
	}
	tb.compact(250)
	if len(tb.log) != 2 || read(250, 250) != "a=3" {
		t.Fatalf("after compacting up to 250: %d versions, read %q; want 2 and a=3", len(tb.log), read(250, 250))
	}
	if n := tb.deleteExpired(1<<51, 10, 400); n != 2 {
		t.Fatalf("deleted %d rows, want 2", n)
	}
	if got := read(350, 300); got != "a=3 b=2" {
		t.Fatalf("as of 350, before the deletion: %q", got)
	}
	if got := read(450, 300); got != "" {
		t.Fatalf("as of 450, after the deletion: %q", got)
	}
}
