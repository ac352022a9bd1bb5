package propagation

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/go-sql-driver/mysql"
)

// The schema. Portable across MySQL 8, MariaDB 10.6+ and Vitess:
//
//   - Column names avoid reserved words (window, limit).
//   - Byte columns are VARBINARY, compared byte for byte: case variants and
//     trailing spaces never merge two identifiers, and invalid UTF-8 is
//     stored as sent. Identifiers over 64 bytes arrive as their 65-byte
//     hash (engine.NormalizeIdentifier), HMACs as 32 hex digits.
//   - The unique key is the primary key (Vitess and PlanetScale want one,
//     and InnoDB clusters rows by it: a cell's rows sit together).
//   - expires_ms is indexed for the cleanup's bounded deletes.
//   - updated_ms is when a count of the row last rose (an override: when
//     a newer change replaced it; a published count: also when a newer
//     global reset came), on the database's clock, indexed for the pulls
//     that read what changed.
//   - reset_version and reset_base in a published count: the newest
//     global reset the region marked on the cell (its override's version)
//     and the region's count then, which other regions take off.
//   - ratelimit_overrides holds one row per zone and identifier: the
//     newest change (version) of its runtime override, removals included
//     until they lapse; a key's reset for every region is a row of its
//     own, whose namespace is the zone behind a mark byte (so 80 bytes).
//
// The statements are also in the README; keep them in step.
var schema = []string{
	`CREATE TABLE IF NOT EXISTS ratelimit_blocklist (
  namespace     VARBINARY(64)  NOT NULL,
  identifier    VARBINARY(128) NOT NULL,
  window_ms     BIGINT         NOT NULL,
  sequence      BIGINT         NOT NULL,
  origin_region VARBINARY(96)  NOT NULL,
  limit_units   BIGINT         NOT NULL,
  count_cur     BIGINT         NOT NULL,
  count_prev    BIGINT         NOT NULL,
  expires_ms    BIGINT         NOT NULL,
  updated_ms    BIGINT         NOT NULL DEFAULT 0,
  PRIMARY KEY (namespace, identifier, window_ms, sequence, origin_region),
  KEY ratelimit_blocklist_expires (expires_ms),
  KEY ratelimit_blocklist_updated (updated_ms)
) ENGINE=InnoDB`,
	`CREATE TABLE IF NOT EXISTS ratelimit_global_counts (
  namespace     VARBINARY(64)  NOT NULL,
  identifier    VARBINARY(128) NOT NULL,
  window_ms     BIGINT         NOT NULL,
  sequence      BIGINT         NOT NULL,
  region        VARBINARY(96)  NOT NULL,
  count         BIGINT         NOT NULL,
  reset_version BIGINT         NOT NULL DEFAULT 0,
  reset_base    BIGINT         NOT NULL DEFAULT 0,
  expires_ms    BIGINT         NOT NULL,
  updated_ms    BIGINT         NOT NULL DEFAULT 0,
  PRIMARY KEY (namespace, identifier, window_ms, sequence, region),
  KEY ratelimit_global_counts_expires (expires_ms),
  KEY ratelimit_global_counts_updated (updated_ms)
) ENGINE=InnoDB`,
	`CREATE TABLE IF NOT EXISTS ratelimit_overrides (
  namespace     VARBINARY(80)  NOT NULL,
  identifier    VARBINARY(128) NOT NULL,
  limit_units   BIGINT         NOT NULL,
  expires_ms    BIGINT         NOT NULL,
  reason        VARBINARY(512) NOT NULL,
  origin_region VARBINARY(96)  NOT NULL,
  version       BIGINT         NOT NULL,
  deleted       TINYINT        NOT NULL,
  updated_ms    BIGINT         NOT NULL DEFAULT 0,
  PRIMARY KEY (namespace, identifier),
  KEY ratelimit_overrides_expires (expires_ms),
  KEY ratelimit_overrides_updated (updated_ms)
) ENGINE=InnoDB`,
}

// upgrades bring tables made by earlier versions up to the schema: each
// runs when its column is missing, so a column an operator dropped is
// made again too (one statement a column: reset_base once came with
// reset_version, and a table that had one of them never got the other).
// Two nodes that both find it missing both run it; the second fails with
// a duplicate column or key, which means done.
var upgrades = []struct {
	table, column, stmt string
}{
	{"ratelimit_blocklist", "updated_ms", `ALTER TABLE ratelimit_blocklist
  ADD COLUMN updated_ms BIGINT NOT NULL DEFAULT 0,
  ADD KEY ratelimit_blocklist_updated (updated_ms)`},
	{"ratelimit_global_counts", "updated_ms", `ALTER TABLE ratelimit_global_counts
  ADD COLUMN updated_ms BIGINT NOT NULL DEFAULT 0,
  ADD KEY ratelimit_global_counts_updated (updated_ms)`},
	{"ratelimit_global_counts", "reset_version", `ALTER TABLE ratelimit_global_counts
  ADD COLUMN reset_version BIGINT NOT NULL DEFAULT 0`},
	{"ratelimit_global_counts", "reset_base", `ALTER TABLE ratelimit_global_counts
  ADD COLUMN reset_base BIGINT NOT NULL DEFAULT 0`},
}

// MySQL's errors for a column or key that already exists.
const (
	errDupColumn = 1060
	errDupKey    = 1061
)

// migrateSteps is how many statements a migration runs at most, for its
// timeout.
var migrateSteps = len(schema) + 2*len(upgrades) + 2*len(schemaKeys())

// schemaKey is a secondary key of the schema: its table, name and column.
type schemaKey struct{ table, name, column string }

// schemaKeys lists the schema's secondary keys, as its statements make
// them. The pulls name the updated_ms keys (FORCE INDEX): one dropped by
// hand failed every pull of its table ("Key … doesn't exist", MySQL's
// error 1176) until an operator made it again.
func schemaKeys() []schemaKey {
	var out []schemaKey
	for _, stmt := range schema {
		table := tableName.FindStringSubmatch(stmt)[1]
		for _, k := range keyName.FindAllStringSubmatch(stmt, -1) {
			out = append(out, schemaKey{table, k[1], k[2]})
		}
	}
	return out
}

// Migrate creates the tables if they are missing and upgrades older ones
// in place. It is idempotent and safe on every node at once.
func Migrate(ctx context.Context, db *sql.DB) error {
	for _, stmt := range schema {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("migrate: %w", err)
		}
	}
	for _, u := range upgrades {
		var n int
		err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM information_schema.columns
  WHERE table_schema = DATABASE() AND table_name = ? AND column_name = ?`, u.table, u.column).Scan(&n)
		if err != nil {
			return fmt.Errorf("migrate: look for %s.%s: %w", u.table, u.column, err)
		}
		if n > 0 {
			continue
		}
		if _, err := db.ExecContext(ctx, u.stmt); err != nil && !isDuplicate(err) {
			return fmt.Errorf("migrate: add %s.%s: %w", u.table, u.column, err)
		}
	}
	for _, k := range schemaKeys() {
		ok, err := hasKey(ctx, db, k)
		if err != nil {
			return fmt.Errorf("migrate: %w", err)
		}
		if ok {
			continue
		}
		stmt := "ALTER TABLE " + k.table + " ADD KEY " + k.name + " (" + k.column + ")"
		if _, err := db.ExecContext(ctx, stmt); err != nil && !isDuplicate(err) {
			return fmt.Errorf("migrate: add key %s of %s: %w", k.name, k.table, err)
		}
	}
	return nil
}

// hasKey reports whether the database has the key k.
func hasKey(ctx context.Context, db *sql.DB, k schemaKey) (bool, error) {
	var n int
	err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM information_schema.statistics
  WHERE table_schema = DATABASE() AND table_name = ? AND index_name = ?`, k.table, k.name).Scan(&n)
	if err != nil {
		return false, fmt.Errorf("look for key %s of %s: %w", k.name, k.table, err)
	}
	return n > 0, nil
}

// CheckSchema reports the first table or column of the schema the
// database lacks, or has of another type, for mysql_migrate off: the layer is not ready, and says
// why, until an operator has made the schema (SchemaSQL, the README).
func CheckSchema(ctx context.Context, db *sql.DB) error {
	for _, stmt := range schema {
		m := tableName.FindStringSubmatch(stmt)
		if m == nil {
			continue
		}
		table := m[1]
		rows, err := db.QueryContext(ctx, `SELECT column_name, data_type FROM information_schema.columns
  WHERE table_schema = DATABASE() AND table_name = ?`, table)
		if err != nil {
			return fmt.Errorf("schema check: look for %s: %w", table, err)
		}
		have := map[string]string{} // column → its type
		for rows.Next() {
			var c, typ string
			if err := rows.Scan(&c, &typ); err != nil {
				_ = rows.Close()
				return fmt.Errorf("schema check: look for %s: %w", table, err)
			}
			have[strings.ToLower(c)] = strings.ToLower(typ)
		}
		err = rows.Err()
		_ = rows.Close()
		if err != nil {
			return fmt.Errorf("schema check: look for %s: %w", table, err)
		}
		if len(have) == 0 {
			return fmt.Errorf("schema check: table %s is missing, and mysql_migrate is off: create the schema (the README's statements)", table)
		}
		// A byte column made as text is compared under its collation:
		// MySQL's and MariaDB's defaults ignore case and trailing spaces,
		// so "Key" and "key" would share a row, one identifier's count
		// landing on the other's.
		for _, c := range columnName.FindAllStringSubmatch(stmt, -1) {
			typ, ok := have[c[1]]
			if !ok {
				return fmt.Errorf("schema check: column %s.%s is missing, and mysql_migrate is off: make the schema as the README's statements do", table, c[1])
			}
			if want := strings.ToLower(c[2]); typ != want {
				return fmt.Errorf("schema check: column %s.%s is %s, want %s, and mysql_migrate is off: make the schema as the README's statements do (a text column's collation merges identifiers that differ in case or trailing spaces)", table, c[1], typ, want)
			}
		}
	}
	for _, k := range schemaKeys() {
		ok, err := hasKey(ctx, db, k)
		if err != nil {
			return fmt.Errorf("schema check: %w", err)
		}
		if !ok {
			return fmt.Errorf("schema check: key %s of %s is missing, and mysql_migrate is off: make the schema as the README's statements do", k.name, k.table)
		}
	}
	return nil
}

// tableName finds the table a CREATE TABLE statement makes, columnName
// each of its columns and its type, keyName each secondary key and its
// column.
var (
	tableName  = regexp.MustCompile(`CREATE TABLE IF NOT EXISTS (\w+)`)
	columnName = regexp.MustCompile(`(?m)^  (\w+) +(VARBINARY|BIGINT|TINYINT)`)
	keyName    = regexp.MustCompile(`(?m)^  KEY (\w+) \((\w+)\)`)
)

// isDuplicate reports a column or key that another node added first.
func isDuplicate(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && (me.Number == errDupColumn || me.Number == errDupKey)
}

// SchemaSQL returns the schema's statements, for documentation and tools.
func SchemaSQL() []string { return append([]string(nil), schema...) }

// UpgradeSQL returns the statements that bring tables of earlier versions
// up to the schema, for operators who manage it (mysql_migrate off).
func UpgradeSQL() []string {
	out := make([]string, len(upgrades))
	for i, u := range upgrades {
		out[i] = u.stmt
	}
	return out
}
