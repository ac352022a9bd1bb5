package integration

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// TestTwoNodes_AFloodOfIdentifiersNeitherOverAdmitsNorMiscountsBusyKeys:
// two processes of one region on one Redis, each with a cap of 16 keys,
// hold three busy keys at their limit of 20 while a flood of one-off
// keys, 50 times the cap, arrives at both, with replays and evictions
// between the decisions. The README says a flood is evicted before any
// key busy now and that an evicted key's units are written before it is
// read again: no busy key admits past its limit across the two nodes,
// and what Redis holds at the end is exactly what the nodes admitted
// (nothing lost with Redis up, nothing counted twice).
func TestTwoNodes_AFloodOfIdentifiersNeitherOverAdmitsNorMiscountsBusyKeys(t *testing.T) {
	requireBinary(t, "redis-server")
	floodRun(t, 16, 3, 20, "flood")
}

// TestTwoNodes_BusyKeysPastTheCapAreCountedOnceAtEveryIncarnation: the
// same with twelve busy keys of limit 200 past a cap of 4 (the README:
// below the number of keys busy at once, busy keys are evicted), so that
// busy keys are evicted mid-window and made again, many times each: each
// new incarnation reads Redis after the eviction's write, admits no
// more than the key's limit less what its earlier ones took, and its
// units add to the key's once.
func TestTwoNodes_BusyKeysPastTheCapAreCountedOnceAtEveryIncarnation(t *testing.T) {
	requireBinary(t, "redis-server")
	floodRun(t, 4, 12, 200, "floodcap")
}

func floodRun(t *testing.T, maxEntries, hot int, limit int64, prefix string) {
	srv := redistest.Start(t)
	const window = time.Minute
	flood := max(50*maxEntries, int(2*limit)) // one-off keys per goroutine
	// The start of a window, ahead of the wall clock: nothing of the
	// window just past weighs, no cell expires before the sum, and the
	// clock never moves: every decision is in this one window.
	start := time.Now().Add(5 * time.Second).Truncate(window).Add(window)
	clk := testclock.New(start.Add(time.Second))
	nodes := make([]*engine.Engine, 2)
	origins := make([]*origin.Redis, 2)
	for i := range nodes {
		o, err := origin.New(origin.Config{Redis: []string{srv.URL()}, Prefix: prefix}, origin.Options{NodeID: fmt.Sprintf("node-%d", i)})
		if err != nil {
			t.Fatal(err)
		}
		e := engine.New(engine.Config{Now: clk.Now, Manual: true, MaxEntries: maxEntries})
		e.SetProcesses(int64(len(nodes)))
		e.SetOrigin(o)
		nodes[i], origins[i] = e, o
	}
	hotKey := func(h int) engine.Key {
		return engine.Key{Namespace: "zone", Identifier: "hot-" + strconv.Itoa(h), Window: window}
	}
	hotAdmitted := make([]atomic.Int64, hot)
	var floodAdmitted atomic.Int64
	ctx := context.Background()
	var wg sync.WaitGroup
	for ni, e := range nodes {
		for w := range 2 {
			wg.Go(func() {
				for i := range flood {
					// A one-off key: new to both nodes and to Redis.
					k := engine.Key{Namespace: "zone", Identifier: fmt.Sprintf("once-%d-%d-%d", ni, w, i), Window: window}
					if e.Decide(ctx, engine.Limit{Key: k, Limit: limit, Cost: 1}).Allowed {
						floodAdmitted.Add(1)
					}
					// Every busy key, every other one-off key: each is
					// asked for far more than its limit over the run.
					if i%2 == 0 {
						for h := range hot {
							if e.Decide(ctx, engine.Limit{Key: hotKey(h), Limit: limit, Cost: 1}).Allowed {
								hotAdmitted[h].Add(1)
							}
						}
					}
					switch i % 16 {
					case 5:
						_, _ = e.ReplayOnce(ctx, engine.Tier(i%2))
					case 11:
						e.Evict()
					}
				}
			})
		}
	}
	wg.Wait()
	var lost, evictions, deferred int64
	for i, e := range nodes {
		cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		err := e.Close(cctx)
		cancel()
		if err != nil {
			t.Fatalf("close: %v", err)
		}
		_ = origins[i].Close()
		s := e.Stats()
		lost += s.LostUnits
		evictions += s.Evictions
		deferred += s.EvictionsDeferred
	}
	if evictions == 0 {
		t.Fatalf("no eviction with %d keys past a cap of %d", 4*flood, maxEntries)
	}
	var hotSum int64
	for h := range hot {
		n := hotAdmitted[h].Load()
		hotSum += n
		if n > limit {
			t.Errorf("busy key %d: %d admitted across the two nodes, limit %d (%d evictions, %d deferred)", h, n, limit, evictions, deferred)
		}
	}
	admitted := hotSum + floodAdmitted.Load()
	if sent := redisUnits(t, srv, prefix); sent != admitted || lost != 0 {
		t.Errorf("%d units admitted (%d by busy keys), %d in Redis, %d counted as lost (%d evictions, %d deferred)", admitted, hotSum, sent, lost, evictions, deferred)
	}
	t.Logf("busy keys admitted %d; %d evictions, %d deferred", hotSum, evictions, deferred)
}
