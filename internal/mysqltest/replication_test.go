package mysqltest

import (
	"testing"
)

// TestPair_ReplicaFollowsAndStops: a row written to the primary reaches
// the replica; while its SQL thread is stopped, a new one does not, and it
// does once the replica applies again.
func TestPair_ReplicaFollowsAndStops(t *testing.T) {
	p := StartPair(t)
	pdsn, rdsn := p.NewDatabase(t)
	prim, repl := Open(t, pdsn), Open(t, rdsn)
	if _, err := prim.Exec(`CREATE TABLE t (x INT PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	if _, err := prim.Exec(`INSERT INTO t VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	count := func() int {
		var n int
		if err := repl.QueryRow(`SELECT COUNT(*) FROM t`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	p.WaitCaughtUp(t)
	if n := count(); n != 1 {
		t.Fatalf("replica holds %d rows, want 1", n)
	}
	p.StopApplying(t)
	if _, err := prim.Exec(`INSERT INTO t VALUES (2)`); err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 1 {
		t.Fatalf("a stopped replica applied a row: %d", n)
	}
	p.StartApplying(t)
	p.WaitCaughtUp(t)
	if n := count(); n != 2 {
		t.Fatalf("after resuming, replica holds %d rows, want 2", n)
	}
}
