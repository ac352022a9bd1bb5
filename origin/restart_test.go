package origin

import (
	"context"
	"strings"
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

// TestWatchRestarts_NamesAServerThatMayEvict: a Redis with a memory limit
// and an eviction policy may evict the limiter's counts, which no node
// sees as a restart: the watch names it once per server it reads (and
// again after a restart), and says nothing of one that may not evict.
func TestWatchRestarts_NamesAServerThatMayEvict(t *testing.T) {
	evicting, safe := redistest.Start(t), redistest.Start(t)
	for _, set := range []struct {
		srv    *redistest.Server
		policy string
	}{{evicting, "allkeys-lru"}, {safe, "noeviction"}} {
		c := set.srv.Client()
		if err := c.ConfigSet(context.Background(), "maxmemory", "100mb").Err(); err != nil {
			t.Fatal(err)
		}
		if err := c.ConfigSet(context.Background(), "maxmemory-policy", set.policy).Err(); err != nil {
			t.Fatal(err)
		}
	}
	type warning struct {
		addr, policy string
		max          int64
	}
	warned := make(chan warning, 4)
	o := newOrigin(t, Config{Redis: []string{evicting.URL(), safe.URL()}}, Options{NodeID: "w",
		OnEvicting: func(addr, policy string, max int64) { warned <- warning{addr, policy, max} }})
	o.WatchRestarts(20*time.Millisecond, func() {})
	redistest.Eventually(t, 5*time.Second, "the watch checked three times", func() bool { return o.runIDChecks.Load() >= 3 })
	if len(warned) != 1 {
		t.Fatalf("%d warnings after three checks, want one (the evicting server's, once)", len(warned))
	}
	w := <-warned
	if w.policy != "allkeys-lru" || w.max != 100<<20 || !strings.Contains(w.addr, evicting.Addr()) {
		t.Fatalf("warning %+v, want the evicting server %s with allkeys-lru and 100 MiB", w, evicting.Addr())
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
