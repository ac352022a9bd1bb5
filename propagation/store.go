package propagation

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/go-sql-driver/mysql"
	"go.uber.org/zap"
)

// Store is the database between regions, as the layer uses it: MySQL
// through database/sql here (sqlStore), a model in the simulator.
type Store interface {
	// Migrate creates the tables, or brings older ones up to date, in
	// place and idempotently.
	Migrate(ctx context.Context) error
	// UpsertDenials and UpsertCounts write rows whose counts only grow;
	// a count that rises stamps the row's change time.
	UpsertDenials(ctx context.Context, rows []*BlocklistRow) error
	UpsertCounts(ctx context.Context, rows []*CountRow) error
	// ReadDenials and ReadCounts read one page of a table.
	ReadDenials(ctx context.Context, r Read) ([]BlocklistRow, error)
	ReadCounts(ctx context.Context, r Read) ([]CountRow, error)
	// DeleteExpired deletes up to chunk rows of t that expired at now, and
	// by the database's clock too.
	DeleteExpired(ctx context.Context, t Table, now int64, chunk int) (int64, error)
	// ReplicaLag is how far the database pulls read from is behind the
	// one writes go to; known is false when it cannot tell (no replica,
	// its replication stopped, or no right to ask).
	ReplicaLag(ctx context.Context) (lag time.Duration, known bool, err error)
	// Close closes the connections.
	Close() error
}

// Read selects one page of a table's live rows.
type Read struct {
	// Changed reads the rows whose counts rose at or after Since (Unix ms
	// on the database's clock), in change order; otherwise every row, in
	// key order.
	Changed bool
	Since   int64
	// Now: only rows that expire after it.
	Now int64
	// After resumes after that row (nil: from the start).
	After *RowKey
	// Limit bounds the page.
	Limit int
}

// sqlStore is a Store on MySQL (MySQL 8, MariaDB 10.6+, Vitess): writes go
// to write, pulls to read (mysql_read, a nearby replica; else write).
type sqlStore struct {
	write, read *sql.DB
	replica     bool
	// checkOnly: mysql_migrate off. Migrate checks that the schema is
	// there, whole, and changes nothing.
	checkOnly bool
	// server is the server_id the last clock read found (Server);
	// skipServerID, how many more clock reads leave it out after the
	// server refused to tell it (serverIDRetry).
	server       atomic.Pointer[string]
	skipServerID atomic.Int32
}

// openStore opens the pools without dialling. Every network step is
// bounded by timeout whatever the DSN says, so a hung server cannot hold a
// loop past it; sessions run in UTC, so the database's clock in the change
// column is Unix time whatever the server's zone.
// connMaxIdle is how long a connection to MySQL stays open unused.
var connMaxIdle = 30 * time.Second

func openStore(cfg Config, log *zap.Logger) (*sqlStore, string, error) {
	write, addr, err := openDB(cfg.DSN, cfg.Timeout, log, "mysql")
	if err != nil {
		return nil, "", err
	}
	s := &sqlStore{write: write, read: write, checkOnly: cfg.NoMigrate}
	if cfg.ReadDSN != "" {
		if s.read, _, err = openDB(cfg.ReadDSN, cfg.Timeout, log, "mysql_read"); err != nil {
			_ = write.Close()
			return nil, "", err
		}
		s.replica = true
	}
	return s, addr, nil
}

// CheckDSN parses a DSN the way the layer opens it, so that a Caddyfile
// line with a literal DSN fails `caddy adapt` rather than provisioning;
// line names the setting in the error, which never quotes the password.
func CheckDSN(dsn, line string) error {
	_, err := parseDSN(dsn, line)
	return err
}

// DatabaseOf names the database dsn writes to (its network, address and
// database, never credentials: Propagator.Addr), or "" when dsn does not
// parse.
func DatabaseOf(dsn string) string {
	c, err := mysql.ParseDSN(dsn)
	if err != nil {
		return ""
	}
	return databaseOf(c)
}

func databaseOf(c *mysql.Config) string { return c.Net + "(" + c.Addr + ")/" + c.DBName }

// parseDSN parses a DSN that must name a database; line names the setting
// in errors.
func parseDSN(dsn, line string) (*mysql.Config, error) {
	c, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, fmt.Errorf("%s: malformed DSN (want user:password@tcp(host:port)/database?params): %s", line, redact(err.Error(), dsn))
	}
	if c.DBName == "" {
		return nil, fmt.Errorf("%s: the DSN names no database (…@tcp(host:port)/database)", line)
	}
	// A port no server can listen on was accepted and failed every
	// connection at run time, retried forever ("invalid port"), where
	// redis refuses it at adapt (an audit).
	if strings.HasPrefix(c.Net, "tcp") {
		_, port, err := net.SplitHostPort(c.Addr)
		if n, perr := strconv.Atoi(port); err != nil || perr != nil || n < 1 || n > 65535 {
			return nil, fmt.Errorf("%s: the DSN's address %s has no port from 1 to 65535 (…@tcp(host:port)/database)", line, c.Addr)
		}
	}
	// A negative timeout would fail every dial, read or write at once.
	for _, t := range []struct {
		name string
		d    time.Duration
	}{{"timeout", c.Timeout}, {"readTimeout", c.ReadTimeout}, {"writeTimeout", c.WriteTimeout}} {
		if t.d < 0 {
			return nil, fmt.Errorf("%s: the DSN's %s %s is negative (leave it out for mysql_timeout, or give a positive duration)", line, t.name, t.d)
		}
	}
	return c, nil
}

// openDB opens one pool; line names the setting in errors.
func openDB(dsn string, timeout time.Duration, log *zap.Logger, line string) (*sql.DB, string, error) {
	c, err := parseDSN(dsn, line)
	if err != nil {
		return nil, "", err
	}
	for _, d := range []*time.Duration{&c.Timeout, &c.ReadTimeout, &c.WriteTimeout} {
		if *d == 0 || *d > timeout {
			*d = timeout
		}
	}
	if c.Params == nil {
		c.Params = map[string]string{}
	}
	c.Params["time_zone"] = "'+00:00'"
	// A statement with arguments was prepared, then executed: two round
	// trips each, which across regions (a database 100 ms away) doubled
	// what every flush, pull and publish waited for (an audit: 202 ms a
	// statement through a link 100 ms slow, 101 with the arguments in the
	// text). The driver puts them in the text itself, escaped, unless the
	// DSN says otherwise or names a character set (some multi-byte ones
	// make that unsafe, and the driver refuses them with it).
	if !strings.Contains(dsn, "interpolateParams=") && !strings.Contains(dsn, "charset=") && !strings.Contains(dsn, "collation=") {
		c.InterpolateParams = true
	}
	// A query the client gave up on (its context ended) is not stopped on
	// the server, which went on waiting for a row lock (50 s by default)
	// or a table's metadata lock (a day on MariaDB, a year on MySQL) on a
	// connection the client had closed: each flush behind a lock left one
	// more. The sessions wait no longer than the timeout, unless the DSN
	// says otherwise.
	wait := strconv.FormatInt(max(1, int64(math.Ceil(timeout.Seconds()))), 10)
	for _, v := range []string{"innodb_lock_wait_timeout", "lock_wait_timeout"} {
		if _, set := c.Params[v]; !set {
			c.Params[v] = wait
		}
	}
	c.Logger = driverLogger{log}
	conn, err := mysql.NewConnector(c)
	if err != nil {
		return nil, "", fmt.Errorf("%s: %s", line, redact(err.Error(), dsn))
	}
	db := sql.OpenDB(conn)
	db.SetMaxOpenConns(maxOpenConns)
	db.SetMaxIdleConns(maxIdleConns)
	db.SetConnMaxLifetime(5 * time.Minute)
	// A member runs no statement after the migration check at its start,
	// and its connection stayed open until its lifetime ended: one per
	// node of every region for five minutes after each start or reload,
	// past MySQL's max_connections (151 by default) on an edge deployment.
	// The holder's flushes keep theirs in use.
	db.SetConnMaxIdleTime(connMaxIdle)
	return db, databaseOf(c), nil
}

// redact removes the DSN's password from a message, should a driver error
// ever quote it.
func redact(msg, dsn string) string {
	at := strings.LastIndex(dsn, "@")
	if at < 0 {
		return msg
	}
	colon := strings.Index(dsn[:at], ":")
	if colon < 0 || colon+1 >= at {
		return msg
	}
	return strings.ReplaceAll(msg, dsn[colon+1:at], "****")
}

// driverLogger routes go-sql-driver's own log lines (broken connections)
// to the module's logger, at warn: the driver logs only what went wrong.
type driverLogger struct{ log *zap.Logger }

func (l driverLogger) Print(v ...any) {
	l.log.Warn("mysql driver: " + strings.TrimSpace(fmt.Sprint(v...)))
}

func (s *sqlStore) Migrate(ctx context.Context) error {
	if s.checkOnly {
		return CheckSchema(ctx, s.write)
	}
	return Migrate(ctx, s.write)
}

func (s *sqlStore) Close() error {
	err := s.write.Close()
	if s.replica {
		err = errors.Join(err, s.read.Close())
	}
	return err
}

// dbNowMs is the database's clock in Unix ms (sessions run in UTC).
const dbNowMs = `ROUND(UNIX_TIMESTAMP(NOW(3)) * 1000)`

// clockServerIDQuery reads the database's clock and its server_id in one
// statement (a variable, so that a test can have the server refuse it).
var clockServerIDQuery = `SELECT ` + dbNowMs + `, @@server_id`

// serverIDRetry is how many clock reads leave the server_id out after the
// server refused the statement that asks for it and answered the clock
// alone: a proxy that does not pass @@server_id on costs one refused
// statement in that many, and a refusal that passes (too many
// connections, a server shutting down, a proxy's error mid-failover) hides
// the failovers after it for that many global syncs only. Before
// 2026-11-28 one refusal stopped the question for good.
const serverIDRetry = 10

// Clock implements ClockStore: the clock of the database writes go to,
// which stamps updated_ms. The same statement reads the server's
// server_id (Server), unless the server refused it within the last
// serverIDRetry reads.
func (s *sqlStore) Clock(ctx context.Context) (int64, error) {
	var ms int64
	var refused bool
	if n := s.skipServerID.Load(); n > 0 {
		s.skipServerID.CompareAndSwap(n, n-1)
	} else {
		var id string
		err := s.write.QueryRowContext(ctx, clockServerIDQuery).Scan(&ms, &id)
		var me *mysql.MySQLError
		if !errors.As(err, &me) {
			if err != nil {
				return 0, fmt.Errorf("read the database's clock: %w", err)
			}
			s.server.Store(&id)
			return ms, nil
		}
		refused = true
	}
	if err := s.write.QueryRowContext(ctx, `SELECT `+dbNowMs).Scan(&ms); err != nil {
		return 0, fmt.Errorf("read the database's clock: %w", err)
	}
	if refused {
		s.skipServerID.Store(serverIDRetry)
	}
	return ms, nil
}

// Server implements ServerStore: the server_id of the server writes go
// to, as the last clock read found it ("" before, or when the server does
// not tell). A primary and each of its replicas have their own (they
// could not replicate otherwise).
func (s *sqlStore) Server() string {
	if id := s.server.Load(); id != nil {
		return *id
	}
	return ""
}

// placeholders returns n groups of k placeholders, each followed by tail
// ("(?,?,…,?tail),(…)").
func placeholders(n, k int, tail string) string {
	group := "(" + strings.TrimSuffix(strings.Repeat("?,", k), ",") + tail + ")"
	return strings.TrimSuffix(strings.Repeat(group+",", n), ",")
}

// UpsertDenials writes rows, sorted in unique-key order (concurrent bulk
// upserts from many writers that lock keys in different orders deadlock).
// Counts only grow: a late or repeated write never lowers a row, and only
// a count that rises moves the row's change time.
func (s *sqlStore) UpsertDenials(ctx context.Context, rows []*BlocklistRow) error {
	if len(rows) == 0 {
		return nil
	}
	slices.SortFunc(rows, compareBlock)
	args := make([]any, 0, len(rows)*9)
	for _, r := range rows {
		args = append(args, []byte(r.Namespace), []byte(r.Identifier), r.WindowMs, r.Sequence, []byte(r.Region),
			r.Limit, r.CountCur, r.CountPrev, r.ExpiresMs)
	}
	// MySQL applies the assignments left to right: updated_ms compares
	// the counts before they are raised.
	q := `INSERT INTO ratelimit_blocklist
  (namespace, identifier, window_ms, sequence, origin_region, limit_units, count_cur, count_prev, expires_ms, updated_ms)
VALUES ` + placeholders(len(rows), 9, ","+dbNowMs) + `
ON DUPLICATE KEY UPDATE
  updated_ms = IF(VALUES(count_cur) > count_cur OR VALUES(count_prev) > count_prev, VALUES(updated_ms), updated_ms),
  limit_units = VALUES(limit_units),
  count_cur = GREATEST(count_cur, VALUES(count_cur)),
  count_prev = GREATEST(count_prev, VALUES(count_prev)),
  expires_ms = GREATEST(expires_ms, VALUES(expires_ms))`
	if _, err := s.write.ExecContext(ctx, q, args...); err != nil {
		return fmt.Errorf("upsert %d blocklist rows: %w", len(rows), err)
	}
	return nil
}

// UpsertCounts writes published counts, sorted like UpsertDenials, with
// count = GREATEST(count, new): a region's count only grows, and a
// repeated write (a new holder, a retry) changes nothing. A newer global
// reset replaces the row's reset, and its base with the larger of the
// write's and the row's count (the assignments run in order, each seeing
// those before it: updated_ms and reset_base read the old reset_version
// and count). A region's count is below its row's only when it lost
// units, restarted whole with its Redis emptied: marked at that count, the
// reset took off none of the units the row still counts, and every other
// region went on counting them (the root's
// TestReset_AGlobalResetAfterTheRegionRestartedEmptyTakesItsOldUnitsOff);
// the holder then publishes its count on top of the row's base (ownMark).
func (s *sqlStore) UpsertCounts(ctx context.Context, rows []*CountRow) error {
	if len(rows) == 0 {
		return nil
	}
	slices.SortFunc(rows, compareCount)
	args := make([]any, 0, len(rows)*9)
	for _, r := range rows {
		args = append(args, []byte(r.Namespace), []byte(r.Identifier), r.WindowMs, r.Sequence, []byte(r.Region),
			r.Count, r.ResetVersion, r.ResetBase, r.ExpiresMs)
	}
	q := `INSERT INTO ratelimit_global_counts
  (namespace, identifier, window_ms, sequence, region, count, reset_version, reset_base, expires_ms, updated_ms)
VALUES ` + placeholders(len(rows), 9, ","+dbNowMs) + `
ON DUPLICATE KEY UPDATE
  updated_ms = IF(VALUES(count) > count OR VALUES(reset_version) > reset_version, VALUES(updated_ms), updated_ms),
  reset_base = IF(VALUES(reset_version) > reset_version, GREATEST(count, VALUES(reset_base)),
    IF(VALUES(reset_version) = reset_version, GREATEST(reset_base, VALUES(reset_base)), reset_base)),
  reset_version = GREATEST(reset_version, VALUES(reset_version)),
  count = GREATEST(count, VALUES(count)),
  expires_ms = GREATEST(expires_ms, VALUES(expires_ms))`
	if _, err := s.write.ExecContext(ctx, q, args...); err != nil {
		return fmt.Errorf("upsert %d count rows: %w", len(rows), err)
	}
	return nil
}

const (
	blocklistColumns = `namespace, identifier, window_ms, sequence, origin_region, limit_units, count_cur, count_prev, expires_ms, updated_ms`
	countColumns     = `namespace, identifier, window_ms, sequence, region, count, reset_version, reset_base, expires_ms, updated_ms`
)

func (s *sqlStore) ReadDenials(ctx context.Context, r Read) ([]BlocklistRow, error) {
	q, args := readQuery(Denials, blocklistColumns, r)
	rs, err := s.read.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	defer rs.Close()
	var out []BlocklistRow
	for rs.Next() {
		var ns, id, region []byte
		var b BlocklistRow
		if err := rs.Scan(&ns, &id, &b.WindowMs, &b.Sequence, &region, &b.Limit, &b.CountCur, &b.CountPrev, &b.ExpiresMs, &b.UpdatedMs); err != nil {
			return out, fmt.Errorf("scan blocklist row: %w", err)
		}
		b.Namespace, b.Identifier, b.Region = string(ns), string(id), string(region)
		out = append(out, b)
	}
	if err := rs.Err(); err != nil {
		return out, fmt.Errorf("read blocklist rows: %w", err)
	}
	return out, nil
}

func (s *sqlStore) ReadCounts(ctx context.Context, r Read) ([]CountRow, error) {
	return readCounts(ctx, s.read, r)
}

// ReadWrittenCounts is ReadCounts on the server writes go to, whatever
// mysql_read says.
func (s *sqlStore) ReadWrittenCounts(ctx context.Context, r Read) ([]CountRow, error) {
	return readCounts(ctx, s.write, r)
}

func readCounts(ctx context.Context, db *sql.DB, r Read) ([]CountRow, error) {
	q, args := readQuery(Counts, countColumns, r)
	rs, err := db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	defer rs.Close()
	var out []CountRow
	for rs.Next() {
		var ns, id, region []byte
		var c CountRow
		if err := rs.Scan(&ns, &id, &c.WindowMs, &c.Sequence, &region, &c.Count, &c.ResetVersion, &c.ResetBase, &c.ExpiresMs, &c.UpdatedMs); err != nil {
			return out, fmt.Errorf("scan count row: %w", err)
		}
		c.Namespace, c.Identifier, c.Region = string(ns), string(id), string(region)
		out = append(out, c)
	}
	if err := rs.Err(); err != nil {
		return out, fmt.Errorf("read count rows: %w", err)
	}
	return out, nil
}

// readQuery builds the page r of table t. Keyset paging reads each row
// once however many pages there are; a read of changes walks the
// updated_ms index (whose entries carry the primary key, so the order is
// the index's own).
func readQuery(t Table, columns string, r Read) (string, []any) {
	order := `namespace, identifier, window_ms, sequence, ` + t.regionColumn()
	from := t.String()
	if r.Changed {
		// The change index, named: on a small or freshly changed table
		// the optimizer may prefer scanning every row to an empty range,
		// and a steady table must cost a pull nothing.
		from += ` FORCE INDEX (` + t.String() + `_updated)`
	}
	q := `SELECT ` + columns + ` FROM ` + from + ` WHERE expires_ms > ?`
	args := []any{r.Now}
	if r.Changed {
		q += ` AND updated_ms >= ?`
		args = append(args, r.Since)
		order = `updated_ms, ` + order
	}
	if a := r.After; a != nil {
		keys := []any{[]byte(a.Namespace), []byte(a.Identifier), a.WindowMs, a.Sequence, []byte(a.Region)}
		if r.Changed {
			q += ` AND (` + order + `) > (?, ?, ?, ?, ?, ?)`
			args = append(append(args, a.UpdatedMs), keys...)
		} else {
			q += ` AND (` + order + `) > (?, ?, ?, ?, ?)`
			args = append(args, keys...)
		}
	}
	q += ` ORDER BY ` + order + ` LIMIT ?`
	return q, append(args, r.Limit)
}

// ResetMark starts the namespace of a reset's row of ratelimit_overrides
// (the root package names them so): no zone name holds it.
const ResetMark = "\x01"

// LapsedOverrideLife is how long an override's row is kept once it
// lapsed, as a removal's is (a removal lapses a day after it was made).
// A region whose holder did not reach MySQL while the override was live
// reads then that it replaced the one the region holds. Deleted as it
// lapsed, the region kept applying the older override for good, and its
// holder, finding that one missing from a whole read, wrote it back for
// every region
// (TestOverrides_ARegionCutOffWhileAChangeLapsedDropsWhatItReplaced).
const LapsedOverrideLife = 24 * time.Hour

// DeleteExpired deletes up to chunk rows of t that expired at now (an
// override without an expiry never does, and one that lapsed goes
// LapsedOverrideLife later; removals and resets go as they lapse).
//
// A row is expired by the node's clock and by the database's, whichever
// is behind: a node whose clock ran minutes ahead once deleted every
// region's live rows, which a region reading the table whole then never
// saw, for the rest of their window.
func (s *sqlStore) DeleteExpired(ctx context.Context, t Table, now int64, chunk int) (int64, error) {
	cond, args := `expires_ms <= LEAST(?, `+dbNowMs+`)`, []any{now}
	if t == Overrides {
		cond = `expires_ms > 0 AND ` + cond + ` AND (deleted = 1 OR LEFT(namespace, 1) = ? OR expires_ms <= LEAST(?, ` + dbNowMs + `) - ?)`
		args = append(args, []byte(ResetMark), now, LapsedOverrideLife.Milliseconds())
	}
	res, err := s.write.ExecContext(ctx, `DELETE FROM `+t.String()+` WHERE `+cond+` LIMIT ?`, append(args, chunk)...)
	if err != nil {
		return 0, fmt.Errorf("delete expired rows of %s: %w", t, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("delete expired rows of %s: %w", t, err)
	}
	return n, nil
}

// ReplicaLag asks the replica (mysql_read) how far behind it is:
// SHOW REPLICA STATUS (MySQL 8.0.22+, MariaDB 10.5+), else SHOW SLAVE
// STATUS. Its Seconds_Behind_Source (or _Master) is NULL while the SQL
// thread is stopped: unknown, not zero.
func (s *sqlStore) ReplicaLag(ctx context.Context) (time.Duration, bool, error) {
	if !s.replica {
		return 0, false, nil
	}
	var err error
	for _, q := range []string{"SHOW REPLICA STATUS", "SHOW SLAVE STATUS"} {
		var lag sql.NullInt64
		var found bool
		if lag, found, err = s.showLag(ctx, q); err == nil {
			return time.Duration(lag.Int64) * time.Second, found && lag.Valid, nil
		}
	}
	return 0, false, err
}

func (s *sqlStore) showLag(ctx context.Context, q string) (sql.NullInt64, bool, error) {
	var lag sql.NullInt64
	rs, err := s.read.QueryContext(ctx, q)
	if err != nil {
		return lag, false, err
	}
	defer rs.Close()
	cols, err := rs.Columns()
	if err != nil || !rs.Next() {
		return lag, false, cmp.Or(err, rs.Err())
	}
	vals := make([]any, len(cols))
	for i, c := range cols {
		if c == "Seconds_Behind_Source" || c == "Seconds_Behind_Master" {
			vals[i] = &lag
		} else {
			vals[i] = new(sql.RawBytes)
		}
	}
	if err := rs.Scan(vals...); err != nil {
		return lag, false, err
	}
	return lag, true, nil
}

// UpsertOverrides writes overrides, sorted by key, each replacing the row
// only when its version is newer, or the same and its region after the
// row's (two regions' operators stamped past the same held version: the
// regions' Redis and the nodes' books break the tie alike, so every region
// ends on one change): the assignments run left to right, so
// origin_region and version, compared by the others, are set last.
func (s *sqlStore) UpsertOverrides(ctx context.Context, rows []*OverrideRow) error {
	if len(rows) == 0 {
		return nil
	}
	args := make([]any, 0, len(rows)*8)
	for _, r := range rows {
		del := 0
		if r.Deleted {
			del = 1
		}
		args = append(args, []byte(r.Namespace), []byte(r.Identifier), r.Limit, r.ExpiresMs, []byte(r.Reason),
			[]byte(r.Region), r.Version, del)
	}
	newer := `(VALUES(version) > version OR VALUES(version) = version AND VALUES(origin_region) > origin_region)`
	q := `INSERT INTO ratelimit_overrides
  (namespace, identifier, limit_units, expires_ms, reason, origin_region, version, deleted, updated_ms)
VALUES ` + placeholders(len(rows), 8, ","+dbNowMs) + `
ON DUPLICATE KEY UPDATE
  updated_ms = IF(` + newer + `, VALUES(updated_ms), updated_ms),
  limit_units = IF(` + newer + `, VALUES(limit_units), limit_units),
  expires_ms = IF(` + newer + `, VALUES(expires_ms), expires_ms),
  reason = IF(` + newer + `, VALUES(reason), reason),
  deleted = IF(` + newer + `, VALUES(deleted), deleted),
  origin_region = IF(` + newer + `, VALUES(origin_region), origin_region),
  version = GREATEST(version, VALUES(version))`
	if _, err := s.write.ExecContext(ctx, q, args...); err != nil {
		return fmt.Errorf("upsert %d overrides: %w", len(rows), err)
	}
	return nil
}

// MarkResetCounts marks region's published counts of the key (its zone
// and identifier as count rows name them) with the global reset ver,
// where they do not hold it or a newer one: the base is the row's count,
// every unit it counts taken off. A region marks its Redis's cells when
// it hears of a reset, and its holder publishes the marks; a cell the
// region's Redis no longer holds (the region restarted whole, its Redis
// emptied, since it published the count) is never published again, and
// its row, unmarked, kept counting the units the reset took off in every
// other region for the rest of the window
// (TestReset_AGlobalResetAfterTheRegionRestartedEmptyTakesItsOldUnitsOff).
func (s *sqlStore) MarkResetCounts(ctx context.Context, region, namespace, identifier string, ver int64) (int64, error) {
	res, err := s.write.ExecContext(ctx, `UPDATE ratelimit_global_counts
SET updated_ms = `+dbNowMs+`, reset_base = count, reset_version = ?
WHERE namespace = ? AND identifier = ? AND region = ? AND reset_version < ?`,
		ver, []byte(namespace), []byte(identifier), []byte(region), ver)
	if err != nil {
		return 0, fmt.Errorf("mark a reset on the region's counts: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("mark a reset on the region's counts: %w", err)
	}
	return n, nil
}

const overrideColumns = `namespace, identifier, limit_units, expires_ms, reason, origin_region, version, deleted, updated_ms`

// ReadOverrides reads a page of overrides: those changed since r.Since,
// in change order, or all of them in key order. Removals and lapsed ones
// are read too: a removal must reach every region.
func (s *sqlStore) ReadOverrides(ctx context.Context, r Read) ([]OverrideRow, error) {
	return readOverrides(ctx, s.read, r)
}

// ReadWrittenOverrides is ReadOverrides on the server writes go to,
// whatever mysql_read says.
func (s *sqlStore) ReadWrittenOverrides(ctx context.Context, r Read) ([]OverrideRow, error) {
	return readOverrides(ctx, s.write, r)
}

func readOverrides(ctx context.Context, db *sql.DB, r Read) ([]OverrideRow, error) {
	q := `SELECT ` + overrideColumns + ` FROM ratelimit_overrides`
	var args []any
	order := `namespace, identifier`
	var where []string
	if r.Changed {
		q += ` FORCE INDEX (ratelimit_overrides_updated)`
		where = append(where, `updated_ms >= ?`)
		args = append(args, r.Since)
		order = `updated_ms, ` + order
	}
	if a := r.After; a != nil {
		if r.Changed {
			where = append(where, `(`+order+`) > (?, ?, ?)`)
			args = append(args, a.UpdatedMs, []byte(a.Namespace), []byte(a.Identifier))
		} else {
			where = append(where, `(`+order+`) > (?, ?)`)
			args = append(args, []byte(a.Namespace), []byte(a.Identifier))
		}
	}
	if len(where) > 0 {
		q += ` WHERE ` + strings.Join(where, ` AND `)
	}
	q += ` ORDER BY ` + order + ` LIMIT ?`
	rs, err := db.QueryContext(ctx, q, append(args, r.Limit)...)
	if err != nil {
		return nil, err
	}
	defer rs.Close()
	var out []OverrideRow
	for rs.Next() {
		var ns, id, reason, region []byte
		var o OverrideRow
		var del int
		if err := rs.Scan(&ns, &id, &o.Limit, &o.ExpiresMs, &reason, &region, &o.Version, &del, &o.UpdatedMs); err != nil {
			return out, fmt.Errorf("scan override: %w", err)
		}
		o.Namespace, o.Identifier, o.Reason, o.Region, o.Deleted = string(ns), string(id), string(reason), string(region), del != 0
		out = append(out, o)
	}
	if err := rs.Err(); err != nil {
		return out, fmt.Errorf("read overrides: %w", err)
	}
	return out, nil
}
