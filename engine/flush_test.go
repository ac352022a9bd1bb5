package engine

import (
	"testing"
	"time"
)

func TestReplay_MergesOtherNodesAndNeverDoubles(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", time.Hour, 1000, 1)
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	for i := 0; i < 5; i++ {
		e.Decide(bg, l)
	}
	o.add(l.Key, seq, 100)
	if n, err := replayBoth(e); err != nil || n != 1 {
		t.Fatalf("ReplayOnce = %d, %v", n, err)
	}
	if got := o.total(l.Key, seq); got != 105 {
		t.Fatalf("origin total = %d, want 105", got)
	}
	ks, _ := e.Inspect(l.Key)
	if ks.Cells[0].Regional != 105 || ks.Cells[0].Pending != 0 {
		t.Fatalf("cell = %+v, want regional 105 and nothing pending", ks.Cells[0])
	}
	// A second replay with nothing new sends nothing.
	if n, _ := replayBoth(e); n != 0 {
		t.Fatalf("replayed %d cells with nothing pending", n)
	}
}

func TestReplay_FailedFlushKeepsUnitsForLater(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", time.Hour, 1000, 1)
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	for i := 0; i < 7; i++ {
		e.Decide(bg, l)
	}
	o.failFlushes(errOriginDown)
	if _, err := replayBoth(e); err == nil {
		t.Fatal("a failed flush reported no error")
	}
	o.failFlushes(nil)
	e.Decide(bg, l)
	if _, err := replayBoth(e); err != nil {
		t.Fatal(err)
	}
	if got := o.total(l.Key, seq); got != 8 {
		t.Fatalf("origin total = %d, want all 8 units exactly once", got)
	}
	en, _ := e.Zone("zone", time.Hour).entries.Load("k")
	if own := en.cur.Load().links().own.Load(); own != 8 {
		t.Fatalf("own contribution = %d, want 8", own)
	}
}

// TestFlush_DropUnsentGivesUpOnlyWhatNoOriginHas: the units the origin
// took stay counted as sent, the rest are reported lost, and the cell
// keeps counting both.
func TestFlush_DropUnsentGivesUpOnlyWhatNoOriginHas(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", time.Hour, 100, 1)
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	decideN(e, l, 3)
	replayAll(t, e)
	decideN(e, l, 2)
	if lost := e.DropUnsent(); lost != 2 {
		t.Fatalf("DropUnsent = %d, want the 2 units not replayed", lost)
	}
	replayAll(t, e)
	ks, _ := e.Inspect(l.Key)
	if s := e.Stats(); s.LostUnits != 2 || ks.Cells[0].Regional != 5 || o.total(l.Key, seq) != 3 {
		t.Fatalf("lost %d, cell %+v, origin %d; want 2 lost, all 5 counted here and the 3 sent at the origin",
			s.LostUnits, ks.Cells[0], o.total(l.Key, seq))
	}
}

// TestFlush_FlushToWritesToTheOriginGiven: a config's origin that is let go
// gets the pending units, whatever origin the engine uses.
func TestFlush_FlushToWritesToTheOriginGiven(t *testing.T) {
	e, clk, current := withOrigin(t, Config{})
	l := lim("k", time.Hour, 100, 1)
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	decideN(e, l, 4)
	old := newMemOrigin()
	if err := e.FlushTo(bg, old); err != nil {
		t.Fatal(err)
	}
	if got := old.total(l.Key, seq); got != 4 || current.total(l.Key, seq) != 0 {
		t.Fatalf("origin given %d, origin in use %d; want 4 and 0", got, current.total(l.Key, seq))
	}
	if err := e.FlushTo(bg, nil); err != nil {
		t.Fatalf("FlushTo(nil) = %v, want a no-op", err)
	}
}

// TestFlush_LeavesThePreviousCellOutOnceItIsFinal: a replay reads the
// previous cell (a command in Redis) only until the process has its final
// totals, a flush period into the window after an answer that held them;
// never with a cross-region layer, whose imports of it come later.
func TestFlush_LeavesThePreviousCellOutOnceItIsFinal(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", time.Minute, 1000, 1)
	e.Decide(bg, l) // the cold read, at the window's start
	replayAll(t, e)
	if n := o.noPrev.Load(); n != 0 {
		t.Fatalf("%d writes left the previous cell out at the window's start", n)
	}
	clk.Advance(time.Second) // well past a flush period (210 ms)
	e.Decide(bg, l)
	replayAll(t, e) // its answer holds the previous cell's final totals
	e.Decide(bg, l)
	replayAll(t, e)
	if n := o.noPrev.Load(); n != 1 {
		t.Fatalf("%d writes left the previous cell out, want the last one", n)
	}

	g, gclk, go2 := withOrigin(t, Config{})
	g.SetGlobal(nopGlobal{})
	for range 3 {
		g.Decide(bg, l)
		gclk.Advance(time.Second)
		replayAll(t, g)
	}
	if n := go2.noPrev.Load(); n != 0 {
		t.Fatalf("with a cross-region layer %d writes left the previous cell out", n)
	}
}
