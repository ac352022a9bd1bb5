package engine

import (
	"context"
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

// heldFlushes is an origin whose writes wait until release is closed.
type heldFlushes struct {
	*memOrigin
	entered chan struct{}
	release chan struct{}
}

func (h *heldFlushes) Flush(ctx context.Context, batch []Delta) error {
	h.entered <- struct{}{}
	<-h.release
	return h.memOrigin.Flush(ctx, batch)
}

// TestStats_PendingCellsCountsAWriteInFlight: a cell whose write has left
// the queue but not reached the origin still has units the origin lacks,
// so it counts as pending until the write returns (an operator, or a test
// waiting for a node's units to be in Redis, reads pending_cells).
func TestStats_PendingCellsCountsAWriteInFlight(t *testing.T) {
	e, _ := newTestEngine(t, manual(Config{}))
	o := &heldFlushes{memOrigin: newMemOrigin(), entered: make(chan struct{}), release: make(chan struct{})}
	e.SetOrigin(o)
	l := lim("k", time.Hour, 1000, 1)
	e.Decide(bg, l)
	if got := e.Stats().PendingCells; got != 1 {
		t.Fatalf("PendingCells = %d before the replay, want 1", got)
	}
	done := make(chan error)
	go func() {
		_, err := replayBoth(e)
		done <- err
	}()
	<-o.entered
	if got := e.Stats().PendingCells; got != 1 {
		t.Errorf("PendingCells = %d while the write is in flight, want 1", got)
	}
	close(o.release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := e.Stats().PendingCells; got != 0 {
		t.Fatalf("PendingCells = %d once the write returned, want 0", got)
	}
}
