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
