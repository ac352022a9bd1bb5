package engine

import (
	"reflect"
	"testing"
	"time"
	"unsafe"

	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// hasPointers reports whether a value of type t holds anything the garbage
// collector scans.
func hasPointers(t reflect.Type) bool {
	switch k := t.Kind(); {
	case k >= reflect.Bool && k <= reflect.Complex128:
		return false
	case k == reflect.Array:
		return t.Len() > 0 && hasPointers(t.Elem())
	case k == reflect.Struct:
		for i := range t.NumField() {
			if hasPointers(t.Field(i).Type) {
				return true
			}
		}
		return false
	}
	return true
}

func TestCell_SizesAndNoPointers(t *testing.T) {
	if s := unsafe.Sizeof(cell{}); s != 32 {
		t.Errorf("a plain cell is %d bytes, want 32", s)
	}
	if s := unsafe.Sizeof(linkedCell{}); s != 96 {
		t.Errorf("a linked cell is %d bytes, want 96 (a size class of its own)", s)
	}
	for _, typ := range []reflect.Type{reflect.TypeFor[cell](), reflect.TypeFor[linkedCell]()} {
		if hasPointers(typ) {
			t.Errorf("%v holds a pointer: the garbage collector would scan every cell", typ)
		}
	}
}

// entryOf returns the entry of key, failing the test if there is none.
func entryOf(t *testing.T, e *Engine, key Key) *entry {
	t.Helper()
	en, ok := e.Zone(key.Namespace, key.Window).entries.Load(key.Identifier)
	if !ok {
		t.Fatalf("no entry for %v", key)
	}
	return en
}

func TestCell_PlainOnlyWhenTheEngineSyncsWithNothing(t *testing.T) {
	for _, tc := range []struct {
		name   string
		attach func(e *Engine)
		linked bool
	}{
		{"local-only", func(*Engine) {}, false},
		{"origin", func(e *Engine) { e.SetOrigin(newMemOrigin()) }, true},
		{"global layer", func(e *Engine) { e.SetGlobal(nopGlobal{}) }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, clk := newTestEngine(t, manual(Config{}))
			tc.attach(e)
			l := lim("k", time.Minute, 10, 1)
			e.Decide(bg, l) // the entry's first cell
			clk.Advance(time.Minute)
			e.Decide(bg, l) // a rotated cell
			en := entryOf(t, e, l.Key)
			for name, c := range map[string]*cell{"first": en.prev.Load(), "rotated": en.cur.Load()} {
				if c == nil {
					t.Fatalf("no %s cell", name)
				}
				if got := c.links() != nil; got != tc.linked {
					t.Errorf("%s cell: linked = %v, want %v", name, got, tc.linked)
				}
			}
		})
	}
}

func TestCell_UpgradeOnSetOriginReplaysEveryUnit(t *testing.T) {
	for _, tc := range []struct {
		name          string
		limit         int64
		before, after int
		want          int64
	}{
		// The units before the origin reach it with the first ones after.
		{"allowed after", 1000, 3, 2, 5},
		// A denial charges nothing, but the upgrade queues the cell.
		{"denied after", 3, 3, 1, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, clk := newTestEngine(t, manual(Config{}))
			l := lim("k", time.Hour, tc.limit, 1)
			seq := clk.UnixMilli() / time.Hour.Milliseconds()
			for i := 0; i < tc.before; i++ {
				if !e.Decide(bg, l).Allowed {
					t.Fatal("denied below the limit")
				}
			}
			en := entryOf(t, e, l.Key)
			plain := en.cur.Load()
			if plain.links() != nil {
				t.Fatal("a local-only engine made a linked cell")
			}
			o := newMemOrigin()
			e.SetOrigin(o)
			for i := 0; i < tc.after; i++ {
				e.Decide(bg, l)
			}
			c := en.cur.Load()
			if c == plain || c.links() == nil {
				t.Fatal("the first decision with an origin did not upgrade the cell")
			}
			if c.seq != seq || c.count.Load() != tc.want {
				t.Fatalf("upgraded cell: seq %d count %d, want seq %d count %d", c.seq, c.count.Load(), seq, tc.want)
			}
			if _, err := replayBoth(e); err != nil {
				t.Fatal(err)
			}
			if got := o.total(l.Key, seq); got != tc.want {
				t.Fatalf("origin total = %d, want every unit (%d) once", got, tc.want)
			}
			if ks, _ := e.Inspect(l.Key); ks.Cells[0].Regional != tc.want || ks.Cells[0].Pending != 0 {
				t.Fatalf("cell = %+v, want regional %d and nothing pending", ks.Cells[0], tc.want)
			}
		})
	}
}

// localUnits returns a local-only engine whose key k, with the given
// window and limit, holds 3 units in plain cells, and the key's sequence.
func localUnits(t *testing.T, window time.Duration, limit int64) (*Engine, *testclock.Clock, Limit, int64) {
	t.Helper()
	e, clk := newTestEngine(t, manual(Config{}))
	l := lim("k", window, limit, 1)
	seq := clk.UnixMilli() / window.Milliseconds()
	for i := 0; i < 3; i++ {
		e.Decide(bg, l)
	}
	return e, clk, l, seq
}

func TestCell_UpgradeKeepsUnitsChargedDuringTheCopy(t *testing.T) {
	e, _, l, seq := localUnits(t, time.Hour, 1000)
	o := newMemOrigin()
	e.SetOrigin(o)
	// A request that located the plain cell before the origin was set
	// charges it between the copy and the swap.
	testHookUpgrade = func(c *cell) { c.count.Add(2) }
	defer func() { testHookUpgrade = nil }()
	e.Decide(bg, l)
	testHookUpgrade = nil
	c := entryOf(t, e, l.Key).cur.Load()
	if got := c.count.Load(); got != 6 {
		t.Fatalf("count = %d, want 3 copied + 2 charged during the copy + 1", got)
	}
	if _, err := replayBoth(e); err != nil {
		t.Fatal(err)
	}
	if got := o.total(l.Key, seq); got != 6 {
		t.Fatalf("origin total = %d, want 6", got)
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
