package engine

import (
	"testing"
	"time"
)

// TestStats_CountWhatTheEngineDidAndWhenTheOriginLastAnswered follows one
// key through a cold read, a replay, a failed replay and denials, and the
// counters an operator reads after each.
func TestStats_CountWhatTheEngineDidAndWhenTheOriginLastAnswered(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	if s := e.Stats(); s != (Stats{}) {
		t.Fatalf("a new engine's stats = %+v, want zero", s)
	}
	l := lim("k", time.Hour, 2, 1)
	e.Decide(bg, l)
	s := e.Stats()
	if s.Entries != 1 || s.Reads != 1 || s.SyncReads != 1 || !s.LastRead.Equal(clk.Now()) || s.PendingCells != 1 {
		t.Fatalf("after a cold read: %+v, want 1 entry, 1 read waited for at %v, 1 cell pending", s, clk.Now())
	}
	clk.Advance(time.Second)
	if _, err := replayBoth(e); err != nil {
		t.Fatal(err)
	}
	flushed := clk.Now()
	if s = e.Stats(); s.Flushes != 1 || !s.LastFlush.Equal(flushed) || s.PendingCells != 0 || s.FlushErrors != 0 {
		t.Fatalf("after a replay: %+v, want 1 flush at %v and nothing pending", s, flushed)
	}
	o.failFlushes(errOriginDown)
	clk.Advance(time.Second)
	e.Decide(bg, l)
	if _, err := replayBoth(e); err == nil {
		t.Fatal("a failed flush reported no error")
	}
	if s = e.Stats(); s.FlushErrors != 1 || s.Flushes != 1 || !s.LastFlush.Equal(flushed) {
		t.Fatalf("after a failed replay: %+v, want 1 error and the last flush still at %v", s, flushed)
	}
	decideN(e, l, 3)
	if s = e.Stats(); s.FirstDenials != 1 || s.StrictKeys != 1 || s.Entries != 1 {
		t.Fatalf("after three denials: %+v, want one first denial and one key in strict mode", s)
	}
}
