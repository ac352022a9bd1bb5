package origin

import (
	"fmt"
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
	// c's record lapses 50 ms on, by Redis's clock, with no heartbeat
	// meanwhile: the next heartbeat of anyone drops it, and only it. The
	// set's expiry is the longest lapse, not the last one's: before, the
	// set went with c's record a moment later, and a's and b's with it
	// (b then counted itself alone; a flake when no heartbeat came within
	// c's lapse, as under the race detector in CI).
	redisNow := func() time.Time {
		t.Helper()
		now, err := srv.Client().Time(ctxT(t)).Result()
		if err != nil {
			t.Fatal(err)
		}
		return now
	}
	beat(c, 50*time.Millisecond)
	lapsed := redisNow().Add(50 * time.Millisecond)
	redistest.Eventually(t, 5*time.Second, "Redis's clock passed c's lapse", func() bool { return redisNow().After(lapsed) })
	if n := beat(b, time.Minute); n != 2 {
		t.Fatalf("after c's record lapsed, b counts %d processes, want a and b", n)
	}
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
	a.WatchProcesses(10*time.Millisecond, func(n int64) { counted.Store(n) }, nil)
	b.WatchProcesses(10*time.Millisecond, func(int64) {}, nil)
	redistest.Eventually(t, 5*time.Second, "a counts both", func() bool { return counted.Load() == 2 })
	_ = b.Close()
	// b's record lapses processesLapse intervals after its last renewal.
	redistest.Eventually(t, 5*time.Second, "a counts itself alone", func() bool { return counted.Load() == 1 })
}

// TestTakeRegionFrom_AReloadKeepsWhatTheLastOriginHeard: the origin of a
// reload to the same servers said 0 processes, no builds and no clock
// until its own first heartbeat answered (one scrape in ten during
// back-to-back reloads, in an audit). It starts from the last origin's,
// and its own heartbeats replace them.
func TestTakeRegionFrom_AReloadKeepsWhatTheLastOriginHeard(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	b := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "b"})
	for _, o := range []*Redis{a, b} {
		if _, err := o.Heartbeat(ctxT(t), time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := a.Heartbeat(ctxT(t), time.Minute); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Builds(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	next := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	if next.Processes() != 0 {
		t.Fatal("a new origin counts processes before any heartbeat")
	}
	next.TakeRegionFrom(a)
	if got := next.Processes(); got != 2 {
		t.Errorf("after a reload: %d processes, want the last origin's 2", got)
	}
	if _, ok := next.ClockOffset(); !ok {
		t.Error("after a reload: Redis's clock unknown, the last origin knew it")
	}
	if got := next.Stats().Builds; len(got) == 0 {
		t.Error("after a reload: no builds, the last origin read them")
	}
	// Its own heartbeat counts anew: b has left.
	if err := b.Leave(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if n, err := next.Heartbeat(ctxT(t), time.Minute); err != nil || n != 1 || next.Processes() != 1 {
		t.Errorf("its own heartbeat: %d (%v), Processes %d; want 1", n, err, next.Processes())
	}
}

// TestHeartbeat_RedisClockNotTheNodes: a record lapses by Redis's clock,
// so a node whose clock runs ahead no longer drops the others' records on
// each renewal (and one whose clock runs behind is counted): the scores
// are Redis's time plus the lapse, whatever the node's clock says.
func TestHeartbeat_RedisClockNotTheNodes(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	if _, err := a.Heartbeat(ctxT(t), time.Minute); err != nil {
		t.Fatal(err)
	}
	now, err := srv.Client().Time(ctxT(t)).Result()
	if err != nil {
		t.Fatal(err)
	}
	score, err := srv.Client().ZScore(ctxT(t), a.processesKey(), "a").Result()
	if err != nil {
		t.Fatal(err)
	}
	if d := time.UnixMilli(int64(score)).Sub(now.Add(time.Minute)); d > 0 || d < -time.Second {
		t.Errorf("the record lapses at %v, %v from Redis's time plus the lapse", time.UnixMilli(int64(score)), d)
	}
}

// TestWatchProcesses_UnknownOnceRenewalsFail: with Redis gone, the last
// count stands while a record would, then the count is 0 (unknown), and
// onLost hears of it once; the first renewal that succeeds counts again.
func TestWatchProcesses_UnknownOnceRenewalsFail(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	const interval = 20 * time.Millisecond
	var counted, lost atomic.Int64
	counted.Store(-1)
	a.WatchProcesses(interval, func(n int64) { counted.Store(n) }, func(error) { lost.Add(1) })
	redistest.Eventually(t, 5*time.Second, "a counts itself", func() bool { return counted.Load() == 1 })
	srv.Stop()
	stopped := time.Now()
	redistest.Eventually(t, 10*time.Second, "the count is unknown", func() bool { return counted.Load() == 0 })
	// The last success came at most an interval before the stop.
	if d := time.Since(stopped); d < (processesLapse-1)*interval {
		t.Errorf("the count went unknown %v after Redis stopped; a record lasts %v", d, processesLapse*interval)
	}
	if got := a.Processes(); got != 0 {
		t.Errorf("Processes() = %d with Redis gone", got)
	}
	srv.Restart()
	redistest.Eventually(t, 10*time.Second, "a counts itself again", func() bool { return counted.Load() == 1 })
	if got := lost.Load(); got != 1 {
		t.Errorf("onLost called %d times for one run of failures", got)
	}
}

// TestLeave_TheRegionCountsTheProcessNoMore: a process that leaves as it
// exits is out of the count at the next heartbeat of any other, not
// processesLapse intervals later (a node restarted in a deploy counted
// twice for five seconds), and its watch renews it no more.
func TestLeave_TheRegionCountsTheProcessNoMore(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	b := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "b"})
	var counted atomic.Int64
	b.WatchProcesses(10*time.Millisecond, func(n int64) { counted.Store(n) }, nil)
	if _, err := a.Heartbeat(ctxT(t), time.Hour); err != nil {
		t.Fatal(err)
	}
	redistest.Eventually(t, 5*time.Second, "b counts both", func() bool { return counted.Load() == 2 })
	if err := b.Leave(ctxT(t)); err != nil {
		t.Fatalf("Leave: %v", err)
	}
	if n, err := a.Heartbeat(ctxT(t), time.Hour); err != nil || n != 1 {
		t.Fatalf("after b left, a counts %d (%v), want itself alone", n, err)
	}
	if _, err := b.Heartbeat(ctxT(t), time.Hour); err != ErrLeft {
		t.Fatalf("a heartbeat after Leave returned %v, want ErrLeft", err)
	}
	if n, err := a.Heartbeat(ctxT(t), time.Hour); err != nil || n != 1 {
		t.Errorf("b's watch recorded it again: a counts %d (%v)", n, err)
	}
}

// TestBuilds_CountsTheRegionsProcessesByBuild: each record names its
// process's build, and Builds counts the live ones by build: one of a
// build that names none counts under "", a build's spaces and control
// characters cannot split its record, and a process that leaves is no
// longer counted.
func TestBuilds_CountsTheRegionsProcessesByBuild(t *testing.T) {
	srv := redistest.Start(t)
	cfg := Config{Redis: []string{srv.URL()}}
	a := newOrigin(t, cfg, Options{NodeID: "a", Build: "v1.2.0"})
	b := newOrigin(t, cfg, Options{NodeID: "b", Build: "v1.3.0 x\n"})
	c := newOrigin(t, cfg, Options{NodeID: "c"})
	d := newOrigin(t, cfg, Options{NodeID: "d", Build: "v1.2.0"})
	for _, o := range []*Redis{a, b, c, d} {
		if _, err := o.Heartbeat(ctxT(t), time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	got, err := a.Builds(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int64{"v1.2.0": 2, "v1.3.0_x_": 1, "": 1}
	if fmt.Sprint(got) != fmt.Sprint(want) || fmt.Sprint(a.Stats().Builds) != fmt.Sprint(want) {
		t.Fatalf("builds %v, in the stats %v, want %v", got, a.Stats().Builds, want)
	}
	if err := b.Leave(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if err := c.Leave(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	got, err = a.Builds(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if want := map[string]int64{"v1.2.0": 2}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after two left: builds %v, want %v", got, want)
	}
	if n, err := a.Heartbeat(ctxT(t), time.Minute); err != nil || n != 2 {
		t.Fatalf("the region counts %d processes (%v), want the 2 left", n, err)
	}
}

// TestWatchProcesses_ARegionBackFromAPartitionCountsItsProcesses: Redis
// was out of reach for longer than a record lasts; its clock ran on, so
// the first renewal after the partition heals drops every other record,
// and each node's count
// climbed back from 1 over an interval as the others renewed: the engine
// counted a process or two in a region of three (an audit saw the
// region's processes at 1–2 for a second after a 6 s hang). A count after
// a gap in renewals is at least the one before it, for two intervals.
func TestWatchProcesses_ARegionBackFromAPartitionCountsItsProcesses(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartDelayProxy(t, srv.Addr(), 0)
	const interval = 50 * time.Millisecond
	var after atomic.Bool
	var low atomic.Int64 // the lowest count any node reported after the hang
	low.Store(1 << 62)
	counts := make([]atomic.Int64, 3)
	for i := range counts {
		o := newOrigin(t, Config{Redis: []string{proxy.URL()}}, Options{NodeID: fmt.Sprintf("n%d", i)})
		o.WatchProcesses(interval, func(n int64) {
			counts[i].Store(n)
			for after.Load() {
				if l := low.Load(); n >= l || low.CompareAndSwap(l, n) {
					break
				}
			}
		}, nil)
	}
	redistest.Eventually(t, 5*time.Second, "every node counts three", func() bool {
		return counts[0].Load() == 3 && counts[1].Load() == 3 && counts[2].Load() == 3
	})
	proxy.Cut()
	time.Sleep(2 * processesLapse * interval) // the partition itself: every record lapses meanwhile
	after.Store(true)
	proxy.Restore()
	redistest.Eventually(t, 5*time.Second, "the nodes renew after the partition", func() bool { return low.Load() < 1<<62 })
	time.Sleep(4 * interval) // the renewals of the next intervals, each node's first among them
	if l := low.Load(); l != 3 {
		t.Fatalf("a node counted %d processes after the partition, in a region of three", l)
	}
}
