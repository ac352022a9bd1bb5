package propagation

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

// One mariadbd for the whole test binary; every test has its own database.
var shared mysqltest.Shared

func TestMain(m *testing.M) { os.Exit(mysqltest.Main(m, &shared)) }

var bg = context.Background()

// clock is a fake clock shared by a test's engines and propagators.
type clock struct{ ms atomic.Int64 }

func (c *clock) Now() time.Time      { return time.UnixMilli(c.ms.Load()) }
func (c *clock) Add(d time.Duration) { c.ms.Add(d.Milliseconds()) }

// epoch is aligned to every window the tests use.
const epoch = int64(1_700_000_000) / 3600 * 3600 * 1000

const window = time.Minute

var seq0 = epoch / window.Milliseconds()

// region is one region's node: an engine and its propagator.
type region struct {
	eng *engine.Engine
	p   *Propagator
}

type setup struct {
	t     *testing.T
	dsn   string
	clk   *clock
	limit int64
}

func newSetup(t *testing.T) *setup {
	t.Helper()
	srv := shared.Get(t)
	s := &setup{t: t, dsn: srv.NewDatabase(t), clk: new(clock), limit: 10}
	s.clk.ms.Store(epoch + 10_000)
	return s
}

// region starts a region's node on the test's database; mod adjusts the
// config.
func (s *setup) region(name string, mod ...func(*Config)) *region {
	s.t.Helper()
	return s.regionOn(s.clk, name, mod...)
}

// regionOn is region on a clock of its own.
func (s *setup) regionOn(clk *clock, name string, mod ...func(*Config)) *region {
	s.t.Helper()
	eng := engine.New(engine.Config{Now: clk.Now, Manual: true})
	eng.Zone("z", window)
	cfg := Config{
		DSN: s.dsn, Region: name, Batch: 100, Timeout: 5 * time.Second,
	}
	for _, m := range mod {
		m(&cfg)
	}
	p, err := New(cfg, eng, Options{Now: clk.Now, Logger: zap.NewNop()})
	if err != nil {
		s.t.Fatal(err)
	}
	if err := p.MigrateOnce(bg); err != nil {
		s.t.Fatal(err)
	}
	eng.SetGlobal(p)
	s.t.Cleanup(func() {
		p.Stop(bg)
		_ = eng.Close(bg)
	})
	return &region{eng: eng, p: p}
}

func (r *region) decide(id string, limit int64, n int) (admitted int) {
	for i := 0; i < n; i++ {
		if r.eng.Decide(bg, engine.Limit{Key: key(id), Limit: limit, Cost: 1}).Allowed {
			admitted++
		}
	}
	return admitted
}

func key(id string) engine.Key { return engine.Key{Namespace: "z", Identifier: id, Window: window} }

func (r *region) cell(t *testing.T, id string, seq int64) engine.CellState {
	t.Helper()
	ks, ok := r.eng.Inspect(key(id))
	if !ok {
		t.Fatalf("no entry for %q", id)
	}
	for _, c := range ks.Cells {
		if c.Sequence == seq {
			return c
		}
	}
	t.Fatalf("no cell %d for %q: %+v", seq, id, ks.Cells)
	return engine.CellState{}
}

func countRows(t *testing.T, dsn, table, where string, args ...any) int {
	t.Helper()
	db := mysqltest.Open(t, dsn)
	var n int
	if err := db.QueryRow("SELECT COUNT(*) FROM "+table+" "+where, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestMigrate_IdempotentAndBinaryColumns(t *testing.T) {
	s := newSetup(t)
	a := s.region("a")
	if err := a.p.MigrateOnce(bg); err != nil {
		t.Fatalf("second migration: %v", err)
	}
	db := mysqltest.Open(t, s.dsn)
	rows, err := db.Query(`SELECT table_name, column_name, data_type FROM information_schema.columns
		WHERE table_schema = DATABASE() ORDER BY table_name, ordinal_position`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var got []string
	for rows.Next() {
		var tbl, col, typ string
		if err := rows.Scan(&tbl, &col, &typ); err != nil {
			t.Fatal(err)
		}
		got = append(got, tbl+"."+col+":"+typ)
	}
	want := []string{
		"ratelimit_blocklist.namespace:varbinary", "ratelimit_blocklist.identifier:varbinary",
		"ratelimit_blocklist.window_ms:bigint", "ratelimit_blocklist.sequence:bigint",
		"ratelimit_blocklist.origin_region:varbinary", "ratelimit_blocklist.limit_units:bigint",
		"ratelimit_blocklist.count_cur:bigint", "ratelimit_blocklist.count_prev:bigint",
		"ratelimit_blocklist.expires_ms:bigint", "ratelimit_blocklist.updated_ms:bigint",
		"ratelimit_global_counts.namespace:varbinary", "ratelimit_global_counts.identifier:varbinary",
		"ratelimit_global_counts.window_ms:bigint", "ratelimit_global_counts.sequence:bigint",
		"ratelimit_global_counts.region:varbinary", "ratelimit_global_counts.count:bigint",
		"ratelimit_global_counts.expires_ms:bigint", "ratelimit_global_counts.updated_ms:bigint",
		"ratelimit_overrides.namespace:varbinary", "ratelimit_overrides.identifier:varbinary",
		"ratelimit_overrides.limit_units:bigint", "ratelimit_overrides.expires_ms:bigint",
		"ratelimit_overrides.reason:varbinary", "ratelimit_overrides.origin_region:varbinary",
		"ratelimit_overrides.version:bigint", "ratelimit_overrides.deleted:tinyint",
		"ratelimit_overrides.updated_ms:bigint",
	}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("columns\n got %v\nwant %v", got, want)
	}
}

func TestDenialGossip_BurstAtADeniedAtB(t *testing.T) {
	s := newSetup(t)
	a, b := s.region("a"), s.region("b")
	if n := a.decide("burst", 10, 15); n != 10 {
		t.Fatalf("A admitted %d of 15, want 10", n)
	}
	a.p.FlushOnce(bg)
	if st := a.p.Stats(); st.DenialsEmitted != 1 {
		t.Fatalf("A emitted %d denial rows, want 1", st.DenialsEmitted)
	}
	var cur, prev, lim, exp int64
	var origin []byte
	db := mysqltest.Open(t, s.dsn)
	err := db.QueryRow(`SELECT count_cur, count_prev, limit_units, expires_ms, origin_region FROM ratelimit_blocklist
		WHERE namespace = ? AND identifier = ? AND window_ms = ? AND sequence = ?`,
		[]byte("z"), []byte("burst"), window.Milliseconds(), seq0).Scan(&cur, &prev, &lim, &exp, &origin)
	if err != nil {
		t.Fatal(err)
	}
	if cur != 10 || prev != 0 || lim != 10 || exp != (seq0+2)*window.Milliseconds() || string(origin) != "a" {
		t.Fatalf("row: cur %d prev %d limit %d expires %d region %q", cur, prev, lim, exp, origin)
	}
	b.p.FlushOnce(bg)
	if n := b.decide("burst", 10, 1); n != 0 {
		t.Fatal("B admitted the key A denied, after reading A's denial row")
	}
	if c := b.cell(t, "burst", seq0); c.Global != 10 || c.Regional != 0 {
		t.Fatalf("B's cell = %+v, want the 10 of region a as global", c)
	}
	// B denied on imported counts only: below half the limit regionally,
	// so no row of B's echoes A's.
	b.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_blocklist", ""); n != 1 {
		t.Fatalf("%d blocklist rows, want A's one (no echo from B)", n)
	}
	// A's count reached B through both tables in one flush; whichever B
	// read first raised the import, the other was no news.
	if st := b.p.Stats(); st.DenialsEmitted != 0 || st.DenialsFiltered != 1 || st.DenialsApplied+st.CountsApplied != 1 {
		t.Fatalf("B stats: %+v", st)
	}
}

func TestDenialGossip_OneRowPerRegionAndCell(t *testing.T) {
	s := newSetup(t)
	// Two nodes of region a (say, sharing a Redis): each denies the cell
	// once; the table holds one row for (a, cell) with the larger counts.
	a1, a2 := s.region("a"), s.region("a")
	a1.decide("k", 10, 12)
	a2.decide("k", 10, 11)
	a1.p.FlushOnce(bg)
	a2.p.FlushOnce(bg)
	a1.decide("k", 10, 5) // more denials: no new first denial
	a1.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_blocklist", ""); n != 1 {
		t.Fatalf("%d rows for one (region, cell), want 1", n)
	}
	if st := a1.p.Stats(); st.DenialsEmitted != 1 {
		t.Fatalf("node emitted %d rows for one cell, want 1", st.DenialsEmitted)
	}
}

func TestDenialGossip_FilterHalfLimitAndMinWindow(t *testing.T) {
	s := newSetup(t)
	a := s.region("a")
	// One oversized request on a fresh key: denied, not broadcast.
	a.eng.Decide(bg, engine.Limit{Key: key("big"), Limit: 10, Cost: 11})
	// A short window stays regional.
	short := engine.Key{Namespace: "z", Identifier: "short", Window: time.Second}
	for i := 0; i < 12; i++ {
		a.eng.Decide(bg, engine.Limit{Key: short, Limit: 10, Cost: 1})
	}
	a.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_blocklist", ""); n != 0 {
		t.Fatalf("%d rows written; want none", n)
	}
}

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

func TestImport_LargerOfTwoTablesPerRegion(t *testing.T) {
	s := newSetup(t)
	s.limit = 20
	a, b := s.region("a"), s.region("b")
	a.decide("k", 20, 12) // published at 60 %
	a.p.FlushOnce(bg)
	a.decide("k", 20, 10) // denied at 20 after 8 more: a row with 20
	a.p.FlushOnce(bg)
	b.p.GlobalSyncOnce(bg)
	b.p.BlocklistSyncOnce(bg)
	b.p.FlushOnce(bg)
	if c := b.cell(t, "k", seq0); c.Global != 20 {
		t.Fatalf("B's global = %d, want 20: region a's units counted once (the larger row)", c.Global)
	}
	if got := b.p.ForeignCounts(key("k"), seq0); len(got) != 1 || got["a"] != 20 {
		t.Fatalf("foreign counts = %v", got)
	}
}

func TestImport_OwnRegionRaisesRegionalOnly(t *testing.T) {
	s := newSetup(t)
	s.limit = 100
	a1, a2 := s.region("a"), s.region("a")
	a1.decide("k", 100, 60)
	a1.p.FlushOnce(bg)
	a2.decide("k", 100, 1)
	a2.p.FlushOnce(bg)
	if c := a2.cell(t, "k", seq0); c.Regional != 60 || c.Global != 0 {
		t.Fatalf("a2's cell = %+v, want regional raised to 60 and no global", c)
	}
}

func TestImport_PreviousCellFromDenialRow(t *testing.T) {
	s := newSetup(t)
	a, b := s.region("a"), s.region("b")
	a.decide("k", 10, 8)
	s.clk.Add(window) // next window: 8 weigh as the previous cell
	a.decide("k", 10, 10)
	a.p.FlushOnce(bg)
	b.p.FlushOnce(bg)
	if c := b.cell(t, "k", seq0); c.Global != 8 {
		t.Fatalf("B's previous cell global = %d, want count_prev 8", c.Global)
	}
	if c := b.cell(t, "k", seq0+1); c.Global == 0 {
		t.Fatal("B's current cell got nothing from count_cur")
	}
}

// hmacOf stands in for identifier_secret's HMAC.
func hmacOf(id string) string {
	sum := sha256.Sum256([]byte("secret:" + id))
	return hex.EncodeToString(sum[:16])
}

func TestIdentifierSecret_BurstAtADeniedAtB(t *testing.T) {
	s := newSetup(t)
	mapped := func(c *Config) { c.MapID = hmacOf }
	a, b := s.region("a", mapped), s.region("b", mapped)
	a.decide("api-key-1", 10, 12)
	a.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_blocklist", "WHERE identifier = ?", []byte(hmacOf("api-key-1"))); n != 1 {
		t.Fatal("the row does not hold the identifier's HMAC")
	}
	if n := countRows(t, s.dsn, "ratelimit_blocklist", "WHERE identifier = ?", []byte("api-key-1")); n != 0 {
		t.Fatal("a row holds the raw identifier")
	}
	// B has never seen the key: the import waits for its entry.
	b.p.FlushOnce(bg)
	if b.eng.HasEntry(key("api-key-1")) {
		t.Fatal("B made an entry from an HMAC it cannot invert")
	}
	if n := b.decide("api-key-1", 10, 1); n != 0 {
		t.Fatal("B's first request for the key passed; the waiting import was not applied at entry creation")
	}
	// A key B already holds is found through the index.
	b.decide("api-key-2", 10, 1)
	a.decide("api-key-2", 10, 12)
	a.p.FlushOnce(bg)
	b.p.FlushOnce(bg)
	if c := b.cell(t, "api-key-2", seq0); c.Global != 10 {
		t.Fatalf("B's indexed cell global = %d, want 10", c.Global)
	}
}

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

func TestCleanup_DeletesExpiredRowsOnly(t *testing.T) {
	s := newSetup(t)
	a := s.region("a")
	db := mysqltest.Open(t, s.dsn)
	now := s.clk.Now().UnixMilli()
	for i, exp := range []int64{now - 1, now, now + 1, now + 60_000} {
		if _, err := db.Exec(`INSERT INTO ratelimit_global_counts (namespace, identifier, window_ms, sequence, region, count, expires_ms)
			VALUES (?, ?, 60000, 1, 'x', 5, ?)`,
			[]byte("z"), []byte{byte('a' + i)}, exp); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec(`INSERT INTO ratelimit_blocklist (namespace, identifier, window_ms, sequence, origin_region, limit_units, count_cur, count_prev, expires_ms)
			VALUES (?, ?, 60000, 1, 'x', 10, 5, 0, ?)`,
			[]byte("z"), []byte{byte('a' + i)}, exp); err != nil {
			t.Fatal(err)
		}
	}
	if n := a.p.CleanupOnce(bg); n != 4 {
		t.Fatalf("deleted %d rows, want 4 (two expired per table)", n)
	}
	for _, tbl := range []string{"ratelimit_global_counts", "ratelimit_blocklist"} {
		if n := countRows(t, s.dsn, tbl, "WHERE expires_ms > ?", now); n != 2 {
			t.Fatalf("%s: %d live rows left, want 2", tbl, n)
		}
		if n := countRows(t, s.dsn, tbl, ""); n != 2 {
			t.Fatalf("%s: %d rows left, want the 2 live ones", tbl, n)
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

func TestOutage_StartsDownMigratesLaterAndRetriesDenials(t *testing.T) {
	mysqltest.Require(t)
	srv := mysqltest.Start(t)
	dsn := srv.NewDatabase(t)
	srv.Stop()

	clk := new(clock)
	clk.ms.Store(time.Now().UnixMilli())
	eng := engine.New(engine.Config{Now: clk.Now, Manual: true})
	defer eng.Close(bg)
	p, err := New(Config{
		DSN: dsn, Region: "a", Timeout: 200 * time.Millisecond,
		Flush: time.Hour, GlobalSync: time.Hour, BlocklistSync: time.Hour,
	}, eng, Options{Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	eng.SetGlobal(p)
	p.Start() // MySQL is down: Start must not fail or block
	defer p.Stop(bg)
	if p.Ready() {
		t.Fatal("ready with MySQL down")
	}
	for i := 0; i < 12; i++ {
		eng.Decide(bg, engine.Limit{Key: key("k"), Limit: 10, Cost: 1})
	}
	p.ready.Store(true) // force a write attempt while down
	p.FlushOnce(bg)
	if st := p.Stats(); st.DroppedBatches == 0 || st.PendingDenials != 1 {
		t.Fatalf("stats while down: %+v", st)
	}
	p.ready.Store(false)
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for !p.Ready() {
		if time.Now().After(deadline) {
			t.Fatal("schema not migrated within 30 s of MySQL coming back")
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The breaker may be open from the failures: wait it out with writes.
	for p.Stats().DenialsEmitted == 0 {
		if time.Now().After(deadline.Add(30 * time.Second)) {
			t.Fatalf("denial row not retried after recovery: %+v", p.Stats())
		}
		p.FlushOnce(bg)
		time.Sleep(50 * time.Millisecond)
	}
	if n := countRows(t, dsn, "ratelimit_blocklist", ""); n != 1 {
		t.Fatalf("%d rows after the retry, want 1", n)
	}
}

func TestOutage_DenialDroppedAtExpiry(t *testing.T) {
	s := newSetup(t)
	eng := engine.New(engine.Config{Now: s.clk.Now, Manual: true})
	defer eng.Close(bg)
	// A port nothing listens on: every write fails fast.
	p, err := New(Config{DSN: "root:@tcp(127.0.0.1:1)/db", Region: "a", Timeout: 100 * time.Millisecond}, eng, Options{Now: s.clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop(bg)
	eng.SetGlobal(p)
	p.ready.Store(true)
	for i := 0; i < 11; i++ {
		eng.Decide(bg, engine.Limit{Key: key("k"), Limit: 10, Cost: 1})
	}
	p.FlushOnce(bg)
	if st := p.Stats(); st.PendingDenials != 1 || st.DroppedBatches < 1 {
		t.Fatalf("after a failed write: %+v", st)
	}
	// Published counts were not marked: they are due again.
	eng.ScanCells(window, func(v *engine.CellView) bool {
		if v.Published != 0 {
			t.Errorf("published mark advanced to %d without a successful write", v.Published)
		}
		return true
	})
	s.clk.Add(2 * window)
	p.FlushOnce(bg)
	if st := p.Stats(); st.PendingDenials != 0 || st.DenialsExpired != 1 {
		t.Fatalf("after expiry: %+v", st)
	}
}

func TestJitter_WithinTwentyPercent(t *testing.T) {
	lo, hi := time.Hour, time.Duration(0)
	for i := 0; i < 10_000; i++ {
		d := jitter(time.Second)
		lo, hi = min(lo, d), max(hi, d)
	}
	if lo < 800*time.Millisecond || hi > 1200*time.Millisecond {
		t.Fatalf("jitter spread [%s, %s], want within ±20 %%", lo, hi)
	}
	if lo > 850*time.Millisecond || hi < 1150*time.Millisecond {
		t.Fatalf("jitter spread [%s, %s] uses too little of ±20 %%", lo, hi)
	}
}

func TestPull_PeriodicReadsEveryPage(t *testing.T) {
	s := newSetup(t)
	b := s.region("b")
	db := mysqltest.Open(t, s.dsn)
	const n = 2*pageSize + 17
	exp := (seq0 + 2) * window.Milliseconds()
	for start := 0; start < n; start += 500 {
		var q strings.Builder
		var args []any
		q.WriteString(`INSERT INTO ratelimit_global_counts (namespace, identifier, window_ms, sequence, region, count, expires_ms) VALUES `)
		for i := start; i < min(n, start+500); i++ {
			if i > start {
				q.WriteString(",")
			}
			q.WriteString("(?, ?, ?, ?, 'a', 3, ?)")
			args = append(args, []byte("z"), []byte(fmt.Sprintf("id-%05d", i)), window.Milliseconds(), seq0, exp)
		}
		if _, err := db.Exec(q.String(), args...); err != nil {
			t.Fatal(err)
		}
	}
	b.p.FlushOnce(bg) // a process's first pull reads the table whole
	if st := b.p.Stats(); st.CountsApplied != n || st.Imports != n {
		t.Fatalf("applied %d rows into %d cells, want %d: a page was skipped", st.CountsApplied, st.Imports, n)
	}
	if c := b.cell(t, fmt.Sprintf("id-%05d", n-1), seq0); c.Global != 3 {
		t.Fatalf("last row's cell = %+v", c)
	}
}

func TestPull_PressureTargetsTheBusiestCellsEveryFlush(t *testing.T) {
	s := newSetup(t)
	s.limit = 100
	a, b := s.region("a"), s.region("b")
	a.decide("hot", 100, 40)
	a.p.GlobalSyncOnce(bg)
	a.p.FlushOnce(bg) // published at 40 % on the full push
	b.decide("hot", 100, 55)
	// No periodic sync on B: its flush alone pulls the key it is pressed on.
	b.p.FlushOnce(bg)
	if c := b.cell(t, "hot", seq0); c.Global != 40 {
		t.Fatalf("B's global = %d after its flush, want A's 40 from the targeted pull", c.Global)
	}
	if st := b.p.Stats(); st.LastPull.IsZero() {
		t.Fatal("targeted pull not recorded")
	}
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

// TestImport_ForAWindowAheadIsAppliedWhenItBeginsHere: region a's clock
// runs a little ahead, into the next window, and publishes a count there.
// Region b pulls it before that window begins on b's clock. The engine
// holds no cell ahead of its clock and dropped the import, which the layer
// had already recorded: no later pull brought it back, and b never
// weighed a's units. The import waits until the window begins here.
func TestImport_ForAWindowAheadIsAppliedWhenItBeginsHere(t *testing.T) {
	s := newSetup(t)
	ahead := new(clock)
	ahead.ms.Store(s.clk.ms.Load() + window.Milliseconds()) // the next window
	a, b := s.regionOn(ahead, "a"), s.region("b")
	if n := a.decide("early", 100, 60); n != 60 {
		t.Fatalf("a admitted %d of 60", n)
	}
	a.p.FlushOnce(bg)
	b.decide("early", 100, 1) // b holds the key, in its current window
	b.p.FlushOnce(bg)
	if c := b.cell(t, "early", seq0); c.Global != 0 {
		t.Fatalf("b imported a's count of the next window into its current one: %+v", c)
	}
	s.clk.ms.Add(window.Milliseconds()) // the window begins at b
	b.p.FlushOnce(bg)
	if c := b.cell(t, "early", seq0+1); c.Global != 60 {
		t.Fatalf("b's cell of the window a counted in = %+v, want a's 60 as global", c)
	}
}
