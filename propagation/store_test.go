package propagation

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

func TestHostileIdentifiers_RoundTripExactly(t *testing.T) {
	s := newSetup(t)
	s.limit = 1000
	ids := []string{
		"Key", "key", "KEY", "key ", "key  ", " key", "k\xff\xfe", "k\xc3\x28",
		"a:b", "a}b{", "a'b", `a"b`, "a\\b", "a\x00b", "a\x00", "a%b", "a_b", "';DROP TABLE ratelimit_blocklist;--",
		strings.Repeat("x", 10_000), strings.Repeat("x", 10_001), strings.Repeat("é", 32),
	}
	a, b := s.region("a"), s.region("b")
	for i, id := range ids {
		a.decide(id, 1000, 600+i) // pressure ≥ 50 %: pushed on the flush
	}
	a.p.FlushOnce(bg)
	b.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_global_counts", ""); n != len(ids) {
		t.Fatalf("%d rows for %d distinct identifiers: some merged", n, len(ids))
	}
	for i, id := range ids {
		want := int64(600 + i)
		norm := engine.NormalizeIdentifier(id)
		var got int64
		db := mysqltest.Open(t, s.dsn)
		if err := db.QueryRow(`SELECT count FROM ratelimit_global_counts WHERE identifier = ?`, []byte(norm)).Scan(&got); err != nil || got != want {
			t.Errorf("identifier #%d: row count %d (%v), want %d", i, got, err, want)
		}
		ks, ok := b.eng.Inspect(key(id))
		if !ok || ks.Cells[0].Global != want {
			t.Errorf("identifier #%d: B's global %v, want %d", i, ks.Cells, want)
		}
	}
}

func TestNew_ErrorsNeverQuoteThePassword(t *testing.T) {
	eng := engine.New(engine.Config{Manual: true})
	defer eng.Close(bg)
	for i, dsn := range []string{
		"root:s3cretpw@tcp(127.0.0.1:1)/",                    // no database
		"root:s3cretpw@tcp(127.0.0.1:1)/db?tls=s3cretpw",     // echoes a value
		"root:s3cretpw@tcp(127.0.0.1:1/db",                   // malformed
		"root:s3cretpw@tcp(127.0.0.1:1)/db?timeout=s3cretpw", // echoes a value
	} {
		_, err := New(Config{DSN: dsn, Region: "a"}, eng, Options{})
		if err == nil {
			t.Fatalf("DSN %d accepted", i)
		}
		if strings.Contains(err.Error(), "s3cretpw") {
			t.Fatalf("error quotes the password: %v", err)
		}
	}
	p, err := New(Config{DSN: "root:s3cretpw@tcp(127.0.0.1:1)/db", Region: "a"}, eng, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if st := p.Stats(); strings.Contains(st.Database, "s3cretpw") || st.Database != "tcp(127.0.0.1:1)/db" {
		t.Fatalf("database shown as %q", st.Database)
	}
	p.Stop(bg)
}

func TestDriverLog_GoesToTheModuleLoggerWithoutThePassword(t *testing.T) {
	mysqltest.Require(t)
	srv := mysqltest.Start(t)
	// The server skips grant tables, so any password is accepted.
	dsn := strings.Replace(srv.NewDatabase(t), "root:@", "root:drv-s3cretpw@", 1)
	core, logs := observer.New(zap.DebugLevel)
	eng := engine.New(engine.Config{Manual: true})
	defer eng.Close(bg)
	p, err := New(Config{DSN: dsn, Region: "a", Timeout: 2 * time.Second}, eng, Options{Logger: zap.New(core)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop(bg)
	if err := p.MigrateOnce(bg); err != nil {
		t.Fatal(err)
	}
	// Kill the server under the pool's idle connection and bring it back:
	// the driver finds the connection dead and says so, through our logger.
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	p.FlushOnce(bg)
	found := false
	for _, e := range logs.All() {
		line := e.Message + fmt.Sprint(e.ContextMap())
		if strings.Contains(line, "drv-s3cretpw") {
			t.Fatalf("a log line quotes the password: %s", line)
		}
		if strings.HasPrefix(e.Message, "mysql driver: ") {
			found = true
		}
	}
	if !found {
		t.Fatalf("no driver line reached the logger; lines: %d", logs.Len())
	}
}

// TestClock_AServerIDRefusedOnceIsAskedForAgain: a statement asking for
// @@server_id that the server refused once (here a real refusal, of a
// variable it does not have; in service too many connections, a server
// shutting down, a proxy's error mid-failover) stopped the question for
// good, and with it every failover seen after (TestFailover_…). It is
// asked again at the first clock read after serverIDRetry.
func TestClock_AServerIDRefusedOnceIsAskedForAgain(t *testing.T) {
	s := newSetup(t)
	cfg := Config{DSN: s.dsn, Region: "a", Batch: 100, Timeout: 5 * time.Second}.WithDefaults()
	st, _, err := openStore(cfg, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	var want string
	if err := mysqltest.Open(t, s.dsn).QueryRow(`SELECT @@server_id`).Scan(&want); err != nil {
		t.Fatal(err)
	}

	asked := clockServerIDQuery
	clockServerIDQuery = `SELECT ` + dbNowMs + `, @@no_such_variable`
	_, err = st.Clock(bg)
	clockServerIDQuery = asked
	if err != nil {
		t.Fatalf("a clock read whose server_id was refused: %v, want the clock alone", err)
	}
	if got := st.Server(); got != "" {
		t.Fatalf("server %q after a refusal, want none known", got)
	}
	for i := range serverIDRetry + 1 {
		if _, err := st.Clock(bg); err != nil {
			t.Fatal(err)
		}
		if got := st.Server(); got != "" && i < serverIDRetry {
			t.Fatalf("server %q after %d reads: asked again within serverIDRetry", got, i+1)
		}
	}
	if got := st.Server(); got != want {
		t.Fatalf("server %q after %d clock reads since the refusal, want %q: never asked again", got, serverIDRetry+1, want)
	}
}

// TestMigrate_SaysTheSchemaIsReadyOnceAtInfo: every reload starts a new
// layer, which migrates again, and each said "mysql schema ready" at info
// (429 lines on one node of an audit's reload storm). Once per database
// and process at info; the layers after it at debug.
func TestMigrate_SaysTheSchemaIsReadyOnceAtInfo(t *testing.T) {
	mysqltest.Require(t)
	srv := mysqltest.Start(t)
	dsn := srv.NewDatabase(t)
	core, logs := observer.New(zap.DebugLevel)
	for range 3 {
		eng := engine.New(engine.Config{Manual: true})
		p, err := New(Config{DSN: dsn, Region: "a", Timeout: 2 * time.Second}, eng, Options{Logger: zap.New(core)})
		if err != nil {
			t.Fatal(err)
		}
		p.Start()
		deadline := time.Now().Add(20 * time.Second)
		for !p.Ready() && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond) // awaiting the migration's goroutine
		}
		p.Stop(bg)
		_ = eng.Close(bg)
		if !p.Ready() {
			t.Fatal("the schema never became ready")
		}
	}
	levels := map[zapcore.Level]int{}
	for _, e := range logs.FilterMessage("mysql schema ready").All() {
		levels[e.Level]++
	}
	if levels[zap.InfoLevel] != 1 || levels[zap.DebugLevel] != 2 {
		t.Fatalf("three layers of one database said the schema is ready %d times at info and %d at debug, want 1 and 2",
			levels[zap.InfoLevel], levels[zap.DebugLevel])
	}
}

// TestStore_AStatementIsOneRoundTrip: without interpolateParams in the
// DSN the driver prepared every statement with arguments and then ran
// it, two round trips each: across regions, with the database 100 ms
// away, every flush, pull and publish waited twice as long as it needed
// (an audit: 202 ms a statement through a link 100 ms slow, 101 with the
// arguments in the text; Com_stmt_prepare rose with Com_stmt_execute).
// The layer now sends the arguments in the statement's text.
func TestStore_AStatementIsOneRoundTrip(t *testing.T) {
	srv := mysqltest.Start(t) // its own server: nothing else prepares there
	s := &setup{t: t, dsn: srv.NewDatabase(t), clk: new(clock), limit: 10}
	s.clk.ms.Store(epoch + 10_000)
	a, b := s.region("a"), s.region("b")
	db := mysqltest.Open(t, s.dsn)
	status := func(name string) int64 {
		var n int64
		var v string
		if err := db.QueryRow(`SHOW GLOBAL STATUS LIKE '`+name+`'`).Scan(&v, &n); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		return n
	}
	prepared, questions := status("Com_stmt_prepare"), status("Questions")
	a.decide("k", 10, 12) // a first denial, a count past the floor
	a.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "cust", Limit: 500, Region: "a", Version: 2000})
	for range 3 {
		a.p.GlobalSyncOnce(bg)
		a.p.FlushOnce(bg)
		b.p.FlushOnce(bg)
	}
	if n := countRows(t, s.dsn, "ratelimit_overrides", "WHERE identifier = 'cust'"); n != 1 {
		t.Fatalf("%d rows of the override written, want 1: the flushes did not run", n)
	}
	if q := status("Questions") - questions; q < 10 {
		t.Fatalf("%d statements for six flushes", q)
	}
	if p := status("Com_stmt_prepare") - prepared; p != 0 {
		t.Fatalf("%d statements prepared: each is a round trip more", p)
	}
}
