package propagation

import (
	"context"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"strings"
	"testing"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

// Operators' hands on the tables mid-window: the equivalent of a Redis
// FLUSHALL for the layer between regions.

// wholeSyncs runs a region's global syncs until its next flush reads the
// tables whole, as the loops do every wholeEvery syncs.
func wholeSyncs(r *region) {
	for range wholeEvery {
		r.p.GlobalSyncOnce(bg)
	}
}

// TestOperator_TruncatedCountsArePublishedAgain: an operator empties
// ratelimit_global_counts (TRUNCATE, or a DELETE) mid-window. Region a's
// count stood still since it was published, so a never wrote it again: a
// region that read the table from then on (c, started after) left a's 60
// units out for the rest of the window and admitted its whole limit on
// top of them. a now finds its own rows missing at its next whole read
// and publishes its cells again.
func TestOperator_TruncatedCountsArePublishedAgain(t *testing.T) {
	for _, stmt := range []string{"TRUNCATE TABLE ratelimit_global_counts", "DELETE FROM ratelimit_global_counts"} {
		t.Run(strings.Fields(stmt)[0], func(t *testing.T) {
			s := newSetup(t)
			a := s.region("a")
			if n := a.decide("k", 100, 60); n != 60 {
				t.Fatalf("a admitted %d of 60", n)
			}
			a.p.FlushOnce(bg) // published at 60 %
			if n := countRows(t, s.dsn, "ratelimit_global_counts", "WHERE region = 'a'"); n != 1 {
				t.Fatalf("%d rows of a, want 1", n)
			}
			if _, err := mysqltest.Open(t, s.dsn).Exec(stmt); err != nil {
				t.Fatal(err)
			}
			c := s.region("c") // reads the table whole on its first flush
			wholeSyncs(a)
			a.p.FlushOnce(bg) // the whole read finds a's row gone
			a.p.FlushOnce(bg)
			c.decide("k", 100, 1)
			c.p.FlushOnce(bg)
			if got := c.cell(t, "k", seq0).Global; got != 60 {
				t.Fatalf("c imports %d of a's 60 units after the table was emptied (a's rows: %d)",
					got, countRows(t, s.dsn, "ratelimit_global_counts", "WHERE region = 'a'"))
			}
		})
	}
}

// TestOperator_ADroppedTableOrDatabaseIsMadeAgain: an operator drops a
// table, a column, or the whole database and creates it again empty. The
// schema was migrated once, at start: every write and pull failed from
// then on ("doesn't exist"), for good, until the process restarted. Now a
// statement that finds the schema gone migrates it again, and the cells
// are published again; meanwhile the layer is not ready. A dropped
// column (reset_base, updated_ms) failed every statement for good even
// after a restart, as the migration added reset_base only with
// reset_version, and the layer stayed ready throughout, as it did with
// its database dropped.
func TestOperator_ADroppedTableOrDatabaseIsMadeAgain(t *testing.T) {
	for _, drop := range [][]string{
		{"DROP TABLE ratelimit_global_counts"},
		{"DROP TABLE ratelimit_global_counts", "DROP TABLE ratelimit_blocklist", "DROP TABLE ratelimit_overrides"},
		{"DROP DATABASE %s", "CREATE DATABASE %s"},
		{"ALTER TABLE ratelimit_global_counts DROP COLUMN reset_base"},
		{"ALTER TABLE ratelimit_global_counts DROP COLUMN updated_ms"},
		{"ALTER TABLE ratelimit_global_counts DROP KEY ratelimit_global_counts_updated"},
	} {
		t.Run(strings.ReplaceAll(drop[0], " ", "_"), func(t *testing.T) {
			s := newSetup(t)
			a := s.region("a")
			if n := a.decide("k", 100, 60); n != 60 {
				t.Fatalf("a admitted %d of 60", n)
			}
			a.p.FlushOnce(bg)
			name := s.dsn[strings.LastIndex(s.dsn, "/")+1:]
			root := mysqltest.Open(t, s.dsn[:strings.LastIndex(s.dsn, "/")+1])
			for _, q := range drop {
				if strings.Contains(q, "%s") {
					q = strings.ReplaceAll(q, "%s", name)
				} else {
					q = strings.Replace(q, "TABLE ", "TABLE "+name+".", 1)
				}
				if _, err := root.Exec(q); err != nil {
					t.Fatal(err)
				}
			}
			// Flushes and syncs as the loops run them; a's count stands
			// still. The first statement that fails finds the schema
			// gone: not ready until the next flush has made it again.
			failed := false
			for range 3 {
				for _, step := range []func(context.Context){a.p.FlushOnce, a.p.GlobalSyncOnce} {
					before := a.p.Stats()
					step(bg)
					st := a.p.Stats()
					if !failed && st.ReadErrors+st.WriteErrors > before.ReadErrors+before.WriteErrors {
						failed = true
						if st.Ready {
							t.Errorf("ready after a statement found the schema gone (%q)", drop)
						}
					}
				}
			}
			if st := a.p.Stats(); !st.Ready || st.SchemaRemade == 0 {
				t.Errorf("after %q and three flushes: ready %v, schema made again %d times", drop, st.Ready, st.SchemaRemade)
			}
			a.p.FlushOnce(bg)
			if st := a.p.Stats(); st.ReadErrors == 0 {
				t.Errorf("no read error counted while the table was gone: %+v", st)
			}
			// By itself: no other process migrates for it.
			var n int
			err := root.QueryRow("SELECT COUNT(*) FROM " + name + ".ratelimit_global_counts WHERE region = 'a'").Scan(&n)
			if err != nil || n != 1 {
				t.Fatalf("a's rows after %q: %d (%v), want its row made again", drop, n, err)
			}
			c := s.region("c")
			c.decide("k", 100, 1)
			c.p.FlushOnce(bg)
			if got := c.cell(t, "k", seq0).Global; got != 60 {
				t.Fatalf("c imports %d of a's 60 units after %q", got, drop)
			}
		})
	}
}

// TestOperator_TheHolderPublishesItsRegionAgainAfterATruncate: as
// TestOperator_TruncatedCountsArePublishedAgain, for a region with Redis,
// whose holder publishes the region's total of each registered cell.
func TestOperator_TheHolderPublishesItsRegionAgainAfterATruncate(t *testing.T) {
	s := newSetup(t)
	mem := newMemRegion(s.clk)
	eng := engine.New(engine.Config{Now: s.clk.Now, Manual: true})
	eng.Zone("z", window)
	cfg := Config{DSN: s.dsn, Region: "a", Batch: 100, Timeout: 5 * time.Second}
	n1 := &region{eng: eng, p: s.start(eng, cfg, Options{Now: s.clk.Now, Region: memNode{mem, "n1"}})}
	n1.decide("k", 100, 60)
	mem.setTotal("k", 60)
	n1.p.FlushOnce(bg) // registers k, takes the role, publishes it
	n1.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_global_counts", "WHERE region = 'a'"); n != 1 {
		t.Fatalf("%d rows of region a, want 1", n)
	}
	if _, err := mysqltest.Open(t, s.dsn).Exec("TRUNCATE TABLE ratelimit_global_counts"); err != nil {
		t.Fatal(err)
	}
	c := s.region("c")
	wholeSyncs(n1)
	n1.p.FlushOnce(bg)
	n1.p.FlushOnce(bg)
	c.decide("k", 100, 1)
	c.p.FlushOnce(bg)
	if got := c.cell(t, "k", seq0).Global; got != 60 {
		t.Fatalf("c imports %d of region a's 60 units after the table was emptied", got)
	}
}

// TestOperator_AReplicaWithoutTheSchemaYetIsNoDroppedTable: a region
// reading a replica (mysql_read) that has not applied the schema yet
// fails its pulls with "doesn't exist" until it does. That is the
// replica's lag, not a table dropped: the schema is not made again and
// the cells are not all published again at every flush.
func TestOperator_AReplicaWithoutTheSchemaYetIsNoDroppedTable(t *testing.T) {
	pair := mysqltest.StartPair(t)
	primary, replica := pair.NewDatabase(t)
	pair.StopApplying(t)
	s := newSetup(t)
	s.dsn = primary
	b := s.region("b", func(c *Config) { c.ReadDSN = replica })
	b.decide("k", 100, 60)
	for range 3 {
		b.p.FlushOnce(bg)
	}
	st := b.p.Stats()
	if st.ReadErrors == 0 {
		t.Fatalf("no read error from a replica without the tables: %+v", st)
	}
	if st.SchemaRemade != 0 || st.CountsPublished != 1 {
		t.Fatalf("the replica's lag taken for a dropped table: schema made again %d times, %d rows published (want 0 and 1)",
			st.SchemaRemade, st.CountsPublished)
	}
	pair.StartApplying(t)
	pair.WaitCaughtUp(t)
	b.p.FlushOnce(bg)
	if st := b.p.Stats(); st.LastPull.IsZero() {
		t.Fatalf("b never pulled once the replica caught up: %+v", st)
	}
}

// TestOperator_ABlocklistEmptiedByHandLosesNoCount: the denial rows of
// ratelimit_blocklist are a fast path; the counts they carry are in
// ratelimit_global_counts too. A region that starts after an operator
// emptied the blocklist imports the denied key's count whole and admits
// nothing more of it.
func TestOperator_ABlocklistEmptiedByHandLosesNoCount(t *testing.T) {
	s := newSetup(t)
	a := s.region("a")
	if n := a.decide("k", s.limit, 15); n != int(s.limit) {
		t.Fatalf("a admitted %d of 15, want the limit %d", n, s.limit)
	}
	a.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_blocklist", ""); n == 0 {
		t.Fatal("a's denial wrote no blocklist row")
	}
	db := mysqltest.Open(t, s.dsn)
	if _, err := db.Exec("TRUNCATE TABLE ratelimit_blocklist"); err != nil {
		t.Fatal(err)
	}
	c := s.region("c")
	c.p.FlushOnce(bg) // the whole read of a process's start
	if n := c.decide("k", s.limit, 5); n != 0 {
		t.Fatalf("c, started after the blocklist was emptied, admitted %d of k: a's %d units were lost with it", n, s.limit)
	}
}
