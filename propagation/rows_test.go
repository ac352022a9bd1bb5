package propagation

import (
	"slices"
	"testing"
)

// TestRows_ChangeOrderIsTimeThenKey: pulls of changes read rows by change
// time, then by unique key, and resume after the last one read; bulk
// upserts lock rows in unique-key order.
func TestRows_ChangeOrderIsTimeThenKey(t *testing.T) {
	a := &RowKey{Namespace: "z", Identifier: "b", WindowMs: 60_000, Sequence: 5, Region: "eu", UpdatedMs: 100}
	b := &RowKey{Namespace: "z", Identifier: "a", WindowMs: 60_000, Sequence: 5, Region: "eu", UpdatedMs: 200}
	c := &RowKey{Namespace: "z", Identifier: "c", WindowMs: 60_000, Sequence: 5, Region: "eu", UpdatedMs: 200}
	if !newer(b, a) || !newer(c, b) || newer(a, c) {
		t.Fatal("change order is not time, then key")
	}
	if compareKeys(b, a) >= 0 || compareKeys(a, c) >= 0 {
		t.Fatal("unique-key order ignores the change time: a < b < c by identifier")
	}
	rows := []*CountRow{{Identifier: "c"}, {Identifier: "a", Sequence: 2}, {Identifier: "a", Sequence: 1}}
	slices.SortFunc(rows, compareCount)
	if rows[0].Sequence != 1 || rows[1].Sequence != 2 || rows[2].Identifier != "c" {
		t.Fatalf("upsert order: %+v", rows)
	}
}

// TestRows_ExpireWhenTheCellStopsWeighing: a cell's rows matter until the
// end of the next window, where it weighs as the previous cell.
func TestRows_ExpireWhenTheCellStopsWeighing(t *testing.T) {
	if got := expiresMs(10, 60_000); got != 12*60_000 {
		t.Fatalf("expiresMs(10, 1m) = %d, want the end of window 11", got)
	}
	o := OverrideRow{ExpiresMs: 1000}
	if !o.Live(999) || o.Live(1000) || (&OverrideRow{Deleted: true}).Live(0) || !(&OverrideRow{}).Live(1<<60) {
		t.Fatal("an override lives until its expiry, never once removed, forever without one")
	}
}
