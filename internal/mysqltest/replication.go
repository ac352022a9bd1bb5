package mysqltest

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"testing"
	"time"
)

// role is a server's part in replication.
type role int

const (
	// standalone skips grant tables and writes no binary log.
	standalone role = iota
	// primary writes a binary log (row format) for its replicas.
	primary
	// replica is read-only and applies a primary's binary log.
	replica
)

// args are the server options of the role. A primary and its replica
// keep their grant tables (replication needs them): root's password is
// empty, so DSN works as for a standalone server.
func (r role) args(dir string) []string {
	switch r {
	case primary:
		return []string{"--server-id=1", "--log-bin=" + filepath.Join(dir, "bin"), "--binlog-format=ROW"}
	case replica:
		return []string{"--server-id=2", "--read-only=1", "--skip-log-bin"}
	}
	return []string{"--skip-grant-tables", "--skip-log-bin"}
}

// Pair is a primary and a replica that applies its binary log, as a
// region far from the primary reads it.
type Pair struct {
	Primary, Replica *Server
}

// StartPair starts a primary and its replica for the test, replicating
// from the primary's first transaction, and stops both when the test
// ends.
func StartPair(t testing.TB) *Pair {
	t.Helper()
	Require(t)
	p := &Pair{}
	var err error
	if p.Primary, err = startProcess(t.TempDir(), primary); err != nil {
		t.Fatalf("mysqltest: primary: %v", err)
	}
	t.Cleanup(p.Primary.Stop)
	if p.Replica, err = startProcess(t.TempDir(), replica); err != nil {
		t.Fatalf("mysqltest: replica: %v", err)
	}
	t.Cleanup(p.Replica.Stop)
	p.exec(t, fmt.Sprintf(`CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT=%d,
  MASTER_USER='root', MASTER_PASSWORD='', MASTER_USE_GTID=no`, p.Primary.port), "START SLAVE")
	return p
}

// exec runs statements on the replica.
func (p *Pair) exec(t testing.TB, stmts ...string) {
	t.Helper()
	db, err := sql.Open("mysql", p.Replica.DSN(""))
	if err != nil {
		t.Fatalf("mysqltest: %v", err)
	}
	defer db.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, q := range stmts {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatalf("mysqltest: replica: %s: %v", q, err)
		}
	}
}

// NewDatabase creates a database on the primary and waits until the
// replica has it; it returns the DSNs of the database on each.
func (p *Pair) NewDatabase(t testing.TB) (primaryDSN, replicaDSN string) {
	t.Helper()
	primaryDSN = p.Primary.NewDatabase(t)
	name := primaryDSN[len(p.Primary.DSN("")):]
	replicaDSN = p.Replica.DSN(name)
	p.WaitCaughtUp(t)
	return primaryDSN, replicaDSN
}

// StopApplying stops the replica's SQL thread: it keeps receiving the
// primary's binary log but applies nothing, as a lagging replica.
func (p *Pair) StopApplying(t testing.TB) { t.Helper(); p.exec(t, "STOP SLAVE SQL_THREAD") }

// SetDelay holds the replica d behind the primary (MASTER_DELAY, whole
// seconds): it applies each transaction once d has passed since the
// primary wrote it, as a replica far away or busy keeps its lag.
func (p *Pair) SetDelay(t testing.TB, d time.Duration) {
	t.Helper()
	p.exec(t, "STOP SLAVE", fmt.Sprintf("CHANGE MASTER TO MASTER_DELAY=%d", int(d/time.Second)), "START SLAVE")
}

// StartApplying starts the replica's SQL thread again.
func (p *Pair) StartApplying(t testing.TB) { t.Helper(); p.exec(t, "START SLAVE SQL_THREAD") }

// WaitCaughtUp waits until the replica has applied everything the primary
// has written so far.
func (p *Pair) WaitCaughtUp(t testing.TB) {
	t.Helper()
	pdb, err := sql.Open("mysql", p.Primary.DSN(""))
	if err != nil {
		t.Fatalf("mysqltest: %v", err)
	}
	defer pdb.Close()
	var file string
	var pos int64
	var ignore1, ignore2, ignore3 sql.NullString
	if err := pdb.QueryRow("SHOW MASTER STATUS").Scan(&file, &pos, &ignore1, &ignore2); err != nil {
		// Some versions add a column.
		if err2 := pdb.QueryRow("SHOW MASTER STATUS").Scan(&file, &pos, &ignore1, &ignore2, &ignore3); err2 != nil {
			t.Fatalf("mysqltest: SHOW MASTER STATUS: %v", err)
		}
	}
	rdb, err := sql.Open("mysql", p.Replica.DSN(""))
	if err != nil {
		t.Fatalf("mysqltest: %v", err)
	}
	defer rdb.Close()
	var n sql.NullInt64
	if err := rdb.QueryRow("SELECT MASTER_POS_WAIT(?, ?, 60)", file, pos).Scan(&n); err != nil || !n.Valid || n.Int64 < 0 {
		t.Fatalf("mysqltest: the replica did not catch up within 60 s (%v, %v)", n, err)
	}
}

// StartGranted starts a lone mariadbd that keeps its grant tables (as a
// primary does: root without a password), for tests that need users of
// their own, privileges and read_only; it stops when the test ends.
func StartGranted(t testing.TB) *Server {
	t.Helper()
	Require(t)
	s, err := startProcess(t.TempDir(), primary)
	if err != nil {
		t.Fatalf("mysqltest: %v", err)
	}
	t.Cleanup(s.Stop)
	return s
}
