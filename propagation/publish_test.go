package propagation

import (
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
	"go.uber.org/zap"
)

func TestPublishedCounts_EvenTrafficIsCountedOnce(t *testing.T) {
	s := newSetup(t)
	s.limit = 100
	a, b := s.region("a"), s.region("b")
	a.decide("even", 100, 30)
	b.decide("even", 100, 30)
	for _, r := range []*region{a, b} {
		r.p.GlobalSyncOnce(bg) // asks the next flush for a full push
		r.p.FlushOnce(bg)
	}
	a.p.FlushOnce(bg) // pulls what b published
	if c := a.cell(t, "even", seq0); c.Regional != 30 || c.Global != 30 {
		t.Fatalf("A's cell = %+v, want 30 regional and B's 30 global", c)
	}
	// Each region now admits only what is left of the shared limit.
	if n := a.decide("even", 100, 100); n != 40 {
		t.Fatalf("A admitted %d more, want the 40 left of the shared limit", n)
	}
	if st := a.p.Stats(); st.CountsPublished != 1 || st.CountsApplied < 1 {
		t.Fatalf("A stats: %+v", st)
	}
}

func TestPublishedCounts_FloorAndPressure(t *testing.T) {
	s := newSetup(t)
	s.limit = 100
	a := s.region("a")
	a.decide("cold", 100, 10) // 10 %: below the floor
	a.decide("warm", 100, 30) // 30 %: published on the full push only
	a.decide("hot", 100, 60)  // 60 %: published on every flush
	a.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_global_counts", ""); n != 1 {
		t.Fatalf("%d rows after a plain flush, want the hot key's only", n)
	}
	a.p.GlobalSyncOnce(bg)
	a.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_global_counts", ""); n != 2 {
		t.Fatalf("%d rows after a full push, want hot and warm", n)
	}
	// Not grown: not written again.
	before := a.p.Stats().CountsPublished
	a.p.GlobalSyncOnce(bg)
	a.p.FlushOnce(bg)
	if got := a.p.Stats().CountsPublished; got != before {
		t.Fatalf("published %d rows for cells that did not grow", got-before)
	}
}

func TestPublishedCounts_BatchBoundsAWrite(t *testing.T) {
	s := newSetup(t)
	s.limit = 100
	a := s.region("a", func(c *Config) { c.Batch = 2 })
	for i, n := range []int{55, 90, 70, 60} {
		a.decide(string(rune('a'+i)), 100, n)
	}
	a.p.FlushOnce(bg)
	db := mysqltest.Open(t, s.dsn)
	rows, err := db.Query(`SELECT identifier FROM ratelimit_global_counts ORDER BY identifier`)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for rows.Next() {
		var id []byte
		_ = rows.Scan(&id)
		ids = append(ids, string(id))
	}
	rows.Close()
	if strings.Join(ids, ",") != "b,c" {
		t.Fatalf("one flush wrote %v, want the two highest-pressure keys b,c", ids)
	}
	a.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_global_counts", ""); n != 4 {
		t.Fatalf("%d rows after a second flush, want 4", n)
	}
}

// TestPublish_WeighsEachCellAgainstItsDecisionsLimit: one zone defined by
// two sites with limits 110 and 200 (zone names are global to the
// process). The layer used to take the first site's limit for every key
// of the zone, so a key decided against 110 and at 60 looked below half
// its limit and waited for the next full sync to be published, while
// other regions admitted on. Each cell is weighed against the limit of
// the decisions that produced its count.
func TestPublish_WeighsEachCellAgainstItsDecisionsLimit(t *testing.T) {
	s := newSetup(t)
	a := s.region("a")
	if n := a.decide("tight", 110, 60); n != 60 {
		t.Fatalf("admitted %d of 60 below a limit of 110", n)
	}
	if n := a.decide("loose", 200, 60); n != 60 {
		t.Fatalf("admitted %d of 60 below a limit of 200", n)
	}
	a.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_global_counts", "WHERE identifier = ?", "tight"); n != 1 {
		t.Fatalf("%d published rows for the key at 60 of 110, want 1 at once", n)
	}
	if n := countRows(t, s.dsn, "ratelimit_global_counts", "WHERE identifier = ?", "loose"); n != 0 {
		t.Fatalf("%d published rows for the key at 60 of 200, want none before a full sync", n)
	}
}

// TestPublish_ARepublishingPropagatorWritesWhatWasPublishedElsewhere: a
// reload moved a process that is its own region to another database (or
// changed identifier_secret, which renames its rows). The engine marks
// the cells it published, so the new propagator skipped them until they
// grew: the new database held none of an idle key's count. With
// Republish its first push writes them all.
func TestPublish_ARepublishingPropagatorWritesWhatWasPublishedElsewhere(t *testing.T) {
	s := newSetup(t)
	a := s.region("a")
	a.decide("k", 10, 6) // 60 %: worth publishing
	a.p.GlobalSyncOnce(bg)
	a.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_global_counts", "WHERE identifier = 'k' AND count = 6"); n != 1 {
		t.Fatalf("the first database holds %d rows of k's 6, want 1", n)
	}
	for _, again := range []bool{false, true} {
		dsn := shared.Get(t).NewDatabase(t)
		p := s.start(a.eng, Config{DSN: dsn, Region: "a", Batch: 100, Timeout: 5 * time.Second, Republish: again},
			Options{Now: s.clk.Now, Logger: zap.NewNop()})
		p.FlushOnce(bg)
		want := 0
		if again {
			want = 1
		}
		if n := countRows(t, dsn, "ratelimit_global_counts", "WHERE identifier = 'k' AND count = 6"); n != want {
			t.Fatalf("Republish %v: the new database holds %d rows of k's 6 after a flush, want %d", again, n, want)
		}
	}
}
