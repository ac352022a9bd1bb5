package propagation

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

func TestCleanup_DeletesExpiredRowsOnly(t *testing.T) {
	s := newSetup(t)
	a := s.region("a")
	db := mysqltest.Open(t, s.dsn)
	now := s.clk.Now().UnixMilli()
	for i, exp := range []int64{now - 1, now, now + 1, now + 60_000} {
		if _, err := db.Exec(`INSERT INTO ratelimit_global_counts (namespace, identifier, window_ms, sequence, region, count, expires_ms)
			VALUES (?, ?, 60000, 1, 'x', 5, ?)`,
			[]byte("z"), []byte{byte('a' + i)}, exp); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec(`INSERT INTO ratelimit_blocklist (namespace, identifier, window_ms, sequence, origin_region, limit_units, count_cur, count_prev, expires_ms)
			VALUES (?, ?, 60000, 1, 'x', 10, 5, 0, ?)`,
			[]byte("z"), []byte{byte('a' + i)}, exp); err != nil {
			t.Fatal(err)
		}
	}
	if n := a.p.CleanupOnce(bg); n != 4 {
		t.Fatalf("deleted %d rows, want 4 (two expired per table)", n)
	}
	for _, tbl := range []string{"ratelimit_global_counts", "ratelimit_blocklist"} {
		if n := countRows(t, s.dsn, tbl, "WHERE expires_ms > ?", now); n != 2 {
			t.Fatalf("%s: %d live rows left, want 2", tbl, n)
		}
		if n := countRows(t, s.dsn, tbl, ""); n != 2 {
			t.Fatalf("%s: %d rows left, want the 2 live ones", tbl, n)
		}
	}
}

func TestOutage_StartsDownMigratesLaterAndRetriesDenials(t *testing.T) {
	mysqltest.Require(t)
	srv := mysqltest.Start(t)
	dsn := srv.NewDatabase(t)
	srv.Stop()

	clk := new(clock)
	clk.ms.Store(time.Now().UnixMilli())
	eng := engine.New(engine.Config{Now: clk.Now, Manual: true})
	defer eng.Close(bg)
	p, err := New(Config{
		DSN: dsn, Region: "a", Timeout: 200 * time.Millisecond,
		Flush: time.Hour, GlobalSync: time.Hour, BlocklistSync: time.Hour,
	}, eng, Options{Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	eng.SetGlobal(p)
	p.Start() // MySQL is down: Start must not fail or block
	defer p.Stop(bg)
	if p.Ready() {
		t.Fatal("ready with MySQL down")
	}
	for i := 0; i < 12; i++ {
		eng.Decide(bg, engine.Limit{Key: key("k"), Limit: 10, Cost: 1})
	}
	p.ready.Store(true) // force a write attempt while down
	p.FlushOnce(bg)
	if st := p.Stats(); st.DroppedBatches == 0 || st.PendingDenials != 1 {
		t.Fatalf("stats while down: %+v", st)
	}
	p.ready.Store(false)
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for !p.Ready() {
		if time.Now().After(deadline) {
			t.Fatal("schema not migrated within 30 s of MySQL coming back")
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The breaker may be open from the failures: wait it out with writes.
	for p.Stats().DenialsEmitted == 0 {
		if time.Now().After(deadline.Add(30 * time.Second)) {
			t.Fatalf("denial row not retried after recovery: %+v", p.Stats())
		}
		p.FlushOnce(bg)
		time.Sleep(50 * time.Millisecond)
	}
	if n := countRows(t, dsn, "ratelimit_blocklist", ""); n != 1 {
		t.Fatalf("%d rows after the retry, want 1", n)
	}
}

func TestJitter_WithinTwentyPercent(t *testing.T) {
	lo, hi := time.Hour, time.Duration(0)
	for i := 0; i < 10_000; i++ {
		d := jitter(time.Second)
		lo, hi = min(lo, d), max(hi, d)
	}
	if lo < 800*time.Millisecond || hi > 1200*time.Millisecond {
		t.Fatalf("jitter spread [%s, %s], want within ±20 %%", lo, hi)
	}
	if lo > 850*time.Millisecond || hi < 1150*time.Millisecond {
		t.Fatalf("jitter spread [%s, %s] uses too little of ±20 %%", lo, hi)
	}
}

// TestCleanup_ANodeWhoseClockRunsAheadDeletesNoLiveRow: a node's clock runs
// three minutes ahead; another region's row of a one-minute window, live
// by the database's clock, expires by the node's. The cleanup once
// deleted it (and every region's live rows with it), and a region reading
// the table whole then never saw that count for the rest of its window.
func TestCleanup_ANodeWhoseClockRunsAheadDeletesNoLiveRow(t *testing.T) {
	s := newSetup(t)
	real := time.Now().UnixMilli()
	s.clk.ms.Store(real + 3*time.Minute.Milliseconds())
	a := s.region("a")
	db := mysqltest.Open(t, s.dsn)
	if _, err := db.Exec(`INSERT INTO ratelimit_global_counts (namespace, identifier, window_ms, sequence, region, count, expires_ms)
		VALUES (?, ?, 60000, 1, 'b', 5, ?)`, []byte("z"), []byte("live"), real+time.Minute.Milliseconds()); err != nil {
		t.Fatal(err)
	}
	if n := a.p.CleanupOnce(bg); n != 0 {
		t.Fatalf("the cleanup of a node three minutes ahead deleted %d rows live by the database's clock", n)
	}
}

// TestStop_AQueryItCancelsIsNoMySQLError stops a propagator (what every
// reload does to the old config's) while a pull waits on MySQL: the
// query that Stop cancels is no failure of MySQL. It was counted as one
// (propagation_errors_total{op="read"}) and logged as "mysql read failed"
// with "context canceled": 3 read errors in 20 reloads of a Caddy on a
// healthy MariaDB.
func TestStop_AQueryItCancelsIsNoMySQLError(t *testing.T) {
	mysqltest.Require(t)
	srv := mysqltest.Start(t)
	dsn := srv.NewDatabase(t)
	eng := engine.New(engine.Config{Manual: true})
	defer eng.Close(bg)
	core, logs := observer.New(zap.WarnLevel)
	p, err := New(Config{
		DSN: dsn, Region: "a", Timeout: 10 * time.Second,
		Flush: 20 * time.Millisecond, GlobalSync: 20 * time.Millisecond, BlocklistSync: 20 * time.Millisecond,
	}, eng, Options{Logger: zap.New(core)})
	if err != nil {
		t.Fatal(err)
	}
	eng.SetGlobal(p)
	p.Start()
	deadline := time.Now().Add(30 * time.Second)
	for p.Stats().LastPull.IsZero() {
		if time.Now().After(deadline) {
			t.Fatal("no pull within 30 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	srv.Pause()
	resumed := false
	defer func() {
		if !resumed {
			srv.Resume()
		}
	}()
	time.Sleep(300 * time.Millisecond) // the loops' next queries wait on the stopped server
	stopped := make(chan struct{})
	go func() {
		ctx, cancel := context.WithTimeout(bg, 2*time.Second)
		defer cancel()
		p.Stop(ctx)
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(8 * time.Second):
		t.Fatal("Stop did not return within 8 s")
	}
	srv.Resume()
	resumed = true
	st := p.Stats()
	if st.ReadErrors != 0 || st.WriteErrors != 0 || st.DroppedBatches != 0 {
		t.Errorf("a stop counted MySQL failures: read %d, write %d, dropped batches %d", st.ReadErrors, st.WriteErrors, st.DroppedBatches)
	}
	for _, e := range logs.All() {
		t.Errorf("a stop logged %q %v", e.Message, e.ContextMap())
	}
}

// TestStop_WritesTheOverrideChangesItHolds: a process that is its own
// region queues an operator's change for its next flush. A reload stops
// the old config's layer without a flush (only the last config's is
// flushed), and Stop wrote the denial rows it held but not the changes:
// a change made within a flush of the reload never reached MySQL, and
// the other regions never applied it while this process did.
func TestStop_WritesTheOverrideChangesItHolds(t *testing.T) {
	s := newSetup(t)
	a := s.region("a", func(c *Config) { c.Flush, c.GlobalSync, c.BlocklistSync = time.Hour, time.Hour, time.Hour })
	a.p.Start() // the loops' first ticks are an hour away
	a.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "cust", Limit: 500, Region: "a", Version: 2000})
	a.p.Stop(bg)
	if n := countRows(t, s.dsn, "ratelimit_overrides", "WHERE identifier = 'cust' AND limit_units = 500"); n != 1 {
		t.Fatalf("%d rows of the change after Stop, want 1", n)
	}
}

// TestOutage_AFloodOfFirstDenialsWhileMySQLIsDownIsKept: first denials
// wait in a queue of a flush's worth until a flush moves them into the
// rows kept for writing. With MySQL down no flush ran (the schema waits)
// or each took seconds, and a flood past the queue lost the rest with
// the kept rows far from their bound. The queue now drains on its own.
func TestOutage_AFloodOfFirstDenialsWhileMySQLIsDownIsKept(t *testing.T) {
	p := layerWithMySQLDown(t)
	p.Start()
	defer p.Stop(bg)
	const n = 3 * denialQueue
	for i := range n {
		key := engine.Key{Namespace: "z", Identifier: fmt.Sprintf("k%d", i), Window: time.Hour}
		p.FirstDenial(engine.GlobalDenial{Denial: engine.Denial{Limit: engine.Limit{Key: key, Limit: 10}, Sequence: 1},
			Cur: 10, RegionalUsed: 10})
		if i%1000 == 999 {
			redistest.Eventually(t, 5*time.Second, "the queue drained with MySQL down", func() bool { return len(p.denials) == 0 })
		}
	}
	if st := p.Stats(); st.DenialQueueDrops != 0 || st.PendingDenials != n {
		t.Fatalf("%d first denials lost and %d kept of %d, with MySQL down", st.DenialQueueDrops, st.PendingDenials, n)
	}
}

// TestPrune_EmptyMapsGiveTheirRoomBack: a Go map keeps the room of its
// largest size; after a flood of denial rows had been written, the
// layer's empty maps held tens of MB (an audit: 65 MB after 190,000
// keys). The prune makes an empty map anew.
func TestPrune_EmptyMapsGiveTheirRoomBack(t *testing.T) {
	p := layerWithMySQLDown(t)
	const n = 200_000
	p.mu.Lock()
	for i := range n {
		p.pending[Cell{Namespace: "z", Identifier: fmt.Sprintf("k%d", i), WindowMs: 60_000, Sequence: 1}] = &BlocklistRow{}
	}
	for c := range p.pending {
		delete(p.pending, c) // written
	}
	p.mu.Unlock()
	held := heapInUse()
	p.prune(time.Now().UnixMilli())
	after := heapInUse()
	runtime.KeepAlive(p)
	if freed := int64(held) - int64(after); freed < 4<<20 {
		t.Fatalf("the prune gave back %d bytes of an empty map that held %d rows", freed, n)
	}
}

func heapInUse() uint64 {
	var m runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// layerWithMySQLDown is a layer of region a whose database's server has
// stopped, not started.
func layerWithMySQLDown(t *testing.T) *Propagator {
	t.Helper()
	mysqltest.Require(t)
	srv := mysqltest.Start(t)
	dsn := srv.NewDatabase(t)
	srv.Stop()
	eng := engine.New(engine.Config{Manual: true})
	t.Cleanup(func() { _ = eng.Close(bg) })
	p, err := New(Config{DSN: dsn, Region: "a", Timeout: 200 * time.Millisecond}, eng, Options{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}
