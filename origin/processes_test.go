package origin

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestHeartbeat_CountsTheRegionsProcesses: three processes (node IDs) on
// one Redis count three, a process renewing its record counts once, a
// process under another prefix is another region, and a record not renewed
// lapses.
func TestHeartbeat_CountsTheRegionsProcesses(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	b := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "b"})
	c := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "c"})
	other := newOrigin(t, Config{Redis: []string{srv.URL()}, Prefix: "elsewhere"}, Options{NodeID: "d"})
	beat := func(o *Redis, lapse time.Duration) int64 {
		t.Helper()
		n, err := o.Heartbeat(ctxT(t), lapse)
		if err != nil {
			t.Fatalf("Heartbeat: %v", err)
		}
		return n
	}
	if n := beat(a, time.Minute); n != 1 {
		t.Fatalf("the first process counts %d", n)
	}
	beat(b, time.Minute)
	if n := beat(a, time.Minute); n != 2 {
		t.Fatalf("two processes, one renewed: %d", n)
	}
	if n := beat(other, time.Minute); n != 1 {
		t.Fatalf("a process under another prefix counts %d", n)
	}
	// c's record lapses at once: the next heartbeat of anyone drops it.
	beat(c, time.Millisecond)
	redistest.Eventually(t, 5*time.Second, "c's record lapsed", func() bool { return beat(b, time.Minute) == 2 })
	if got := a.Processes(); got != 2 {
		t.Errorf("a.Processes() = %d after its last heartbeat counted 2", got)
	}
	if got := a.Stats().Processes; got != 2 {
		t.Errorf("Stats().Processes = %d", got)
	}
}

// TestWatchProcesses_RenewsUntilClose: the watch beats at once and every
// interval, hands each count over, and stops with the origin; its record
// then lapses.
func TestWatchProcesses_RenewsUntilClose(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	b, err := New(Config{Redis: []string{srv.URL()}}, Options{NodeID: "b"})
	if err != nil {
		t.Fatal(err)
	}
	var counted atomic.Int64
	a.WatchProcesses(10*time.Millisecond, func(n int64) { counted.Store(n) })
	b.WatchProcesses(10*time.Millisecond, func(int64) {})
	redistest.Eventually(t, 5*time.Second, "a counts both", func() bool { return counted.Load() == 2 })
	_ = b.Close()
	// b's record lapses processesLapse intervals after its last renewal.
	redistest.Eventually(t, 5*time.Second, "a counts itself alone", func() bool { return counted.Load() == 1 })
}
