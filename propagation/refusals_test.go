package propagation

import (
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

// MySQL up and answering, but refusing the layer: read_only, a password
// changed, connections killed. Each must be counted and logged with the
// server's reason, and end by itself once the operator undoes it.

// grantedSetup is a setup on a server with grant tables, whose regions
// connect as a user of their own (no SUPER: read_only binds it).
func grantedSetup(t *testing.T) (s *setup, root string) {
	t.Helper()
	srv := mysqltest.StartGranted(t)
	root = srv.NewDatabase(t)
	name := root[strings.LastIndex(root, "/")+1:]
	db := mysqltest.Open(t, srv.DSN(""))
	for _, q := range []string{
		"CREATE USER 'rl'@'127.0.0.1' IDENTIFIED BY 'pw1'",
		"GRANT ALL ON " + name + ".* TO 'rl'@'127.0.0.1'",
	} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	s = &setup{t: t, dsn: fmt.Sprintf("rl:pw1@tcp(127.0.0.1:%d)/%s", srv.Port(), name), clk: new(clock), limit: 10}
	s.clk.ms.Store(epoch + 10_000)
	return s, srv.DSN("")
}

// observed starts a region whose log lines are kept.
func (s *setup) observed(name string) (*region, *observer.ObservedLogs) {
	s.t.Helper()
	core, logs := observer.New(zap.DebugLevel)
	eng := engine.New(engine.Config{Now: s.clk.Now, Manual: true})
	eng.Zone("z", window)
	cfg := Config{DSN: s.dsn, Region: name, Batch: 100, Timeout: 5 * time.Second,
		Breaker: Breaker{Timeout: 200 * time.Millisecond}}
	return &region{eng: eng, p: s.start(eng, cfg, Options{Now: s.clk.Now, Logger: zap.New(core)})}, logs
}

// logged reports whether a line whose message starts with msg carries an
// error holding reason.
func logged(logs *observer.ObservedLogs, msg, reason string) bool {
	for _, e := range logs.All() {
		if strings.HasPrefix(e.Message, msg) && strings.Contains(fmt.Sprint(e.ContextMap()["error"]), reason) {
			return true
		}
	}
	return false
}

// untilImported flushes a and b until b imports want of k, or fails the
// test after a deadline (the breaker's probe waits for its timeout).
func untilImported(t *testing.T, a, b *region, want int64) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		a.p.FlushOnce(bg)
		b.p.FlushOnce(bg)
		if c, ok := b.eng.Inspect(key("k")); ok && c.Cells[0].Global == want {
			return
		}
		if time.Now().After(deadline) {
			c, _ := b.eng.Inspect(key("k"))
			t.Fatalf("b never imported a's %d: %+v; a's stats %+v", want, c, a.p.Stats())
		}
		time.Sleep(50 * time.Millisecond) // the breaker's timeout runs on the wall clock
	}
}

// TestRefusal_ReadOnlyPrimary: the primary is set read_only mid-run.
// Writes are refused (1290), counted and logged with the reason, the
// breaker opens, and a's count reaches b once read_only is lifted.
func TestRefusal_ReadOnlyPrimary(t *testing.T) {
	s, root := grantedSetup(t)
	a, logs := s.observed("a")
	b := s.region("b")
	rdb := mysqltest.Open(t, root)
	if _, err := rdb.Exec("SET GLOBAL read_only = 1"); err != nil {
		t.Fatal(err)
	}
	a.decide("k", 100, 60)
	for range 6 {
		a.p.FlushOnce(bg)
	}
	st := a.p.Stats()
	if st.WriteErrors == 0 || st.DroppedBatches == 0 || st.Breaker != "open" {
		t.Fatalf("read_only: write errors %d, dropped %d, breaker %s", st.WriteErrors, st.DroppedBatches, st.Breaker)
	}
	if !logged(logs, "mysql write failed", "read-only") {
		t.Fatalf("no write failure logged with the server's reason: %v", logs.All())
	}
	if _, err := rdb.Exec("SET GLOBAL read_only = 0"); err != nil {
		t.Fatal(err)
	}
	untilImported(t, a, b, 60)
}

// TestRefusal_ReadingTheStateMovesNoBreaker: the write breaker a
// read_only primary opened stays open for the status and the metrics
// while no flush comes, however long they read it. Stats once asked
// gobreaker for the state, which moves an open breaker whose timeout
// passed to half-open: every scrape turned it half-open (and logged the
// change) with MySQL still refusing and nothing probing.
func TestRefusal_ReadingTheStateMovesNoBreaker(t *testing.T) {
	s, root := grantedSetup(t)
	a, logs := s.observed("a")
	b := s.region("b")
	rdb := mysqltest.Open(t, root)
	if _, err := rdb.Exec("SET GLOBAL read_only = 1"); err != nil {
		t.Fatal(err)
	}
	a.decide("k", 100, 60)
	for range 6 {
		a.p.FlushOnce(bg)
	}
	if st := a.p.Stats(); st.Breaker != "open" {
		t.Fatalf("read_only: breaker %s after 6 failed flushes", st.Breaker)
	}
	// The state must hold past the breaker's timeout (200 ms) with
	// nothing but reads of it: there is no event to await.
	for end := time.Now().Add(600 * time.Millisecond); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if st := a.p.Stats(); st.Breaker != "open" {
			t.Fatalf("with no flush, the breaker read %s; want open", st.Breaker)
		}
	}
	for _, e := range logs.FilterMessage("mysql write breaker changed state").All() {
		if e.ContextMap()["to"] == "half-open" {
			t.Fatalf("the breaker went half-open with no flush: %v", e.ContextMap())
		}
	}
	if _, err := rdb.Exec("SET GLOBAL read_only = 0"); err != nil {
		t.Fatal(err)
	}
	untilImported(t, a, b, 60)
	if st := a.p.Stats(); st.Breaker != "closed" {
		t.Fatalf("breaker %s once a's count reached b", st.Breaker)
	}
}

// TestRefusal_PasswordChangedAndConnectionsKilled: the user's password
// changes and its connections are killed: every statement fails with
// the server's reason (access denied), counted and logged; once the
// password is back, the counts flow again by themselves.
func TestRefusal_PasswordChangedAndConnectionsKilled(t *testing.T) {
	s, root := grantedSetup(t)
	a, logs := s.observed("a")
	b := s.region("b")
	rdb := mysqltest.Open(t, root)
	kill := func() { killConnectionsOf(t, rdb, "rl") }
	// Connections killed alone: the pool dials again, nothing fails for
	// long.
	a.decide("k", 100, 60)
	a.p.FlushOnce(bg)
	kill()
	a.decide("k", 100, 10)
	untilImported(t, a, b, 70)

	if _, err := rdb.Exec("ALTER USER 'rl'@'127.0.0.1' IDENTIFIED BY 'pw2'"); err != nil {
		t.Fatal(err)
	}
	kill()
	a.decide("k", 100, 20)
	flushesFailSaying(t, a, logs, "Access denied")
	if _, err := rdb.Exec("ALTER USER 'rl'@'127.0.0.1' IDENTIFIED BY 'pw1'"); err != nil {
		t.Fatal(err)
	}
	untilImported(t, a, b, 90)
}

// TestRefusal_MaxConnectionsReached: the server's connections are all
// taken (max_connections, another client holding them) after the layer's
// own were killed: it cannot connect, counts it with the server's reason
// ("Too many connections"), and flows again once connections are free.
func TestRefusal_MaxConnectionsReached(t *testing.T) {
	s, root := grantedSetup(t)
	a, logs := s.observed("a")
	b := s.region("b")
	rdb := mysqltest.Open(t, root)
	a.decide("k", 100, 60)
	untilImported(t, a, b, 60)

	if _, err := rdb.Exec("SET GLOBAL max_connections = 10"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = rdb.Exec("SET GLOBAL max_connections = 500") })
	killConnectionsOf(t, rdb, "rl")
	// Another client of the same user takes every connection left.
	hog := mysqltest.Open(t, s.dsn)
	var held []*sql.Conn
	for {
		c, err := hog.Conn(bg)
		if err != nil {
			if !strings.Contains(err.Error(), "Too many connections") {
				t.Fatal(err)
			}
			break
		}
		if err := c.PingContext(bg); err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
		if len(held) > 20 {
			t.Fatal("max_connections does not bind")
		}
	}
	a.decide("k", 100, 20)
	flushesFailSaying(t, a, logs, "Too many connections")
	for _, c := range held {
		_ = c.Close()
	}
	_ = hog.Close()
	untilImported(t, a, b, 80)
}

// killConnectionsOf kills every connection user holds on the server rdb
// reaches.
func killConnectionsOf(t *testing.T, rdb *sql.DB, user string) {
	t.Helper()
	rows, err := rdb.Query("SELECT id FROM information_schema.processlist WHERE user = ?", user)
	if err != nil {
		t.Fatal(err)
	}
	var ids []int64
	for rows.Next() {
		var id int64
		_ = rows.Scan(&id)
		ids = append(ids, id)
	}
	rows.Close()
	for _, id := range ids {
		_, _ = rdb.Exec(fmt.Sprintf("KILL %d", id)) // it may have ended meanwhile
	}
}

// flushesFailSaying flushes a six times and checks that its statements
// failed, counted, and that a failure was logged with the server's
// reason.
func flushesFailSaying(t *testing.T, a *region, logs *observer.ObservedLogs, reason string) {
	t.Helper()
	for range 6 {
		a.p.FlushOnce(bg)
	}
	if st := a.p.Stats(); st.WriteErrors+st.ReadErrors == 0 {
		t.Fatalf("%s: no error counted: %+v", reason, st)
	}
	if !logged(logs, "mysql ", reason) {
		t.Fatalf("no failure logged with the server's reason (%s): %v", reason, logs.All())
	}
}
