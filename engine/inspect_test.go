package engine

import (
	"testing"
	"time"
)

func TestScan_KeepsTheFirstKeysInOrder(t *testing.T) {
	e, _ := newTestEngine(t, manual(Config{}))
	ids := []string{"m", "c", "x", "a", "q", "b", "z", "d"}
	for _, id := range ids {
		e.Decide(bg, lim(id, time.Minute, 10, 1))
		e.Decide(bg, lim(id, time.Hour, 10, 1))
	}
	got := e.Scan("zone", "", 5)
	want := []Key{{"zone", "a", time.Minute}, {"zone", "a", time.Hour}, {"zone", "b", time.Minute}, {"zone", "b", time.Hour}, {"zone", "c", time.Minute}}
	if len(got) != len(want) {
		t.Fatalf("Scan returned %d keys, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i].Key != want[i] {
			t.Fatalf("Scan[%d] = %v, want %v", i, got[i].Key, want[i])
		}
	}
	if all := e.Scan("zone", "", -1); len(all) != 2*len(ids) {
		t.Fatalf("Scan(-1) returned %d keys, want %d", len(all), 2*len(ids))
	}
}

// TestOverlay_RaisesTheKeyToTheRegionsTotals: the region's totals raise
// what this process holds of a key, add a cell it does not hold, and
// weigh in the effective count; nothing is made for a key nobody counted.
func TestOverlay_RaisesTheKeyToTheRegionsTotals(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	l := lim("k", time.Minute, 100, 1)
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	decideN(e, l, 3)
	clk.Advance(15 * time.Second) // the previous cell weighs three quarters
	ks, ok := e.Overlay(l.Key, Totals{Cur: 10, Prev: 8, Global: 2})
	if !ok || len(ks.Cells) != 2 {
		t.Fatalf("overlay %+v (ok %v), want the current cell and the previous one", ks, ok)
	}
	if c := ks.Cells[0]; c.Sequence != seq || c.Regional != 10 || c.Global != 2 {
		t.Fatalf("current cell %+v, want regional 10 and global 2", c)
	}
	if c := ks.Cells[1]; c.Sequence != seq-1 || c.Regional != 8 {
		t.Fatalf("previous cell %+v, want the region's 8", c)
	}
	if ks.Effective != 10+2+6 {
		t.Fatalf("effective %d, want 10 + 2 + ¾ of 8", ks.Effective)
	}
	if ks, _ := e.Overlay(l.Key, Totals{Cur: 1}); ks.Cells[0].Regional != 3 {
		t.Fatalf("a smaller total lowered the count: %+v", ks.Cells[0])
	}
	if _, ok := e.Overlay(lim("nobody", time.Minute, 100, 1).Key, Totals{}); ok {
		t.Fatal("an overlay of a key nobody counted reported one")
	}
	if _, ok := e.Overlay(Key{Namespace: "nozone", Identifier: "k", Window: time.Minute}, Totals{Cur: 5}); ok {
		t.Fatal("an overlay found a key of a zone nobody made")
	}
}

// TestStrictKeys_SortedUntilTheirDeadline: the keys in strict mode, in
// order, each until a window after its last denial, and none after that.
func TestStrictKeys_SortedUntilTheirDeadline(t *testing.T) {
	e, clk, _ := withOrigin(t, Config{})
	for _, id := range []string{"b", "a"} {
		e.Decide(bg, lim(id, time.Minute, 1, 1))
		if e.Decide(bg, lim(id, time.Minute, 1, 1)).Allowed {
			t.Fatal("a limit of 1 admitted two")
		}
	}
	until := clk.Now().Add(time.Minute)
	got := e.StrictKeys()
	if len(got) != 2 || got[0].Key.Identifier != "a" || got[1].Key.Identifier != "b" || !got[0].Until.Equal(until) {
		t.Fatalf("strict keys %+v, want a then b until %v", got, until)
	}
	if n := e.Stats().StrictKeys; n != 2 {
		t.Fatalf("Stats says %d strict keys, want 2", n)
	}
	clk.Advance(time.Minute)
	if got := e.StrictKeys(); len(got) != 0 {
		t.Fatalf("strict keys %+v past their deadline", got)
	}
	// The count (the strict_keys gauge, the status's strict_keys) agrees
	// with the listing: it counted the lapsed keys until the next sweep.
	if n := e.Stats().StrictKeys; n != 0 {
		t.Fatalf("Stats says %d strict keys past their deadline, want 0 as the listing", n)
	}
}

// TestInspect_ARotatedKeyWasViewedWhenItsPreviousCellWas: a key's view
// of the origin is its last read or replay, of either cell; a cell just
// rotated to has none of its own. The reference test weighs a decision
// against what the others admitted since that view (seed
// 1795598073465871912 judged a rotated key as never viewed).
func TestInspect_ARotatedKeyWasViewedWhenItsPreviousCellWas(t *testing.T) {
	e, clk, _ := withOrigin(t, Config{})
	// A limit far above one request: the rotated cell decides unread.
	l := lim("k", time.Second, 20<<10, 21)
	e.Decide(bg, l) // the cold read (a cost over 1/1024 of the limit): the key's view
	viewed := clk.Now()
	clk.Advance(time.Second)
	l.Cost = 1
	e.Decide(bg, l)
	ks, _ := e.Inspect(l.Key)
	if len(ks.Cells) != 2 || !ks.ViewedAt.Equal(viewed) {
		t.Fatalf("ViewedAt %v with cells %+v, want %v: the previous cell's read", ks.ViewedAt, ks.Cells, viewed)
	}
}
