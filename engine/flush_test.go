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
