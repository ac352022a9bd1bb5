// Package testclock is the fake clock of the project's tests: it moves only
// when a test moves it, so a test of windows and timeouts never sleeps.
package testclock

import (
	"sync/atomic"
	"time"
)

// Clock is a clock that tests set and advance by hand. It is safe for
// concurrent use: the engine's goroutines read it while the test moves it.
type Clock struct{ ns atomic.Int64 }

// New returns a clock that reads t until it is moved.
func New(t time.Time) *Clock {
	c := new(Clock)
	c.Set(t)
	return c
}

// Now is the clock's time; pass it as the engine's Config.Now.
func (c *Clock) Now() time.Time { return time.Unix(0, c.ns.Load()) }

// Set moves the clock to t, forwards or back.
func (c *Clock) Set(t time.Time) { c.ns.Store(t.UnixNano()) }

// Advance moves the clock forward by d.
func (c *Clock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

// UnixMilli is Now in milliseconds, the engine's resolution.
func (c *Clock) UnixMilli() int64 { return c.ns.Load() / int64(time.Millisecond) }

// FreshWindow is for tests of separate processes, which cannot share a
// fake clock: it returns the whole-second window length in [lo, hi] whose
// current window began most recently before now, among those with at
// least need left. Windows are aligned to the Unix epoch, as the engine's
// are, so a test that configures this length runs inside one window from
// now on without sleeping to a window border. ok is false when no length
// in the range leaves need (with a range of a minute or more of lengths
// and need well below lo, that does not happen in practice).
func FreshWindow(now time.Time, lo, hi, need time.Duration) (window time.Duration, ok bool) {
	ms := now.UnixMilli()
	best := time.Duration(-1)
	for w := lo.Truncate(time.Second); w <= hi; w += time.Second {
		if w <= 0 {
			continue
		}
		elapsed := time.Duration(ms%w.Milliseconds()) * time.Millisecond
		if w-elapsed < need {
			continue
		}
		if best < 0 || elapsed < time.Duration(ms%best.Milliseconds())*time.Millisecond {
			best = w
		}
	}
	return best, best > 0
}
