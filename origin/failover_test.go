package origin

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestFailover_RedisStoppedUnderLoadThenRestartedEmpty runs two engines in
// real time against one Redis, under load near the limit (where every
// allowing decision refreshes from Redis first), and kills Redis:
//   - every decision still returns (no failure), the breakers open, and
//     decisions stay local: p99 far below the read timeout;
//   - Redis comes back empty on the same port: within the breaker's open
//     time + 2 s the cell in Redis holds exactly what the two engines
//     admitted, each engine's units re-added once, nothing doubled.
func TestFailover_RedisStoppedUnderLoadThenRestartedEmpty(t *testing.T) {
	srv := redistest.Start(t)
	const (
		window      = time.Minute
		limit       = 10_000_000
		prefill     = 9_500_000 // 95 %: every allowing decision reads first
		openTimeout = time.Second
	)
	// The engines' clock runs in real time from the start of a window in
	// the near future, so the whole test stays in one cell.
	start := windowStart(window)
	t0 := time.Now()
	now := func() time.Time { return time.UnixMilli(start).Add(time.Since(t0)) }

	type proc struct {
		e        *engine.Engine
		o        *Redis
		admitted atomic.Int64
	}
	var procs []*proc
	for i := 0; i < 2; i++ {
		p := &proc{}
		p.o = newOrigin(t, Config{
			Redis:   []string{srv.URL()},
			Breaker: BreakerConfig{Timeout: Duration(openTimeout)},
		}, Options{NodeID: fmt.Sprintf("node-%d", i)})
		p.e = engine.New(engine.Config{Now: now})
		p.e.SetOrigin(p.o)
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			_ = p.e.Close(ctx)
		})
		procs = append(procs, p)
	}
	k := engine.Key{Namespace: "api", Identifier: "tenant-7", Window: window}
	ctx := context.Background()

	if d := procs[0].e.Decide(ctx, engine.Limit{Key: k, Limit: limit, Cost: prefill}); !d.Allowed {
		t.Fatalf("prefill denied: %+v", d)
	}
	procs[0].admitted.Add(prefill)
	if _, err := procs[0].e.ReplayOnce(ctx, engine.Slow); err != nil {
		t.Fatalf("replay of the prefill: %v", err)
	}

	// Load: two goroutines per engine, each recording decision latencies
	// by phase.
	type sample struct {
		phase int32
		d     time.Duration
	}
	var phase atomic.Int32 // 0 healthy, 1 Redis down, 2 Redis back
	var stop atomic.Bool
	var wg sync.WaitGroup
	var mu sync.Mutex
	var samples []sample
	var denied atomic.Int64
	for _, p := range procs {
		for g := 0; g < 2; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var local []sample
				for !stop.Load() {
					ph := phase.Load()
					t := time.Now()
					d := p.e.Decide(ctx, engine.Limit{Key: k, Limit: limit, Cost: 1})
					local = append(local, sample{ph, time.Since(t)})
					if d.Allowed {
						p.admitted.Add(1)
					} else {
						denied.Add(1)
					}
					time.Sleep(100 * time.Microsecond)
				}
				mu.Lock()
				samples = append(samples, local...)
				mu.Unlock()
			}()
		}
	}
	defer func() {
		stop.Store(true)
		wg.Wait()
	}()

	time.Sleep(300 * time.Millisecond) // healthy load, for contrast only
	phase.Store(1)
	srv.Stop()
	redistest.Eventually(t, 10*time.Second, "both breakers open", func() bool {
		for _, p := range procs {
			if p.o.Stats().Endpoints[0].Breaker != BreakerOpen {
				return false
			}
		}
		return true
	})
	time.Sleep(300 * time.Millisecond) // load with the breakers open

	phase.Store(2)
	srv.Restart()
	restarted := time.Now()
	redistest.Eventually(t, openTimeout+5*time.Second, "both breakers close", func() bool {
		for _, p := range procs {
			if p.o.Stats().Endpoints[0].Breaker != BreakerClosed {
				return false
			}
		}
		return true
	})
	stop.Store(true)
	wg.Wait()

	var admitted int64
	for _, p := range procs {
		admitted += p.admitted.Load()
	}
	cell := cellKey(DefaultPrefix, k, start/window.Milliseconds())
	c := srv.Client()
	var total int64
	converged := false
	for deadline := restarted.Add(openTimeout + 2*time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		total, _ = c.Get(ctx, cell).Int64()
		if total == admitted {
			converged = true
			break
		}
	}
	t.Logf("admitted %d (%d denied); Redis holds %d, %s after the restart", admitted, denied.Load(), total, time.Since(restarted))
	if !converged {
		t.Fatalf("Redis holds %d, the engines admitted %d: not reconverged within the open time + 2 s", total, admitted)
	}
	if denied.Load() != 0 {
		t.Fatalf("%d requests denied below the limit", denied.Load())
	}

	mu.Lock()
	defer mu.Unlock()
	for ph, name := range []string{"healthy", "Redis down"} {
		var ds []time.Duration
		for _, s := range samples {
			if s.phase == int32(ph) {
				ds = append(ds, s.d)
			}
		}
		if len(ds) < 100 {
			t.Fatalf("%s: only %d decisions", name, len(ds))
		}
		slices.Sort(ds)
		p99 := ds[len(ds)*99/100]
		t.Logf("%s: %d decisions, p50 %s, p99 %s, max %s", name, len(ds), ds[len(ds)/2], p99, ds[len(ds)-1])
		// The read timeout is 50 ms; local decisions take microseconds.
		// 10 ms leaves room for a shared machine and the race detector.
		if ph == 1 && p99 > 10*time.Millisecond {
			t.Fatalf("%s: p99 decision latency %s; decisions must stay local", name, p99)
		}
	}
}
