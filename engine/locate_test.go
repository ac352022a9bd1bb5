package engine

import (
	"testing"
	"time"
)

func TestDecide_LongIdentifiersAreHashedAndDistinct(t *testing.T) {
	e, _ := newTestEngine(t, Config{})
	long1 := string(make([]byte, 70000))
	long2 := long1[:69999] + "x"
	e.Decide(bg, lim(long1, time.Minute, 1, 1))
	if d := e.Decide(bg, lim(long2, time.Minute, 1, 1)); !d.Allowed {
		t.Fatal("two different long identifiers share a count")
	}
	if d := e.Decide(bg, lim(long1, time.Minute, 1, 1)); d.Allowed {
		t.Fatal("the same long identifier got a fresh count")
	}
	h := NormalizeIdentifier(long1)
	if len(h) != MaxIdentifierLen+1 {
		t.Fatalf("hashed identifier is %d bytes, want %d", len(h), MaxIdentifierLen+1)
	}
	if d := e.Decide(bg, lim(h, time.Minute, 1, 1)); d.Allowed == false {
		// h itself is longer than the bound, so it is hashed again and
		// cannot land on long1's entry.
		t.Fatal("the hash of an identifier, sent as an identifier, collided with it")
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
			if c.seq() != seq || c.count.Load() != tc.want {
				t.Fatalf("upgraded cell: seq %d count %d, want seq %d count %d", c.seq(), c.count.Load(), seq, tc.want)
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

// TestCell_AnUpgradeWithoutAnOriginKeepsTheUnitsOfACellLetGoMeanwhile: a
// plain cell upgraded after the engine let its origin go (a reload
// without Redis) hands its units over as pending, for the next origin.
// A forget between the swap and the hand-over found the new cell empty
// and remembered nothing, and the hand-over then put the units where no
// entry and no grave would find them.
func TestCell_AnUpgradeWithoutAnOriginKeepsTheUnitsOfACellLetGoMeanwhile(t *testing.T) {
	e, _, l, seq := localUnits(t, time.Hour, 1000)
	o := newMemOrigin()
	e.SetOrigin(o)
	e.SetOrigin(nil) // the plain cell, untouched meanwhile, stays plain
	ran := false
	testHookUpgraded = func(*cell) {
		testHookUpgraded, ran = nil, true
		if !e.Forget(l.Key) {
			t.Error("nothing to forget")
		}
	}
	defer func() { testHookUpgraded = nil }()
	// A request that costs nothing (a request that charges gives the cell
	// to the graves itself, units and all).
	l.Cost = 0
	if !e.Decide(bg, l).Allowed {
		t.Fatal("denied")
	}
	if !ran {
		t.Fatal("the decision upgraded no cell")
	}
	e.SetOrigin(o)
	if err := e.Flush(bg); err != nil {
		t.Fatal(err)
	}
	if got := o.total(l.Key, seq); got != 3 {
		t.Fatalf("origin total = %d, want the 3 units of the plain cell (lost units: %d)", got, e.Stats().LostUnits)
	}
}
