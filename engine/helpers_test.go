package engine

import (
	"context"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// epoch is a window-aligned start time for tests (aligned to every window
// the tests use: 1 s, 1 min, 1 h, 1 day).
const epoch = int64(1_700_000_000) / 86400 * 86400 * 1000

// newTestEngine returns an engine on a fake clock, closed at test end.
func newTestEngine(t testing.TB, cfg Config) (*Engine, *testclock.Clock) {
	t.Helper()
	clk := testclock.New(time.UnixMilli(epoch))
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
