package propagation

import (
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

// TestSchema_READMEShowsTheStatements: operators with mysql_migrate off
// apply the README's statements, so each of the schema's and the
// upgrade's statements stands there as the migration runs it.
func TestSchema_READMEShowsTheStatements(t *testing.T) {
	b, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	for _, stmt := range append(SchemaSQL(), UpgradeSQL()...) {
		if !strings.Contains(readme, stmt+";") {
			first, _, _ := strings.Cut(stmt, "\n")
			t.Errorf("README lacks the statement beginning %q (as the migration runs it, with a semicolon)", first)
		}
	}
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
		"ratelimit_global_counts.reset_version:bigint", "ratelimit_global_counts.reset_base:bigint",
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

// TestMigrate_OffChecksTheSchema: with mysql_migrate off the layer makes
// no table, and is not ready while one is missing, saying which: it was
// ready at once, and every statement then failed on the missing tables.
// So too for a column, and for a key the pulls name.
func TestMigrate_OffChecksTheSchema(t *testing.T) {
	s := newSetup(t)
	p := noMigrate(t, s.dsn)
	err := p.MigrateOnce(bg)
	if err == nil || !strings.Contains(err.Error(), "table ratelimit_blocklist is missing, and mysql_migrate is off") {
		t.Fatalf("with no tables and mysql_migrate off: %v", err)
	}
	if p.Stats().Ready {
		t.Fatal("ready with no tables")
	}
	db := mysqltest.Open(t, s.dsn)
	if n := countRows(t, s.dsn, "information_schema.tables", "WHERE table_schema = DATABASE()"); n != 0 {
		t.Fatalf("mysql_migrate off made %d tables", n)
	}
	if err := Migrate(bg, db); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`ALTER TABLE ratelimit_overrides DROP COLUMN updated_ms`); err != nil {
		t.Fatal(err)
	}
	if err := p.MigrateOnce(bg); err == nil || !strings.Contains(err.Error(), "column ratelimit_overrides.updated_ms is missing") {
		t.Fatalf("with a column missing: %v", err)
	}
	if _, err := db.Exec(`ALTER TABLE ratelimit_overrides ADD COLUMN updated_ms BIGINT NOT NULL DEFAULT 0`); err != nil {
		t.Fatal(err)
	}
	// The column is back, its key (which the pulls name) not yet: every
	// pull of the table would fail.
	if err := p.MigrateOnce(bg); err == nil || !strings.Contains(err.Error(), "key ratelimit_overrides_updated of ratelimit_overrides is missing") {
		t.Fatalf("with a key missing: %v", err)
	}
	if _, err := db.Exec(`ALTER TABLE ratelimit_overrides ADD KEY ratelimit_overrides_updated (updated_ms)`); err != nil {
		t.Fatal(err)
	}
	if err := p.MigrateOnce(bg); err != nil || !p.Stats().Ready {
		t.Fatalf("with the schema whole: %v, ready %v", err, p.Stats().Ready)
	}
}

// TestSchema_IdentifiersThatACollationWouldMergeStayApart: MariaDB's and
// MySQL's default collations compare case-insensitively and (PAD SPACE)
// ignore trailing spaces, so in a text column "Key" and "key", or "x" and
// "x ", would be one primary key, and one region's count would land on the
// other's row. The byte columns keep every such pair apart: each of two
// regions publishes one of each pair, and a third imports all eight
// counts, each under its own identifier.
func TestSchema_IdentifiersThatACollationWouldMergeStayApart(t *testing.T) {
	s := newSetup(t)
	a, b, c := s.region("a"), s.region("b"), s.region("c")
	pairs := [][2]string{{"Key", "key"}, {"x", "x "}, {"y", "y\x00"}, {"\xc3\xa9", "e"}, {"\xff", "\xfe"}}
	for i, pair := range pairs {
		n := int64(30 + 5*i) // a count of its own per pair
		if got := a.decide(pair[0], 100, int(n)); int64(got) != n {
			t.Fatalf("a admitted %d of %d for %q", got, n, pair[0])
		}
		if got := b.decide(pair[1], 100, int(n+1)); int64(got) != n+1 {
			t.Fatalf("b admitted %d of %d for %q", got, n+1, pair[1])
		}
	}
	for _, r := range []*region{a, b} {
		r.p.GlobalSyncOnce(bg)
		r.p.FlushOnce(bg)
	}
	if n := countRows(t, s.dsn, "ratelimit_global_counts", ""); n != 2*len(pairs) {
		t.Fatalf("%d published rows, want %d: identifiers merged in the key", n, 2*len(pairs))
	}
	c.p.FlushOnce(bg)
	for i, pair := range pairs {
		n := int64(30 + 5*i)
		for j, id := range pair {
			if got := c.cell(t, id, seq0).Global; got != n+int64(j) {
				t.Errorf("c's import of %q = %d, want %d", id, got, n+int64(j))
			}
		}
	}
}

// TestMigrate_OffRejectsTextColumns: with mysql_migrate off the operator
// makes the schema; a byte column made as text (VARCHAR, whose default
// collation ignores case and trailing spaces) merged "Key" and "key" into
// one row, one region's count landing on another identifier's. The check
// found the columns by name only, and the layer ran on such a table; it
// now wants each column of the type the README's statements give it.
func TestMigrate_OffRejectsTextColumns(t *testing.T) {
	s := newSetup(t)
	db := mysqltest.Open(t, s.dsn)
	if err := Migrate(bg, db); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`ALTER TABLE ratelimit_global_counts MODIFY identifier VARCHAR(128) NOT NULL`); err != nil {
		t.Fatal(err)
	}
	p := noMigrate(t, s.dsn)
	err := p.MigrateOnce(bg)
	if err == nil || !strings.Contains(err.Error(), "column ratelimit_global_counts.identifier is varchar, want varbinary") {
		t.Fatalf("with a text identifier column and mysql_migrate off: %v (ready %v)", err, p.Stats().Ready)
	}
	if _, err := db.Exec(`ALTER TABLE ratelimit_global_counts MODIFY identifier VARBINARY(128) NOT NULL`); err != nil {
		t.Fatal(err)
	}
	if err := p.MigrateOnce(bg); err != nil || !p.Stats().Ready {
		t.Fatalf("with the schema as the README makes it: %v, ready %v", err, p.Stats().Ready)
	}
}

// noMigrate is a propagator of region a on dsn with mysql_migrate off,
// stopped (and its engine closed) when the test ends.
func noMigrate(t *testing.T, dsn string) *Propagator {
	t.Helper()
	eng := engine.New(engine.Config{Manual: true})
	t.Cleanup(func() { _ = eng.Close(bg) })
	p, err := New(Config{DSN: dsn, Region: "a", Batch: 100, Timeout: 5 * time.Second, NoMigrate: true}, eng, Options{Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Stop(bg) })
	return p
}
