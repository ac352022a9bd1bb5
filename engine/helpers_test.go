package engine

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

// fakeClock is a clock tests move by hand.
type fakeClock struct{ ms atomic.Int64 }

func newFakeClock(ms int64) *fakeClock {
	c := &fakeClock{}
	c.ms.Store(ms)
	return c
}

func (c *fakeClock) Now() time.Time      { return time.UnixMilli(c.ms.Load()) }
func (c *fakeClock) Set(ms int64)        { c.ms.Store(ms) }
func (c *fakeClock) Add(d time.Duration) { c.ms.Add(d.Milliseconds()) }
func (c *fakeClock) AddMs(ms int64)      { c.ms.Add(ms) }
func (c *fakeClock) UnixMilli() int64    { return c.ms.Load() }

// epoch is a window-aligned start time for tests (aligned to every window
// the tests use: 1 s, 1 min, 1 h, 1 day).
const epoch = int64(1_700_000_000) / 86400 * 86400 * 1000

// newTestEngine returns an engine on a fake clock, closed at test end.
func newTestEngine(t testing.TB, cfg Config) (*Engine, *fakeClock) {
	t.Helper()
	clk := newFakeClock(epoch)
	if cfg.Now == nil {
		cfg.Now = clk.Now
	}
	e := New(cfg)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = e.Close(ctx)
	})
	return e, clk
}

func lim(id string, window time.Duration, limit, cost int64) Limit {
	return Limit{Key: Key{Namespace: "zone", Identifier: id, Window: window}, Limit: limit, Cost: cost}
}
