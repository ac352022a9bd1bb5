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
	floodRun(t, 16, 3, 20, "flood", false)
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
	floodRun(t, 4, 12, 200, "floodcap", false)
}

// TestTwoNodes_AFloodWhileRedisHangsKeepsTheCapAndEveryUnit: the flood of
// the first test with Redis paused (SIGSTOP: every call waits out its
// timeout, as a hung server makes it) from a quarter of the run, for
// three evictions of one goroutine (each waits out its writes' second). The README says the cap holds while Redis cannot take the evicted
// keys' units, and that units a write fails to send go to the replay:
// the live entries stay near the cap after every eviction, the busy keys,
// at their limit before Redis hangs, stay denied, and once Redis answers
// again it holds every unit the nodes admitted, but those they count as
// lost.
func TestTwoNodes_AFloodWhileRedisHangsKeepsTheCapAndEveryUnit(t *testing.T) {
	requireBinary(t, "redis-server")
	floodRun(t, 16, 3, 20, "floodhang", true)
}

// floodRun runs the flood on two nodes, each with a cap of maxEntries
// keys, beside hot busy keys of limit; with hang, Redis is paused for a
// while from a quarter of the run.
func floodRun(t *testing.T, maxEntries, hot int, limit int64, prefix string, hang bool) {
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
		// A read waits 100 ms at most (a tenth of the default), so that
		// the hung Redis costs the run seconds rather than half a minute.
		o, err := origin.New(origin.Config{Redis: []string{srv.URL()}, Prefix: prefix, ReadTimeout: origin.Duration(100 * time.Millisecond)}, origin.Options{NodeID: fmt.Sprintf("node-%d", i)})
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
	// The most live entries a node held right after an eviction: the cap,
	// plus what the other goroutine of its node made meanwhile.
	var mostAfterEviction atomic.Int64
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
						n := e.Stats().Entries
						for m := mostAfterEviction.Load(); n > m && !mostAfterEviction.CompareAndSwap(m, n); m = mostAfterEviction.Load() {
						}
					}
					if hang && ni == 0 && w == 0 {
						switch i {
						case flood / 4:
							srv.Pause()
						case flood/4 + 48: // three of this goroutine's evictions
							srv.Resume()
						}
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
	// Between two evictions a goroutine makes at most 16 keys, and each
	// node has two, beside the busy keys.
	if most, bound := mostAfterEviction.Load(), int64(maxEntries+2*16+hot); most > bound {
		t.Errorf("%d live entries on a node right after an eviction, over the cap of %d and what a pass lets in (%d)", most, maxEntries, bound)
	}
	var hotSum int64
	for h := range hot {
		n := hotAdmitted[h].Load()
		hotSum += n
		// The busy keys reach their limit long before Redis hangs, and
		// stay denied while each node decides alone.
		if n > limit {
			t.Errorf("busy key %d: %d admitted across the two nodes, limit %d (%d evictions, %d deferred)", h, n, limit, evictions, deferred)
		}
	}
	admitted := hotSum + floodAdmitted.Load()
	if sent := redisUnits(t, srv, prefix); sent+lost != admitted || (lost != 0 && !hang) {
		t.Errorf("%d units admitted (%d by busy keys), %d in Redis, %d counted as lost (%d evictions, %d deferred)", admitted, hotSum, sent, lost, evictions, deferred)
	}
	t.Logf("busy keys admitted %d; %d evictions, %d deferred, %d units counted as lost, at most %d live entries after an eviction", hotSum, evictions, deferred, lost, mostAfterEviction.Load())
}

// TestEviction_AWriteLostToAPartitionGoesToTheReplay: a key evicted while
// it holds units not written yet, its eviction's write lost to a
// partition between the node and Redis (a proxy that swallows every byte,
// until the write's timeout). The units go to the replay, and the key's
// next entry takes its cells back (engine/orphan.go): it admits only what
// its limit has left whether it decides while the path is still cut,
// once it heals but before the replay's next tick, or after that tick,
// and Redis ends with every unit admitted. Before, the first two admitted
// the unwritten units again (14 for a limit of 10). The last case's write
// is not lost but slow: each reply 80 ms late, past the read_timeout (50
// ms) a read of the key waits for it at most, and the key's requests come
// during it. Their entry read Redis before the write had landed, and
// admitted the units again (14 of 10) before the entry took the cells
// back.
func TestEviction_AWriteLostToAPartitionGoesToTheReplay(t *testing.T) {
	requireBinary(t, "redis-server")
	srv := redistest.Start(t)
	for i, c := range []struct {
		name string
		// heal, replay: whether the path heals, and the replay ticks,
		// before the key's next decisions (after them otherwise).
		heal, replay bool
		// slow, when set, delays each reply instead of cutting the
		// path, and the decisions come during the eviction's write.
		slow time.Duration
	}{
		{"while the path is cut", false, false, 0},
		{"once it heals, before the replay's tick", true, false, 0},
		{"after the replay's tick", true, true, 0},
		{"during a write slower than read_timeout", true, false, 80 * time.Millisecond},
	} {
		t.Run(c.name, func(t *testing.T) {
			proxy := redistest.StartDelayProxy(t, srv.Addr(), 0)
			const window, limit = time.Minute, 10
			start := time.Now().Add(5 * time.Second).Truncate(window).Add(window)
			clk := testclock.New(start.Add(time.Second))
			prefix := fmt.Sprintf("evictcut%d", i)
			o, err := origin.New(origin.Config{Redis: []string{proxy.URL()}, Prefix: prefix}, origin.Options{NodeID: "node"})
			if err != nil {
				t.Fatal(err)
			}
			defer o.Close()
			e := engine.New(engine.Config{Now: clk.Now, Manual: true, MaxEntries: 1})
			e.SetOrigin(o)
			ctx := context.Background()
			key := engine.Limit{Key: engine.Key{Namespace: "zone", Identifier: "k", Window: window}, Limit: limit, Cost: 1}
			heavier := engine.Limit{Key: engine.Key{Namespace: "zone", Identifier: "heavier", Window: window}, Limit: 100, Cost: 1}
			decide := func(l engine.Limit, n int) (ok int) {
				for range n {
					if e.Decide(ctx, l).Allowed {
						ok++
					}
				}
				return ok
			}
			replay := func() {
				for tier := range 2 {
					if _, err := e.ReplayOnce(ctx, engine.Tier(tier)); err != nil {
						t.Fatalf("the replay after the cut: %v", err)
					}
				}
			}
			admitted := decide(key, 4)
			heavy := decide(heavier, 5) // k is the lighter: the eviction takes it
			if c.slow > 0 {
				proxy.SetDelay(c.slow)
				evicted := make(chan int)
				go func() { evicted <- e.Evict() }()
				for e.Stats().Evictions == 0 { // let go: its write is on its way
					select {
					case n := <-evicted:
						t.Fatalf("the eviction ended (%d evicted) before the key's requests", n)
					case <-time.After(time.Millisecond):
					}
				}
				admitted += decide(key, 3*limit)
				if n := <-evicted; n == 0 {
					t.Fatal("nothing evicted over a cap of 1")
				}
				proxy.SetDelay(0)
			} else {
				proxy.Cut()
				if n := e.Evict(); n == 0 {
					t.Fatal("nothing evicted over a cap of 1")
				}
				if s := e.Stats(); s.FlushErrors == 0 || s.PendingCells == 0 {
					t.Fatalf("the eviction's write did not fail into the replay: %d flush errors, %d cells pending", s.FlushErrors, s.PendingCells)
				}
				if c.heal {
					proxy.Restore()
				}
				if c.replay {
					replay()
				}
				admitted += decide(key, 3*limit)
			}
			if !c.heal {
				proxy.Restore()
			}
			if admitted != limit {
				t.Errorf("%d admitted of a limit of %d around an eviction whose write was lost or slow", admitted, limit)
			}
			cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			if err := e.Close(cctx); err != nil {
				t.Fatal(err)
			}
			if sent, lost := redisUnits(t, srv, prefix), e.Stats().LostUnits; sent != int64(admitted+heavy) || lost != 0 {
				t.Errorf("Redis holds %d units and %d were counted as lost, of %d admitted", sent, lost, admitted+heavy)
			}
		})
	}
}
