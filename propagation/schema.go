package propagation

import (
	"context"
	"database/sql"
	"fmt"
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
  PRIMARY KEY (namespace, identifier, window_ms, sequence, origin_region),
  KEY ratelimit_blocklist_expires (expires_ms)
) ENGINE=InnoDB`,
	`CREATE TABLE IF NOT EXISTS ratelimit_global_counts (
  namespace  VARBINARY(64)  NOT NULL,
  identifier VARBINARY(128) NOT NULL,
  window_ms  BIGINT         NOT NULL,
  sequence   BIGINT         NOT NULL,
  region     VARBINARY(96)  NOT NULL,
  count      BIGINT         NOT NULL,
  expires_ms BIGINT         NOT NULL,
  PRIMARY KEY (namespace, identifier, window_ms, sequence, region),
  KEY ratelimit_global_counts_expires (expires_ms)
) ENGINE=InnoDB`,
}

// Migrate creates the tables if they are missing. It is idempotent and
// safe on every node at once (CREATE TABLE IF NOT EXISTS).
func Migrate(ctx context.Context, db *sql.DB) error {
	for _, stmt := range schema {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("migrate: %w", err)
		}
	}
	return nil
}

// SchemaSQL returns the schema's statements, for documentation and tools.
func SchemaSQL() []string { return append([]string(nil), schema...) }
