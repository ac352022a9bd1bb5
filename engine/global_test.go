package engine

import (
	"strconv"
	"sync"
	"testing"
	"time"
)

// fakeGlobal records what the engine tells the cross-region layer; onEntry,
// if set, runs inside EntryCreated (as a layer applying waiting imports).
type fakeGlobal struct {
	mu      sync.Mutex
	entries []Key
	denials []GlobalDenial
	onEntry func(Key, int64)
}

func (f *fakeGlobal) EntryCreated(key Key, seq int64) {
	f.mu.Lock()
	f.entries = append(f.entries, key)
	cb := f.onEntry
	f.mu.Unlock()
	if cb != nil {
		cb(key, seq)
	}
}

func (f *fakeGlobal) FirstDenial(d GlobalDenial) {
	f.mu.Lock()
	f.denials = append(f.denials, d)
	f.mu.Unlock()
}

func TestGlobal_ImportIsWeighedAndKeptApart(t *testing.T) {
	e, _ := newTestEngine(t, Config{})
	key := Key{Namespace: "zone", Identifier: "k", Window: time.Minute}
	e.Zone("zone", time.Minute)
	seq := epoch / time.Minute.Milliseconds()
	if !e.ImportGlobal(key, seq, 8, true) {
		t.Fatal("import into a zone that exists was not applied")
	}
	admitted := admittedOf(e, lim("k", time.Minute, 10, 1), 10)
	if admitted != 2 {
		t.Fatalf("admitted %d with 8 of 10 imported, want 2", admitted)
	}
	ks, _ := e.Inspect(key)
	if c := ks.Cells[0]; c.Regional != 2 || c.Global != 8 {
		t.Fatalf("cell = %+v, want regional 2 and global 8 kept apart", c)
	}
	// Imports only raise: a smaller sum changes nothing.
	e.ImportGlobal(key, seq, 3, true)
	if ks, _ := e.Inspect(key); ks.Cells[0].Global != 8 {
		t.Fatalf("global fell to %d after a smaller import", ks.Cells[0].Global)
	}
}

func TestGlobal_ImportNeverRotatesBackwards(t *testing.T) {
	e, clk := newTestEngine(t, Config{})
	const w = time.Minute
	key := Key{Namespace: "zone", Identifier: "k", Window: w}
	seq := epoch / w.Milliseconds()
	e.Decide(bg, lim("k", w, 100, 1))
	clk.Advance(w + 30*time.Second) // now in seq+1, half way
	cases := []struct {
		name  string
		seq   int64
		apply bool
	}{
		{"two windows old", seq - 1, false},
		{"future", seq + 2, false},
		{"previous", seq, true},
		{"current", seq + 1, true},
	}
	for _, tc := range cases {
		if got := e.ImportGlobal(key, tc.seq, 10, true); got != tc.apply {
			t.Errorf("%s: applied %v, want %v", tc.name, got, tc.apply)
		}
	}
	ks, _ := e.Inspect(key)
	if len(ks.Cells) != 2 || ks.Cells[0].Sequence != seq+1 || ks.Cells[1].Sequence != seq {
		t.Fatalf("cells = %+v, want seq+1 then seq", ks.Cells)
	}
	// 10 current + ⌊(1 regional + 10 global) × ½⌋ = 15.
	if ks.Effective != 15 {
		t.Fatalf("effective = %d, want 15", ks.Effective)
	}
}

func TestGlobal_ImportForPreviousCellOfUnseenKey(t *testing.T) {
	e, clk := newTestEngine(t, Config{})
	const w = time.Minute
	e.Zone("zone", w)
	key := Key{Namespace: "zone", Identifier: "fresh", Window: w}
	seq := epoch / w.Milliseconds()
	clk.Advance(w + 15*time.Second) // a quarter into seq+1
	if !e.ImportGlobal(key, seq, 40, true) {
		t.Fatal("previous-cell import of an unseen key not applied")
	}
	// 40 × ¾ = 30 weighed; a limit of 40 leaves 10.
	admitted := admittedOf(e, lim("fresh", w, 40, 1), 20)
	if admitted != 10 {
		t.Fatalf("admitted %d, want 10", admitted)
	}
}

func TestGlobal_ImportWithoutCreateOrZone(t *testing.T) {
	e, _ := newTestEngine(t, Config{})
	seq := epoch / time.Minute.Milliseconds()
	if e.ImportGlobal(Key{Namespace: "nozone", Identifier: "k", Window: time.Minute}, seq, 5, true) {
		t.Fatal("an import created a zone no handler defines")
	}
	e.Zone("zone", time.Minute)
	key := Key{Namespace: "zone", Identifier: "k", Window: time.Minute}
	if e.ImportGlobal(key, seq, 5, false) || e.HasEntry(key) {
		t.Fatal("an import without create made an entry")
	}
}

func TestGlobal_FirstDenialCarriesRegionalCountsOnly(t *testing.T) {
	e, clk := newTestEngine(t, Config{})
	g := new(fakeGlobal)
	e.SetGlobal(g)
	const w = time.Minute
	key := Key{Namespace: "zone", Identifier: "k", Window: w}
	seq := epoch / w.Milliseconds()
	for i := 0; i < 6; i++ {
		e.Decide(bg, lim("k", w, 100, 1))
	}
	clk.Advance(w + 30*time.Second)
	e.ImportGlobal(key, seq+1, 50, true)
	for i := 0; i < 60; i++ {
		e.Decide(bg, lim("k", w, 100, 1))
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.denials) != 1 {
		t.Fatalf("%d first denials, want 1", len(g.denials))
	}
	d := g.denials[0]
	// 50 global + 3 weighed previous leave 47 regional admissions.
	if d.Sequence != seq+1 || d.Cur != 47 || d.Prev != 6 || d.RegionalUsed != 50 || d.Used != 100 {
		t.Fatalf("denial = seq %d cur %d prev %d regional used %d used %d", d.Sequence-seq, d.Cur, d.Prev, d.RegionalUsed, d.Used)
	}
}

func TestGlobal_EntryCreatedRunsBeforeTheFirstDecision(t *testing.T) {
	e, _ := newTestEngine(t, Config{})
	g := new(fakeGlobal)
	g.onEntry = func(k Key, seq int64) { e.ImportGlobal(k, seq, 10, false) }
	e.SetGlobal(g)
	if d := e.Decide(bg, lim("k", time.Minute, 10, 1)); d.Allowed {
		t.Fatal("the first request passed although EntryCreated imported the whole limit")
	}
	e.Decide(bg, lim("k", time.Minute, 10, 1))
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.entries) != 1 {
		t.Fatalf("EntryCreated called %d times for one key, want 1", len(g.entries))
	}
}

func TestGlobal_ScanAndMarkPublished(t *testing.T) {
	e, _ := newTestEngine(t, Config{})
	for i := 0; i < 4; i++ {
		e.Decide(bg, lim("long", time.Minute, 10, 1))
		e.Decide(bg, lim("short", time.Second, 10, 1))
	}
	key := Key{Namespace: "zone", Identifier: "long", Window: time.Minute}
	seq := epoch / time.Minute.Milliseconds()
	e.ImportGlobal(key, seq, 3, false)
	var got []CellView
	e.ScanCells(time.Minute, func(v *CellView) bool { got = append(got, *v); return true })
	if len(got) != 1 {
		t.Fatalf("scanned %d cells, want only the one-minute key's: %+v", len(got), got)
	}
	if v := got[0]; v.Key != key || v.Sequence != seq || v.Regional != 4 || v.Global != 3 || v.Effective != 7 || v.Published != 0 {
		t.Fatalf("view = %+v", v)
	}
	if !e.MarkPublished(key, seq, 4) || !e.MarkPublished(key, seq, 2) {
		t.Fatal("MarkPublished on a held cell reported false")
	}
	e.ScanCells(time.Minute, func(v *CellView) bool { got[0] = *v; return true })
	if got[0].Published != 4 {
		t.Fatalf("published = %d, want 4 (the mark never falls)", got[0].Published)
	}
	if !e.RaiseRegional(key, seq, 9) || e.RaiseRegional(key, seq-5, 9) {
		t.Fatal("RaiseRegional: wrong cells")
	}
	if ks, _ := e.Inspect(key); ks.Cells[0].Regional != 9 || ks.Cells[0].Global != 3 {
		t.Fatalf("after RaiseRegional: %+v", ks.Cells[0])
	}
}

func TestGlobal_SwapOnlyReplacesItsOwn(t *testing.T) {
	e, _ := newTestEngine(t, Config{})
	a, b := new(fakeGlobal), new(fakeGlobal)
	e.SetGlobal(a)
	if !e.swapGlobal(a, b) || e.swapGlobal(a, nil) {
		t.Fatal("swap semantics wrong")
	}
	e.Decide(bg, lim("k", time.Minute, 10, 1))
	if len(a.entries) != 0 || len(b.entries) != 1 {
		t.Fatalf("entries told to a %d, b %d; want 0 and 1", len(a.entries), len(b.entries))
	}
	if !e.swapGlobal(b, nil) {
		t.Fatal("detaching the current layer failed")
	}
}

func TestCell_ImportAndPublishUpgradeAPlainCell(t *testing.T) {
	e, clk, l, seq := localUnits(t, time.Minute, 100)
	clk.Advance(time.Minute)
	e.Decide(bg, l)
	en := entryOf(t, e, l.Key)
	if en.prev.Load().links() != nil || en.cur.Load().links() != nil {
		t.Fatal("a local-only engine made a linked cell")
	}
	e.SetGlobal(nopGlobal{})
	if !e.ImportGlobal(l.Key, seq, 4, false) {
		t.Fatal("import into the previous cell not applied")
	}
	if !e.MarkPublished(l.Key, seq+1, 1) {
		t.Fatal("publication of the current cell not recorded")
	}
	p, c := en.prev.Load(), en.cur.Load()
	if p.links() == nil || c.links() == nil {
		t.Fatal("a plain cell took a global count or a publication mark")
	}
	if p.count.Load() != 3 || p.links().global.Load() != 4 || c.count.Load() != 1 || c.links().published.Load() != 1 {
		t.Fatalf("prev count %d global %d, cur count %d published %d; want 3, 4, 1, 1",
			p.count.Load(), p.links().global.Load(), c.count.Load(), c.links().published.Load())
	}
	if p.pending() != 0 || c.pending() != 0 {
		t.Fatal("units pending in an engine without origin")
	}
	// The import weighs: 1 + 4 + 3 (weighted in full at the window's start)
	// + 1 fits a limit of 9, the next does not.
	l.Limit = 9
	if !e.Decide(bg, l).Allowed || e.Decide(bg, l).Allowed {
		t.Fatal("the imported count was not weighed")
	}
}

// nopGlobal is a cross-region layer that does nothing: what the request
// path pays for the hooks themselves.
type nopGlobal struct{}

func (nopGlobal) EntryCreated(Key, int64)  {}
func (nopGlobal) FirstDenial(GlobalDenial) {}

// BenchmarkGlobal_FirstTouch decides a new key per iteration (entry
// creation is where EntryCreated runs), without and with a layer attached.
func BenchmarkGlobal_FirstTouch(b *testing.B) {
	for _, bc := range []struct {
		name string
		g    Global
	}{{"none", nil}, {"attached", nopGlobal{}}} {
		b.Run(bc.name, func(b *testing.B) {
			e, _ := newTestEngine(b, Config{MaxEntries: 1 << 30})
			if bc.g != nil {
				e.SetGlobal(bc.g)
			}
			ids := make([]string, b.N)
			for i := range ids {
				ids[i] = "key-" + strconv.Itoa(i)
			}
			z := e.Zone("zone", time.Minute)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				e.Decide(bg, Limit{Key: Key{Namespace: "zone", Identifier: ids[i], Window: time.Minute}, Zone: z, Limit: 10, Cost: 1})
			}
		})
	}
}

// BenchmarkGlobal_WarmDeny is the deny path of a warm key with a layer
// attached: the first denial already notified, so no hook runs.
func BenchmarkGlobal_WarmDeny(b *testing.B) {
	e, _ := newTestEngine(b, Config{})
	e.SetGlobal(nopGlobal{})
	l := lim("api-key-0123456789", time.Hour, 10, 1)
	l.Zone = e.Zone(l.Namespace, l.Window)
	for i := 0; i < 11; i++ {
		e.Decide(bg, l)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if e.Decide(bg, l).Allowed {
			b.Fatal("allowed past the limit")
		}
	}
}
