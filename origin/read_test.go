package origin

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
)

// TestRead_HungRedisNeverBlocksPastTheDeadline pauses Redis (SIGSTOP): the
// socket stays open and nothing answers. Reads and flushes return at their
// deadline.
func TestRead_HungRedisNeverBlocksPastTheDeadline(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{})
	k, seq := key("dave"), nowSeq()
	if _, _, err := readPair(o, ctxT(t), k, seq); err != nil {
		t.Fatalf("warm-up read: %v", err)
	}
	srv.Pause()
	defer srv.Resume()

	const budget = 50 * time.Millisecond
	// Slack for a loaded machine; a go-redis default timeout would be 5 s.
	const slack = 250 * time.Millisecond
	for i := 0; i < 3; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), budget)
		start := time.Now()
		_, _, err := readPair(o, ctx, k, seq)
		took := time.Since(start)
		cancel()
		if err == nil || !isTimeout(err) {
			t.Fatalf("read from a hung Redis: %v, want a timeout", err)
		}
		if took > budget+slack {
			t.Fatalf("read took %s with a %s deadline", took, budget)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), budget)
	defer cancel()
	start := time.Now()
	b := []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: 1}}
	err := o.Flush(ctx, b)
	if took := time.Since(start); err == nil || b[0].Done || took > budget+slack {
		t.Fatalf("flush to a hung Redis: err=%v Done=%v after %s", err, b[0].Done, took)
	}
	if st := o.Stats().Endpoints[0]; st.Calls["read"]["timeout"] != 3 || st.Calls["flush"]["timeout"] != 1 {
		t.Fatalf("timeouts not counted as such: %+v", st.Calls)
	}
}

// TestRead_ColdHerdAtRolloverDoesNotTripTheBreaker fires thousands of
// concurrent first reads, as every active key's new cell does at a window
// rollover. They share a few round trips and the breaker stays closed.
func TestRead_ColdHerdAtRolloverDoesNotTripTheBreaker(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{})
	seq := nowSeq()
	const herd = 5000
	var wg sync.WaitGroup
	var ok atomic.Int64
	for i := 0; i < herd; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if requestRead(o, key(fmt.Sprintf("user-%d", i)), seq) == nil {
				ok.Add(1)
			}
		}()
	}
	wg.Wait()
	st := o.Stats().Endpoints[0]
	if st.Breaker != BreakerClosed {
		t.Fatalf("breaker %s after a cold herd of %d reads (%+v)", st.Breaker, herd, st.Calls)
	}
	if st.Calls["read"]["rejected"] != 0 {
		t.Fatalf("%d reads rejected by the breaker", st.Calls["read"]["rejected"])
	}
	if st.RoundTrips > herd/10 {
		t.Fatalf("%d reads took %d round trips; concurrent reads must share them", herd, st.RoundTrips)
	}
	t.Logf("%d of %d reads answered within %s in %d round trips", ok.Load(), herd, engine.DefaultReadTimeout, st.RoundTrips)
	// How many of the herd answered in time depends on how fast 5,000
	// goroutines get a core (under the race detector on 2 busy cores, at
	// times none); what must hold is that the herd left the endpoint
	// answering: the next read succeeds.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := o.Read(ctx, key("after-the-herd"), seq, 0); err != nil {
		t.Fatalf("a read after the herd: %v", err)
	}
}

// BenchmarkColdDecide is the first decision of keys this process has never
// seen, through an engine on a real Redis, from 64 concurrent callers (the
// load harness's connections): each reads Redis before it decides (a limit
// under 1024 requests). cpu-ns/op is this process's CPU per decision, the
// engine and the origin together.
func BenchmarkColdDecide(b *testing.B) { benchColdDecide(b, 1000) }

// BenchmarkColdDecideFarLimit is the same with a limit far above one
// request: the decision does not wait for a read, and the key's first
// replay reads it (engine.unread).
func BenchmarkColdDecideFarLimit(b *testing.B) { benchColdDecide(b, 1<<40) }

func benchColdDecide(b *testing.B, limit int64) {
	srv := redistest.Start(b)
	o := newOrigin(b, Config{Redis: []string{srv.URL()}}, Options{NodeID: "bench"})
	e := engine.New(engine.Config{})
	b.Cleanup(func() { _ = e.Close(context.Background()) })
	e.SetOrigin(o)
	var next atomic.Int64
	b.SetParallelism(32) // 64 callers on 2 cores
	b.ReportAllocs()
	cpu0 := cpuTime(b)
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		for pb.Next() {
			id := "k" + strconv.FormatInt(next.Add(1), 10)
			d := e.Decide(ctx, engine.Limit{Key: engine.Key{Namespace: "api", Identifier: id, Window: time.Hour}, Limit: limit, Cost: 1})
			if !d.Allowed {
				b.Fatal("denied")
			}
		}
	})
	b.ReportMetric(float64((cpuTime(b)-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
	b.ReportMetric(float64(o.Stats().Endpoints[0].RoundTrips)/float64(b.N), "roundtrips/op")
	st := e.Stats()
	if reads := st.SyncReads + st.UnreadDecisions; reads < int64(b.N)/2 {
		b.Fatalf("%d synchronous reads and %d unread decisions for %d cold keys", st.SyncReads, st.UnreadDecisions, b.N)
	}
}

// TestRead_AReadTimeoutAboveASecondIsWaitedFor: read_timeout may be set
// up to 10 s, and a request then waits that long for a Redis that answers
// late. A read and a reservation answered in 1.5 s, within a read timeout
// of 3 s, failed at a second: the client's socket timeout cut them.
func TestRead_AReadTimeoutAboveASecondIsWaitedFor(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartDelayProxy(t, srv.Addr(), 0)
	const readTimeout = 3 * time.Second
	o := newOrigin(t, Config{Redis: []string{proxy.URL()}, ReadTimeout: Duration(readTimeout)}, Options{NodeID: "p"})
	k, seq := key("patient"), nowSeq()
	if r := reservation(k, seq, 0, 1, 10); o.Reserve(ctxT(t), r) != nil || !r.Admitted {
		t.Fatalf("warm-up reservation: %+v", r)
	}
	if _, _, err := readPair(o, ctxT(t), k, seq); err != nil { // loads the read's script
		t.Fatalf("warm-up read: %v", err)
	}
	proxy.SetDelay(1500 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), readTimeout)
	defer cancel()
	if cur, _, err := readPair(o, ctx, k, seq); err != nil || cur != 1 {
		t.Fatalf("read answered in 1.5 s within a read timeout of %s: %d, %v; want 1", readTimeout, cur, err)
	}
	ctx, cancel = context.WithTimeout(context.Background(), readTimeout)
	defer cancel()
	if r := reservation(k, seq, 1, 1, 10); o.Reserve(ctx, r) != nil || !r.Admitted || r.Totals.Cur != 2 {
		t.Fatalf("reservation answered in 1.5 s within a read timeout of %s: %+v; want admitted at 2", readTimeout, r)
	}
}
