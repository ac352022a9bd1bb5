package origin

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

func TestWatchRestarts_SeesARestartedServer(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "w"})
	var seen atomic.Int64
	o.WatchRestarts(20*time.Millisecond, func() { seen.Add(1) })
	// Let it record the first run ID, then restart the server (empty).
	redistest.Eventually(t, 5*time.Second, "the watch checked once", func() bool { return o.runIDChecks.Load() > 0 })
	srv.Restart()
	redistest.Eventually(t, 5*time.Second, "restart noticed", func() bool { return seen.Load() == 1 })
	if got := o.Stats().Restarts; got != 1 {
		t.Fatalf("Stats().Restarts = %d, want 1", got)
	}
}

// TestRestart_IdleKeysGetTheirTotalsBack is the review's case: Redis
// restarted empty in the middle of a window, and a key that no node
// touches afterwards kept none of its units, so whichever node next saw
// it admitted them again. With the watch, each node sends its live cells'
// totals again within a check interval and a flush tick.
func TestRestart_IdleKeysGetTheirTotalsBack(t *testing.T) {
	srv := redistest.Start(t)
	clk := testclock.New(time.UnixMilli(windowStart(time.Minute) + 1000))
	a, b := newNode(t, srv.URL(), clk), newNode(t, srv.URL(), clk)
	for _, n := range []*node{a, b} {
		n.o.WatchRestarts(20*time.Millisecond, func() { n.e.Resend() })
	}
	k := engine.Key{Namespace: "api", Identifier: "idle", Window: time.Minute}
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	for i, n := range []*node{a, a, a, b, b} {
		for range 10 {
			if !n.e.Decide(context.Background(), engine.Limit{Key: k, Limit: 60, Cost: 1}).Allowed {
				t.Fatalf("request of round %d denied below the limit", i)
			}
		}
	}
	for _, n := range []*node{a, b} {
		if err := n.e.Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	total := func() int64 {
		v, _ := cellTotal(context.Background(), srv.Client(), DefaultPrefix, k, seq)
		return v
	}
	if got := total(); got != 50 {
		t.Fatalf("Redis holds %d before the restart, want 50", got)
	}
	// Both watches have their reference before the restart.
	redistest.Eventually(t, 5*time.Second, "watches ready", func() bool {
		return a.o.runIDChecks.Load() > 0 && b.o.runIDChecks.Load() > 0
	})
	srv.Restart()
	redistest.Eventually(t, 5*time.Second, "totals sent again", func() bool { return total() == 50 })
	if a.e.Stats().Resends == 0 || b.e.Stats().Resends == 0 {
		t.Fatalf("resends: a %d, b %d", a.e.Stats().Resends, b.e.Stats().Resends)
	}
	// A third node sees the key's whole count: 10 left of 60.
	c := newNode(t, srv.URL(), clk)
	admitted := 0
	for range 30 {
		if c.e.Decide(context.Background(), engine.Limit{Key: k, Limit: 60, Cost: 1}).Allowed {
			admitted++
		}
	}
	if admitted != 10 {
		t.Fatalf("a new node admitted %d after the restart, want the 10 left", admitted)
	}
}
