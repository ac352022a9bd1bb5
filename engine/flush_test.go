package engine

import (
	"context"
	"errors"
	"fmt"
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
// totals, a flush period and a write's bound (1.21 s) into the window
// after an answer that held them; never with a cross-region layer, whose
// imports of it come later.
func TestFlush_LeavesThePreviousCellOutOnceItIsFinal(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	// A limit far above a request: its replays refresh it.
	l := lim("k", time.Minute, 1<<20, 1)
	e.Decide(bg, l) // at the window's start: its replay reads both cells
	replayAll(t, e)
	if n := o.noPrev.Load(); n != 0 {
		t.Fatalf("%d writes left the previous cell out at the window's start", n)
	}
	clk.Advance(time.Second) // within a flush period and a write's bound
	e.Decide(bg, l)
	replayAll(t, e)
	if n := o.noPrev.Load(); n != 0 {
		t.Fatalf("%d writes left the previous cell out a second into the window", n)
	}
	clk.Advance(time.Second) // past them
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

// TestFlush_AWriteAfterTheOthersMaySettleIsLate: the others take a cell's
// totals as final a flush period (two slow ticks and a fast one) and a
// write's bound into the next window (prevFinal); a write of the cell sent more than a slow tick
// and a fast one after its end is marked late (Delta.Late), so that the
// origin tells them, and one sent before is not: a write that failed then
// is late when it goes again after that.
func TestFlush_AWriteAfterTheOthersMaySettleIsLate(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	o := newMemOrigin()
	e.SetOrigin(o)
	w := time.Second
	end := time.UnixMilli((epoch/w.Milliseconds() + 1) * w.Milliseconds())
	clk.Set(end.Add(-time.Millisecond))
	l := lim("k", w, 10, 1)
	e.Decide(bg, l)
	held := e.Timing().SlowTick + e.Timing().FastTick
	clk.Set(end.Add(held - time.Millisecond))
	fail := errors.New("unreachable")
	o.flushErr.Store(&fail)
	for _, tier := range []Tier{Fast, Slow} {
		_, _ = e.ReplayOnce(bg, tier)
	}
	if sent, late := o.flushes.Load(), o.late.Load(); sent != 1 || late != 0 {
		t.Fatalf("%d writes sent, %d marked late, a slow and a fast tick after the window: want 1, none late", sent, late)
	}
	o.flushErr.Store(nil)
	clk.Set(end.Add(held))
	replayAll(t, e)
	if sent, late := o.flushes.Load(), o.late.Load(); sent != 2 || late != 1 {
		t.Fatalf("%d writes sent, %d marked late, once the window had ended a slow and a fast tick before: want the second late", sent, late)
	}
	if got := o.total(l.Key, end.UnixMilli()/w.Milliseconds()-1); got != 1 {
		t.Fatalf("the origin holds %d units of the cell, want 1", got)
	}
}

// TestClose_ReturnsWithTheOriginDown: the last flush of a process whose
// Redis is down fails, and the failed write queues its cells again; the
// flush sends each cell it found queued once, and returns the failure.
// Before the fix it popped the cells its own failure queued again, and
// Close spun for as long as the origin failed: the reference test's runs
// hung at their Close, and a Caddy process stopped with Redis down spun
// on a core until it exited without the flush (10 s to exit against 6).
func TestClose_ReturnsWithTheOriginDown(t *testing.T) {
	e, _ := newTestEngine(t, manual(Config{}))
	o := newMemOrigin()
	e.SetOrigin(o)
	for i := range 300 { // more than a batch
		e.Decide(bg, lim(fmt.Sprint("k", i), time.Minute, 100, 1))
	}
	o.down.Store(true)
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(bg, time.Minute)
		defer cancel()
		done <- e.Close(ctx)
	}()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("Close reported the last flush done with the origin down")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Close did not return within 30 s with the origin down")
	}
	// Each pass sends the queued cells, then the cells of live keys with
	// units (a failed write's among them): a few writes a pass, not a spin.
	if sent := o.flushes.Load(); sent > 6*flushPasses {
		t.Fatalf("%d writes for 300 cells (two batches) in %d passes: the flush spun", sent, flushPasses)
	}
}

// TestClose_AFailedWriteIsTriedAgain: the last flush's first write fails
// once (a Redis hiccup at shutdown); the cells only the queues hold (a
// key's cell it rotated past) go out in the next pass. Before the fix one
// pass sent each queued cell once, and those units were given up.
func TestClose_AFailedWriteIsTriedAgain(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	o := newMemOrigin()
	e.SetOrigin(o)
	l := lim("k", time.Minute, 1<<20, 1)
	e.Decide(bg, l)
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	clk.Advance(3 * time.Minute) // the key's next request rotates past its cell
	e.Decide(bg, l)
	o.flakyFlushes.Store(1)
	ctx, cancel := context.WithTimeout(bg, time.Minute)
	defer cancel()
	if err := e.Close(ctx); err != nil {
		t.Fatalf("Close: %v, want the second pass to succeed", err)
	}
	if got := o.total(l.Key, seq); got != 1 {
		t.Fatalf("the origin holds %d of the rotated cell's unit after a failed first write", got)
	}
}
