package propagation

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

// TestFailover_PublishedCountsReachTheNewPrimary: the primary dies with a
// row of region a the replica never applied (asynchronous replication),
// and the replica is promoted behind the same address. a's count stood
// still since, so nothing published it again: region b, reading the new
// primary, never saw a's 60 units for the rest of the window and admitted
// its whole limit on top of them. A changed server under the DSN is now
// seen at the next global sync, and every cell is published again.
func TestFailover_PublishedCountsReachTheNewPrimary(t *testing.T) {
	pair := mysqltest.StartPair(t)
	primary, _ := pair.NewDatabase(t)
	front := pair.StartFront(t)
	s := newSetup(t)
	s.dsn = front.DSN(primary)
	a := s.region("a")
	b := s.region("b")
	a.p.GlobalSyncOnce(bg) // reads the database's clock, as every sync does
	b.p.GlobalSyncOnce(bg)
	pair.WaitCaughtUp(t) // the schema

	pair.StopApplying(t)
	if n := a.decide("k", 100, 60); n != 60 {
		t.Fatalf("a admitted %d of 60", n)
	}
	a.p.FlushOnce(bg) // published at 60 %, on the primary only
	if n := countRows(t, s.dsn, "ratelimit_global_counts", ""); n != 1 {
		t.Fatalf("%d published rows on the primary, want a's 1", n)
	}

	front.Failover(t, pair)
	if n := countRows(t, s.dsn, "ratelimit_global_counts", ""); n != 0 {
		t.Fatalf("%d published rows on the promoted replica, want none (it never applied a's)", n)
	}
	for _, r := range []*region{a, b} {
		r.p.GlobalSyncOnce(bg)
		r.p.FlushOnce(bg)
	}
	b.p.FlushOnce(bg)
	importsAfterFailover(t, b, s.dsn, 60)
}

// TestFailover_HolderPublishesItsRegionAgain: as
// TestFailover_PublishedCountsReachTheNewPrimary, for a region with Redis,
// whose holder publishes the region's total of each registered cell: it
// wrote a cell again only when the total grew.
func TestFailover_HolderPublishesItsRegionAgain(t *testing.T) {
	pair := mysqltest.StartPair(t)
	primary, _ := pair.NewDatabase(t)
	front := pair.StartFront(t)
	s := newSetup(t)
	s.dsn = front.DSN(primary)
	mem := newMemRegion(s.clk)
	// The node's store is the layer's own, which reads the server_id.
	eng := engine.New(engine.Config{Now: s.clk.Now, Manual: true})
	eng.Zone("z", window)
	cfg := Config{DSN: s.dsn, Region: "a", Batch: 100, Timeout: 5 * time.Second}
	n1 := &region{eng: eng, p: s.start(eng, cfg, Options{Now: s.clk.Now, Region: memNode{mem, "n1"}})}
	b := s.region("b")
	n1.p.GlobalSyncOnce(bg)
	b.p.GlobalSyncOnce(bg)
	pair.WaitCaughtUp(t)

	pair.StopApplying(t)
	n1.decide("k", 100, 60)
	mem.setTotal("k", 60) // what the region's Redis would hold
	n1.p.FlushOnce(bg)    // registers k, hot at 60 %, takes the role and publishes it
	n1.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_global_counts", "WHERE region = 'a'"); n != 1 {
		t.Fatalf("%d published rows of region a on the primary, want 1", n)
	}

	front.Failover(t, pair)
	n1.p.GlobalSyncOnce(bg)
	n1.p.FlushOnce(bg)
	b.p.GlobalSyncOnce(bg)
	b.p.FlushOnce(bg)
	importsAfterFailover(t, b, s.dsn, 60)
}

// importsAfterFailover fails the test unless region b imports want for
// key k, what region a published, from the database at dsn.
func importsAfterFailover(t *testing.T, b *region, dsn string, want int64) {
	t.Helper()
	c, ok := b.eng.Inspect(key("k"))
	var global int64
	if ok {
		global = c.Cells[0].Global
	}
	if global != want {
		t.Fatalf("b's import of region a's count after the failover = %d, want %d (rows on the new primary: %d)",
			global, want, countRows(t, dsn, "ratelimit_global_counts", ""))
	}
}

// switchingServer is the layer's store whose server, as its clock read
// names it, is id once set (another server took the DSN), and whose next
// write of published counts runs during first: what another goroutine
// does while that write is on its way.
type switchingServer struct {
	*sqlStore
	id     atomic.Pointer[string]
	during func()
}

func (s *switchingServer) Server() string {
	if id := s.id.Load(); id != nil {
		return *id
	}
	return s.sqlStore.Server()
}

func (s *switchingServer) UpsertCounts(ctx context.Context, rows []*CountRow) error {
	if f := s.during; f != nil {
		s.during = nil
		f()
	}
	return s.sqlStore.UpsertCounts(ctx, rows)
}

// TestFailover_SeenDuringAWholePushStillPublishesEveryCellAgain: the
// global sync (its own goroutine) sees another server under the DSN while
// a flush's whole push is writing. The flush, done, cleared the flags
// that said "publish every cell again", set by the sync after the flush
// read them: a count that stood still never reached the new server, and
// the other regions left it out until a whole read of the published
// counts missed the row (ten syncs later).
func TestFailover_SeenDuringAWholePushStillPublishesEveryCellAgain(t *testing.T) {
	s := newSetup(t)
	eng, cfg, sql := s.engineAndStore("a")
	st := &switchingServer{sqlStore: sql}
	a := &region{eng: eng, p: s.start(eng, cfg, Options{Now: s.clk.Now, Store: st, Logger: zap.NewNop()})}
	a.p.GlobalSyncOnce(bg) // notes the server
	a.decide("still", 100, 60)
	a.decide("grows", 100, 60)
	a.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_global_counts", ""); n != 2 {
		t.Fatalf("%d published rows, want 2", n)
	}
	a.decide("grows", 100, 1)
	a.p.GlobalSyncOnce(bg) // the next push is a whole one
	st.during = func() {
		// A promoted replica that never applied the rows answers now,
		// and the global sync sees it while the push writes.
		if _, err := mysqltest.Open(t, s.dsn).Exec("TRUNCATE TABLE ratelimit_global_counts"); err != nil {
			t.Fatal(err)
		}
		id := "another server"
		st.id.Store(&id)
		a.p.GlobalSyncOnce(bg)
	}
	a.p.FlushOnce(bg)
	if st.during != nil {
		t.Fatal("the flush wrote no published counts")
	}
	a.p.FlushOnce(bg)
	a.p.GlobalSyncOnce(bg)
	a.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_global_counts", "WHERE identifier = 'still' AND count = 60"); n != 1 {
		t.Fatalf("%d rows of the count that stood still on the new server, want 1", n)
	}
}
