package engine

import (
	"testing"
	"time"
)

// TestClock_RetryAfterOfACellAheadCountsTheWaitForItsWindow: a clock that
// steps back by less than a window keeps counting in the newer cell (see
// TestClock_CellOneWindowAheadIsKept). A request denied there must be told
// a Retry-After after which it passes, and a Reset that is the end of the
// cell's window: the newer cell's window has not begun yet, so its units
// weigh whole until then.
func TestClock_RetryAfterOfACellAheadCountsTheWaitForItsWindow(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	l := lim("k", time.Minute, 1, 1)
	clk.Set(time.UnixMilli(epoch + 61_000)) // 1 s into window s+1
	if d := e.Decide(bg, l); !d.Allowed {
		t.Fatalf("first request denied: %+v", d)
	}
	clk.Set(time.UnixMilli(epoch + 50_000)) // back 11 s: 10 s before window s+1 begins
	d := e.Decide(bg, l)
	if d.Allowed {
		t.Fatalf("admitted past the limit after a step back: %+v", d)
	}
	// The unit weighs ⌊1 × (1 − p)⌋ = 0 from 1 ms into window s+2:
	// 70 s + 1 ms from now. The cell's window ends 70 s from now.
	if want := 70*time.Second + time.Millisecond; d.RetryAfter != want {
		t.Errorf("RetryAfter %v, want %v", d.RetryAfter, want)
	}
	if want := 70 * time.Second; d.Reset != want {
		t.Errorf("Reset %v, want %v", d.Reset, want)
	}
	clk.Advance(d.RetryAfter)
	if d2 := e.Decide(bg, l); !d2.Allowed {
		t.Errorf("denied after waiting the Retry-After of %v: %+v", d.RetryAfter, d2)
	}
}
