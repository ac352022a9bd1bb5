package propagation

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
)

// BlocklistRow is one row of ratelimit_blocklist: a region's counts of a
// cell and of the cell before it, at the cell's first denial there.
type BlocklistRow struct {
	Namespace  string `json:"namespace"`
	Identifier string `json:"identifier"`
	WindowMs   int64  `json:"window_ms"`
	Sequence   int64  `json:"sequence"`
	Region     string `json:"origin_region"`
	Limit      int64  `json:"limit_units"`
	CountCur   int64  `json:"count_cur"`
	CountPrev  int64  `json:"count_prev"`
	ExpiresMs  int64  `json:"expires_ms"`
}

// CountRow is one row of ratelimit_global_counts: a region's count of a
// cell.
type CountRow struct {
	Namespace  string
	Identifier string
	WindowMs   int64
	Sequence   int64
	Region     string
	Count      int64
	ExpiresMs  int64
}

// expiresMs is when a cell's rows stop mattering: the end of the window
// after the cell's, where the cell last weighs as the previous one.
func expiresMs(seq, w int64) int64 { return (seq + 2) * w }

func compareBlock(a, b *BlocklistRow) int {
	return cmp.Or(strings.Compare(a.Namespace, b.Namespace), strings.Compare(a.Identifier, b.Identifier),
		cmp.Compare(a.WindowMs, b.WindowMs), cmp.Compare(a.Sequence, b.Sequence), strings.Compare(a.Region, b.Region))
}

func compareCount(a, b *CountRow) int {
	return cmp.Or(strings.Compare(a.Namespace, b.Namespace), strings.Compare(a.Identifier, b.Identifier),
		cmp.Compare(a.WindowMs, b.WindowMs), cmp.Compare(a.Sequence, b.Sequence), strings.Compare(a.Region, b.Region))
}

// placeholders returns "(?,…,?),(?,…,?)…": n groups of k.
func placeholders(n, k int) string {
	group := "(" + strings.TrimSuffix(strings.Repeat("?,", k), ",") + ")"
	return strings.TrimSuffix(strings.Repeat(group+",", n), ",")
}

// upsertBlocklist writes rows, sorted in unique-key order (concurrent bulk
// upserts from many nodes that lock keys in different orders deadlock).
// Counts only grow: a late or repeated write never lowers a row.
func upsertBlocklist(ctx context.Context, db *sql.DB, rows []*BlocklistRow) error {
	if len(rows) == 0 {
		return nil
	}
	slices.SortFunc(rows, compareBlock)
	args := make([]any, 0, len(rows)*9)
	for _, r := range rows {
		args = append(args, []byte(r.Namespace), []byte(r.Identifier), r.WindowMs, r.Sequence, []byte(r.Region),
			r.Limit, r.CountCur, r.CountPrev, r.ExpiresMs)
	}
	q := `INSERT INTO ratelimit_blocklist
  (namespace, identifier, window_ms, sequence, origin_region, limit_units, count_cur, count_prev, expires_ms)
VALUES ` + placeholders(len(rows), 9) + `
ON DUPLICATE KEY UPDATE
  limit_units = VALUES(limit_units),
  count_cur = GREATEST(count_cur, VALUES(count_cur)),
  count_prev = GREATEST(count_prev, VALUES(count_prev)),
  expires_ms = GREATEST(expires_ms, VALUES(expires_ms))`
	if _, err := db.ExecContext(ctx, q, args...); err != nil {
		return fmt.Errorf("upsert %d blocklist rows: %w", len(rows), err)
	}
	return nil
}

// upsertCounts writes published counts, sorted like upsertBlocklist, with
// count = GREATEST(count, new): every node of a region writes the
// region's count, and the largest (latest) wins.
func upsertCounts(ctx context.Context, db *sql.DB, rows []*CountRow) error {
	if len(rows) == 0 {
		return nil
	}
	slices.SortFunc(rows, compareCount)
	args := make([]any, 0, len(rows)*7)
	for _, r := range rows {
		args = append(args, []byte(r.Namespace), []byte(r.Identifier), r.WindowMs, r.Sequence, []byte(r.Region),
			r.Count, r.ExpiresMs)
	}
	q := `INSERT INTO ratelimit_global_counts
  (namespace, identifier, window_ms, sequence, region, count, expires_ms)
VALUES ` + placeholders(len(rows), 7) + `
ON DUPLICATE KEY UPDATE
  count = GREATEST(count, VALUES(count)),
  expires_ms = GREATEST(expires_ms, VALUES(expires_ms))`
	if _, err := db.ExecContext(ctx, q, args...); err != nil {
		return fmt.Errorf("upsert %d count rows: %w", len(rows), err)
	}
	return nil
}

const (
	blocklistColumns = `namespace, identifier, window_ms, sequence, origin_region, limit_units, count_cur, count_prev, expires_ms`
	countColumns     = `namespace, identifier, window_ms, sequence, region, count, expires_ms`
)

func scanBlocklist(rs *sql.Rows) ([]BlocklistRow, error) {
	defer rs.Close()
	var out []BlocklistRow
	for rs.Next() {
		var ns, id, region []byte
		var r BlocklistRow
		if err := rs.Scan(&ns, &id, &r.WindowMs, &r.Sequence, &region, &r.Limit, &r.CountCur, &r.CountPrev, &r.ExpiresMs); err != nil {
			return out, fmt.Errorf("scan blocklist row: %w", err)
		}
		r.Namespace, r.Identifier, r.Region = string(ns), string(id), string(region)
		out = append(out, r)
	}
	if err := rs.Err(); err != nil {
		return out, fmt.Errorf("read blocklist rows: %w", err)
	}
	return out, nil
}

func scanCounts(rs *sql.Rows) ([]CountRow, error) {
	defer rs.Close()
	var out []CountRow
	for rs.Next() {
		var ns, id, region []byte
		var r CountRow
		if err := rs.Scan(&ns, &id, &r.WindowMs, &r.Sequence, &region, &r.Count, &r.ExpiresMs); err != nil {
			return out, fmt.Errorf("scan count row: %w", err)
		}
		r.Namespace, r.Identifier, r.Region = string(ns), string(id), string(region)
		out = append(out, r)
	}
	if err := rs.Err(); err != nil {
		return out, fmt.Errorf("read count rows: %w", err)
	}
	return out, nil
}

// pageQuery reads one page of a table's active rows in unique-key order,
// after the row whose key is after (nil: from the start). Keyset paging
// reads each row once however many pages there are.
func pageQuery(table, columns, regionCol string, after []any, now int64, limit int) (string, []any) {
	q := `SELECT ` + columns + ` FROM ` + table + ` WHERE expires_ms > ?`
	args := []any{now}
	if after != nil {
		q += ` AND (namespace, identifier, window_ms, sequence, ` + regionCol + `) > (?, ?, ?, ?, ?)`
		args = append(args, after...)
	}
	q += ` ORDER BY namespace, identifier, window_ms, sequence, ` + regionCol + ` LIMIT ?`
	return q, append(args, limit)
}

// cellsQuery reads a table's rows of the given cells (and, for each, of the
// cell before it).
func cellsQuery(table, columns string, cells []cellKey) (string, []any) {
	args := make([]any, 0, len(cells)*8)
	for _, c := range cells {
		args = append(args, []byte(c.ns), []byte(c.id), c.w, c.seq, []byte(c.ns), []byte(c.id), c.w, c.seq-1)
	}
	q := `SELECT ` + columns + ` FROM ` + table + ` WHERE (namespace, identifier, window_ms, sequence) IN (` +
		placeholders(len(cells)*2, 4) + `)`
	return q, args
}

// deleteExpired deletes up to chunk rows of table that expired before now.
func deleteExpired(ctx context.Context, db *sql.DB, table string, now int64, chunk int) (int64, error) {
	res, err := db.ExecContext(ctx, `DELETE FROM `+table+` WHERE expires_ms <= ? LIMIT ?`, now, chunk)
	if err != nil {
		return 0, fmt.Errorf("delete expired rows of %s: %w", table, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("delete expired rows of %s: %w", table, err)
	}
	return n, nil
}
