package origin

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

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
	procs := []*proc{
		newRealTimeProc(t, srv.URL(), "node-0", openTimeout, now),
		newRealTimeProc(t, srv.URL(), "node-1", openTimeout, now),
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

	// Load: two goroutines per engine, recording latencies by phase.
	var l load
	l.run(ctx, procs, engine.Limit{Key: k, Limit: limit, Cost: 1})
	defer l.halt()

	time.Sleep(300 * time.Millisecond) // healthy load, for contrast only
	l.phase.Store(1)
	srv.Stop()
	redistest.Eventually(t, 10*time.Second, "both breakers open", func() bool { return allBreakers(procs, BreakerOpen) })
	time.Sleep(300 * time.Millisecond) // load with the breakers open

	l.phase.Store(2)
	srv.Restart()
	restarted := time.Now()
	redistest.Eventually(t, openTimeout+5*time.Second, "both breakers close", func() bool { return allBreakers(procs, BreakerClosed) })
	l.halt()

	var admitted int64
	for _, p := range procs {
		admitted += p.admitted.Load()
	}
	cell := cellKey(DefaultPrefix, k, start/window.Milliseconds())
	total, converged := awaitTotal(ctx, srv.Client(), cell, admitted, restarted.Add(openTimeout+2*time.Second))
	t.Logf("admitted %d (%d denied); Redis holds %d, %s after the restart", admitted, l.denied.Load(), total, time.Since(restarted))
	if !converged {
		t.Fatalf("Redis holds %d, the engines admitted %d: not reconverged within the open time + 2 s", total, admitted)
	}
	if l.denied.Load() != 0 {
		t.Fatalf("%d requests denied below the limit", l.denied.Load())
	}
	checkLatencies(t, &l)
}

// proc is one simulated process in real time: an engine with its own
// origin, and the units it admitted.
type proc struct {
	e        *engine.Engine
	o        *Redis
	admitted atomic.Int64
}

// newRealTimeProc makes the process id on the Redis at url, its breakers
// open for openTimeout, its engine on the clock now.
func newRealTimeProc(t *testing.T, url, id string, openTimeout time.Duration, now func() time.Time) *proc {
	p := &proc{}
	p.o = newOrigin(t, Config{
		Redis:   []string{url},
		Breaker: BreakerConfig{Timeout: Duration(openTimeout)},
	}, Options{NodeID: id})
	p.e = engine.New(engine.Config{Now: now})
	p.e.SetOrigin(p.o)
	closeAtCleanup(t, p.e, 2*time.Second)
	return p
}

// allBreakers reports whether the request-path breaker of every process
// is in state s.
func allBreakers(procs []*proc, s BreakerState) bool {
	for _, p := range procs {
		if p.o.Stats().Endpoints[0].Breaker != s {
			return false
		}
	}
	return true
}

// latency is one decision's latency, in a phase of a load.
type latency struct {
	phase int32
	d     time.Duration
}

// load is two goroutines per process deciding one key in real time, each
// recording its decisions' latencies by phase.
type load struct {
	phase   atomic.Int32 // 0 healthy, 1 Redis down, 2 Redis back
	stop    atomic.Bool
	wg      sync.WaitGroup
	mu      sync.Mutex
	samples []latency
	denied  atomic.Int64
}

// halt stops the load and waits for its goroutines.
func (l *load) halt() {
	l.stop.Store(true)
	l.wg.Wait()
}

// latencies returns the latencies of phase ph, sorted.
func (l *load) latencies(ph int32) []time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	var ds []time.Duration
	for _, s := range l.samples {
		if s.phase == ph {
			ds = append(ds, s.d)
		}
	}
	slices.Sort(ds)
	return ds
}

// run starts the load of requests lim on procs, until halt.
func (l *load) run(ctx context.Context, procs []*proc, lim engine.Limit) {
	for _, p := range procs {
		for g := 0; g < 2; g++ {
			l.wg.Add(1)
			go func() {
				defer l.wg.Done()
				var local []latency
				for !l.stop.Load() {
					ph := l.phase.Load()
					began := time.Now()
					d := p.e.Decide(ctx, lim)
					local = append(local, latency{ph, time.Since(began)})
					if d.Allowed {
						p.admitted.Add(lim.Cost)
					} else {
						l.denied.Add(1)
					}
					time.Sleep(100 * time.Microsecond)
				}
				l.mu.Lock()
				l.samples = append(l.samples, local...)
				l.mu.Unlock()
			}()
		}
	}
}

// checkLatencies logs the decisions' latencies of l while Redis was
// healthy and while it was down, and fails t unless each phase has enough
// decisions and those made while it was down stayed local.
func checkLatencies(t *testing.T, l *load) {
	t.Helper()
	for ph, name := range []string{"healthy", "Redis down"} {
		ds := l.latencies(int32(ph))
		if len(ds) < 100 {
			t.Fatalf("%s: only %d decisions", name, len(ds))
		}
		p99 := ds[len(ds)*99/100]
		t.Logf("%s: %d decisions, p50 %s, p99 %s, max %s", name, len(ds), ds[len(ds)/2], p99, ds[len(ds)-1])
		// The read timeout is 50 ms; local decisions take microseconds.
		// 10 ms leaves room for a shared machine and the race detector.
		if ph == 1 && p99 > 10*time.Millisecond {
			t.Fatalf("%s: p99 decision latency %s; decisions must stay local", name, p99)
		}
	}
}

// awaitTotal polls the count of cell until it is want or deadline passes,
// and returns the last count seen and whether it reached want.
func awaitTotal(ctx context.Context, c *redis.Client, cell string, want int64, deadline time.Time) (int64, bool) {
	var total int64
	for ; time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		total, _ = c.HGet(ctx, cell, "t").Int64()
		if total == want {
			return total, true
		}
	}
	return total, false
}

// TestFailover_AnAddressThatMovesToTheNewMasterIsFollowed: a managed
// Redis fails over by moving its DNS name to the promoted replica; the
// connections already open stay with the old master, now a replica that
// answers every write with READONLY (here a proxy stands for the name:
// new connections reach the new master). go-redis drops a connection
// that answered READONLY, so that the next one is dialled anew, but the
// script once swallowed READONLY cell by cell and the pool kept talking
// to the old master for as long as the connections lived: every write
// refused, the units held, forever. The writes must reach the new master
// by themselves.
func TestFailover_AnAddressThatMovesToTheNewMasterIsFollowed(t *testing.T) {
	oldMaster, replica := startReplicated(t)
	ctx := context.Background()
	name := redistest.StartDelayProxy(t, oldMaster.Addr(), 0)
	cfg := Config{Redis: []string{name.URL()}, Breaker: BreakerConfig{Timeout: Duration(200 * time.Millisecond)}}
	o := newOrigin(t, cfg, Options{NodeID: "dns"})
	k, seq := key("walter"), nowSeq()
	flush := func(own int64) ([]engine.Delta, error) {
		b := []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: own}}
		return b, o.Flush(ctxT(t), b)
	}
	if b, err := flush(5); err != nil || !b[0].Done {
		t.Fatalf("flush before the failover: %v", err)
	}
	// The failover: the replica is promoted, the old master follows it,
	// and the name points at the new master.
	failOver(t, oldMaster, replica, name)
	redistest.EventuallyShow(t, 10*time.Second, "the writes reach the new master", func() (bool, string) {
		b, err := flush(9)
		got, _ := cellTotal(ctx, replica.Client(), DefaultPrefix, k, seq)
		return b[0].Done && got == 9, fmt.Sprintf("flush %v; the new master holds %d", err, got)
	})
}

// startReplicated starts a master and a replica of it, in sync.
func startReplicated(t *testing.T) (master, replica *redistest.Server) {
	t.Helper()
	master, replica = redistest.Start(t), redistest.Start(t)
	ctx := context.Background()
	if err := replica.Client().Do(ctx, "REPLICAOF", "127.0.0.1", master.Port()).Err(); err != nil {
		t.Fatal(err)
	}
	redistest.Eventually(t, 10*time.Second, "the replica in sync", inSync(ctx, replica))
	return master, replica
}

// inSync reports, when called, whether s replicates its master.
func inSync(ctx context.Context, s *redistest.Server) func() bool {
	return func() bool {
		info, err := s.Client().Info(ctx, "replication").Result()
		return err == nil && strings.Contains(info, "master_link_status:up")
	}
}

// failOver promotes replica, makes oldMaster follow it, and points name
// (a proxy standing for a DNS name) at it.
func failOver(t *testing.T, oldMaster, replica *redistest.Server, name *redistest.Proxy) {
	t.Helper()
	ctx := context.Background()
	if err := replica.Client().Do(ctx, "REPLICAOF", "NO", "ONE").Err(); err != nil {
		t.Fatal(err)
	}
	if err := oldMaster.Client().Do(ctx, "REPLICAOF", "127.0.0.1", replica.Port()).Err(); err != nil {
		t.Fatal(err)
	}
	name.SetUpstream(replica.Addr())
	redistest.Eventually(t, 10*time.Second, "the old master follows the new one", inSync(ctx, oldMaster))
}
