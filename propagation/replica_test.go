package propagation

import (
	"testing"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

// TestReplica_PullsCatchUpWhenTheReplicaResumes: region b pulls from a
// replica (mysql_read) whose SQL thread stops while region a publishes.
// Nothing a published is lost: b's pulls see nothing while the replica
// applies nothing, and catch up on the first pull after it resumes. The
// replica's lag is unknown while it is stopped, and known once it runs.
func TestReplica_PullsCatchUpWhenTheReplicaResumes(t *testing.T) {
	pair := mysqltest.StartPair(t)
	primary, replica := pair.NewDatabase(t)
	s := newSetup(t)
	s.dsn = primary
	a := s.region("a")
	b := s.region("b", func(c *Config) { c.ReadDSN = replica })
	pair.WaitCaughtUp(t) // the schema
	b.p.FlushOnce(bg)    // the whole read of a process's start
	b.p.GlobalSyncOnce(bg)
	if st := b.p.Stats(); st.ReplicaLag != 0 {
		t.Fatalf("replica lag %s while it runs and is caught up, want 0", st.ReplicaLag)
	}

	pair.StopApplying(t)
	if n := a.decide("k", 100, 60); n != 60 {
		t.Fatalf("a admitted %d of 60", n)
	}
	a.p.FlushOnce(bg) // published at 60 %
	b.p.FlushOnce(bg)
	if c, ok := b.eng.Inspect(key("k")); ok && c.Cells[0].Global != 0 {
		t.Fatalf("b imported through a stopped replica: %+v", c)
	}
	b.p.GlobalSyncOnce(bg)
	if st := b.p.Stats(); st.ReplicaLag >= 0 {
		t.Fatalf("replica lag %s while its SQL thread is stopped, want unknown (-1)", st.ReplicaLag)
	}

	pair.StartApplying(t)
	pair.WaitCaughtUp(t)
	b.p.FlushOnce(bg)
	if c := b.cell(t, "k", seq0); c.Global != 60 {
		t.Fatalf("b's cell after the replica resumed = %+v, want a's 60 as global", c)
	}
	if st := b.p.Stats(); st.WholeReads != int64(tables) || st.ChangeReads < 2*int64(tables) {
		t.Fatalf("b read %d tables whole and pulled changes %d times: the catch-up must be a pull of changes", st.WholeReads, st.ChangeReads)
	}
}

// TestReplica_CountsEmptiedOnThePrimaryArePublishedAgain: region a
// publishes to the primary and pulls from a replica (mysql_read). An
// operator empties ratelimit_global_counts on the primary, and the
// replica applies it. a's next whole read (from the replica) lacks its
// rows; checked against the primary, they are missing there too, and a
// publishes its cells again, for region b to import.
func TestReplica_CountsEmptiedOnThePrimaryArePublishedAgain(t *testing.T) {
	for _, empty := range []string{"TRUNCATE TABLE ratelimit_global_counts", "DELETE FROM ratelimit_global_counts"} {
		t.Run(empty, func(t *testing.T) {
			pair := mysqltest.StartPair(t)
			primary, replica := pair.NewDatabase(t)
			s := newSetup(t)
			s.dsn = primary
			read := func(c *Config) { c.ReadDSN = replica }
			a, b := s.region("a", read), s.region("b", read)
			pair.WaitCaughtUp(t) // the schema
			if n := a.decide("k", 100, 60); n != 60 {
				t.Fatalf("a admitted %d of 60", n)
			}
			a.p.FlushOnce(bg)
			if n := countRows(t, primary, "ratelimit_global_counts", "WHERE region = 'a'"); n != 1 {
				t.Fatalf("a's rows on the primary: %d, want 1", n)
			}
			db := mysqltest.Open(t, primary)
			if _, err := db.Exec(empty); err != nil {
				t.Fatal(err)
			}
			pair.WaitCaughtUp(t)
			a.p.readWholeNext()
			a.p.FlushOnce(bg) // finds the rows missing
			a.p.FlushOnce(bg) // publishes them again
			if n := countRows(t, primary, "ratelimit_global_counts", "WHERE region = 'a'"); n != 1 {
				t.Fatalf("a's rows on the primary after the emptying and a whole read: %d, want 1 (published again)", n)
			}
			if st := a.p.Stats(); st.OwnRowsMissing != 1 {
				t.Errorf("own rows missing = %d, want 1", st.OwnRowsMissing)
			}
			pair.WaitCaughtUp(t)
			b.p.readWholeNext()
			b.p.FlushOnce(bg)
			if c := b.cell(t, "k", seq0); c.Global != 60 {
				t.Fatalf("b's cell = %+v, want a's 60 as global", c)
			}
		})
	}
}

// TestReplica_ALaggingReplicaDoesNotRepublish: rows the replica has not
// applied yet are not taken for rows deleted: the primary holds them.
func TestReplica_ALaggingReplicaDoesNotRepublish(t *testing.T) {
	pair := mysqltest.StartPair(t)
	primary, replica := pair.NewDatabase(t)
	s := newSetup(t)
	s.dsn = primary
	a := s.region("a", func(c *Config) { c.ReadDSN = replica })
	pair.WaitCaughtUp(t)
	pair.StopApplying(t)
	defer pair.StartApplying(t)
	if n := a.decide("k", 100, 60); n != 60 {
		t.Fatalf("a admitted %d of 60", n)
	}
	a.p.FlushOnce(bg)
	a.p.readWholeNext()
	a.p.FlushOnce(bg)
	if st := a.p.Stats(); st.OwnRowsMissing != 0 {
		t.Fatalf("own rows missing = %d behind a stopped replica, want 0: the primary holds them", st.OwnRowsMissing)
	}
}

// TestReplica_OverridesEmptiedOnThePrimaryAreWrittenBack: with
// mysql_read, ratelimit_overrides emptied on the primary (and so on the
// replica) is seen on the replica's whole read, checked against the
// primary, and the overrides written back; behind a stopped replica, an
// override just written is not taken for one lost.
func TestReplica_OverridesEmptiedOnThePrimaryAreWrittenBack(t *testing.T) {
	pair := mysqltest.StartPair(t)
	primary, replica := pair.NewDatabase(t)
	s := newSetup(t)
	s.dsn = primary
	a := s.region("a", func(c *Config) { c.ReadDSN = replica })
	pair.WaitCaughtUp(t)
	pair.StopApplying(t)
	a.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "cust", Limit: 500, Region: "a", Version: 2000})
	a.p.FlushOnce(bg)
	a.p.readWholeNext()
	a.p.FlushOnce(bg)
	if st := a.p.Stats(); st.OverrideRowsMissing != 0 {
		t.Fatalf("override rows missing = %d behind a stopped replica, want 0: the primary holds it", st.OverrideRowsMissing)
	}
	pair.StartApplying(t)

	db := mysqltest.Open(t, primary)
	if _, err := db.Exec("TRUNCATE TABLE ratelimit_overrides"); err != nil {
		t.Fatal(err)
	}
	pair.WaitCaughtUp(t)
	a.p.readWholeNext()
	a.p.FlushOnce(bg) // finds it missing
	a.p.FlushOnce(bg) // writes it back
	if n := countRows(t, primary, "ratelimit_overrides", "WHERE identifier = 'cust' AND limit_units = 500"); n != 1 {
		t.Fatalf("cust's override on the primary after the emptying and a whole read: %d rows, want 1 (written back)", n)
	}
	if st := a.p.Stats(); st.OverrideRowsMissing != 1 {
		t.Errorf("override rows missing = %d, want 1", st.OverrideRowsMissing)
	}
}
