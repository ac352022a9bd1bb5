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
