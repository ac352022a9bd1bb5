package propagation

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

// TestLocks_AnUpsertBehindARowLockEndsWithItsFlush: an operator's (or a
// tool's) transaction holds a's row (SELECT … FOR UPDATE) while a
// publishes. The flush gives up at the query timeout, and the write is
// counted and retried; but the server went on waiting for the lock for
// innodb_lock_wait_timeout (50 s by default) on a connection the client
// had closed, so each flush left one more waiting statement, and a
// process at one flush a second held dozens of the server's connections
// while any lock lasted. The sessions now wait for locks no longer than
// the query timeout.
func TestLocks_AnUpsertBehindARowLockEndsWithItsFlush(t *testing.T) {
	s := newSetup(t)
	a := s.region("a", func(c *Config) { c.Timeout = 500 * time.Millisecond })
	a.decide("k", 100, 60)
	a.p.FlushOnce(bg)
	name := s.dsn[strings.LastIndex(s.dsn, "/")+1:]

	db := mysqltest.Open(t, s.dsn)
	lock, err := db.Conn(bg)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if _, err := lock.ExecContext(bg, "BEGIN"); err != nil {
		t.Fatal(err)
	}
	if _, err := lock.ExecContext(bg, "SELECT * FROM ratelimit_global_counts FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	a.decide("k", 100, 10)
	a.p.FlushOnce(bg)
	if st := a.p.Stats(); st.WriteErrors == 0 || st.DroppedBatches == 0 {
		t.Fatalf("a write behind a lock past the timeout was not counted: %+v", st)
	}
	waiting := func() int {
		var n int
		err := db.QueryRow(`SELECT COUNT(*) FROM information_schema.processlist
  WHERE db = ? AND info LIKE 'INSERT INTO ratelimit_global_counts%'`, name).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	deadline := time.Now().Add(5 * time.Second)
	for waiting() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d upserts still wait for the lock 5 s after their flush gave up", waiting())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := lock.ExecContext(context.Background(), "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	a.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_global_counts", "WHERE region = 'a' AND count = 70"); n != 1 {
		t.Fatalf("a's count after the lock was released: %d rows at 70, want 1 (the batch retried)", n)
	}
}
