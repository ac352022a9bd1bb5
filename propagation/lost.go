package propagation

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"github.com/go-sql-driver/mysql"
	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Rows lost by hand: an operator empties a table (TRUNCATE, DELETE),
// drops one (or one of its columns), or drops the database and makes it
// again empty, mid-window.
// The process wrote a cell again only when its count grew, and migrated
// the schema once, at start: a dropped table failed every statement
// until the process restarted, and the rows of counts that stood still
// never came back, so the other regions left them out for the rest of
// their window.

// MySQL's errors for a schema that is gone.
const (
	errNoSuchTable = 1146 // ER_NO_SUCH_TABLE
	errBadDB       = 1049 // ER_BAD_DB_ERROR
	errBadField    = 1054 // ER_BAD_FIELD_ERROR: a column dropped by hand
	errNoSuchKey   = 1176 // ER_KEY_DOES_NOT_EXITS: a key the pulls name, dropped
)

// schemaGone reports an error of a statement whose table, column, key or
// database does not exist.
func schemaGone(err error) bool {
	var me *mysql.MySQLError
	if !errors.As(err, &me) {
		return false
	}
	switch me.Number {
	case errNoSuchTable, errBadDB, errBadField, errNoSuchKey:
		return true
	}
	return false
}

// lostSchema is whether a statement found the schema gone since the
// last migration (noteSchemaGone); remigrate migrates it again.
type lostSchema struct {
	gone atomic.Bool
}

// noteSchemaGone records a statement of the server writes go to that
// found a table or the database gone: the next flush migrates again
// (remigrate). A replica's (mysql_read) does not count: one that has not
// applied the schema yet would have every flush publish every cell again
// while it catches up; a table dropped on the primary is seen there by
// the cleanup within a minute, or by the next write.
func (p *Propagator) noteSchemaGone(err error) {
	if errors.Is(err, errLeaseLost) || p.stopped(err) || !schemaGone(err) || !p.lost.gone.CompareAndSwap(false, true) {
		return
	}
	p.log.Warn("a mysql table, column or the database is gone (dropped by hand?): making the schema again, then publishing every cell again and reading every table whole",
		zap.String("database", p.addr), zap.Error(err))
}

// readsReplica reports whether pulls read a replica (mysql_read).
func (p *Propagator) readsReplica() bool {
	s, ok := p.store.(*sqlStore)
	return ok && s.replica
}

// remigrate migrates the schema again once a statement found it gone
// (with mysql_migrate off it checks that an operator made it again), and
// then publishes every cell again and reads every table whole. A failed
// attempt is counted (migrate errors) and tried again on the next flush.
func (p *Propagator) remigrate(ctx context.Context) {
	if !p.lost.gone.Load() {
		return
	}
	err := p.query(ctx, func(ctx context.Context) error { return p.store.Migrate(ctx) })
	if err != nil {
		if !p.stopped(err) && !errors.Is(err, errLeaseLost) {
			if c := p.stats.migrateErrors.Add(1); c == 1 || c%100 == 0 {
				p.log.Warn("mysql schema migration failed; retrying in the background, cross-region counts wait",
					zap.String("database", p.addr), zap.Int64("migrate_errors", c), zap.Error(err))
			}
		}
		return
	}
	p.lost.gone.Store(false)
	p.stats.schemaRemade.Add(1)
	p.mu.Lock()
	p.publishAgainLocked()
	p.mu.Unlock()
	p.log.Warn("mysql schema made again: publishing every cell again and reading every table whole",
		zap.String("database", p.addr))
}

// ownRowsMissing reports whether checkOwnRows would find a row missing
// from own, changing nothing.
func (p *Propagator) ownRowsMissing(own map[Cell]struct{}, now int64) bool {
	missing := false
	if p.region != nil {
		p.mu.Lock()
		for c, r := range p.reg {
			if _, ok := own[c]; !ok && r.published > 0 && expiresMs(c.Sequence, c.WindowMs) > now {
				missing = true
				break
			}
		}
		p.mu.Unlock()
		return missing
	}
	p.eng.ScanCells(p.cfg.MinWindow, func(v *engine.CellView) bool {
		w := v.Key.Window.Milliseconds()
		if v.Published <= 0 || expiresMs(v.Sequence, w) <= now {
			return true
		}
		_, ok := own[Cell{v.Key.Namespace, p.rowID(v.Key.Identifier), w, v.Sequence}]
		missing = !ok
		return ok
	})
	return missing
}

// ownWrittenRows reads this region's live rows of the published counts
// from the server writes go to (with mysql_read, the whole reads go to
// the replica), or returns nil when the read failed: nothing is taken for
// missing then.
func (p *Propagator) ownWrittenRows(ctx context.Context, s *sqlStore, now int64) map[Cell]struct{} {
	own := make(map[Cell]struct{})
	whole, err := eachPage(p, ctx, Read{Now: now, Limit: pageSize}, s.ReadWrittenCounts, (*CountRow).key, func(rows []CountRow) {
		for i := range rows {
			if rows[i].Region == p.cfg.Region {
				own[rows[i].cell()] = struct{}{}
			}
		}
	})
	if err != nil {
		p.readFailed(Counts.what(), err)
		p.noteSchemaGone(err)
		return nil
	}
	if !whole {
		return nil
	}
	return own
}

// checkOwnRows compares this region's rows that a whole read of the
// published counts found (own) with the cells it published whose rows
// are still live at now: a row missing was deleted by hand, and its cell
// is published again on the next flushes. Only for reads of the server
// writes go to (a replica may not have applied a row just written yet).
func (p *Propagator) checkOwnRows(own map[Cell]struct{}, now int64) {
	var missing int64
	if p.region != nil {
		p.mu.Lock()
		for c, r := range p.reg {
			if _, ok := own[c]; !ok && r.published > 0 && expiresMs(c.Sequence, c.WindowMs) > now {
				r.published, r.publishedReset = 0, 0
				missing++
			}
		}
		if missing > 0 {
			p.fullPush = true
			p.pushes++
		}
		p.mu.Unlock()
	} else {
		p.eng.ScanCells(p.cfg.MinWindow, func(v *engine.CellView) bool {
			w := v.Key.Window.Milliseconds()
			if v.Published <= 0 || expiresMs(v.Sequence, w) <= now {
				return true
			}
			if _, ok := own[Cell{v.Key.Namespace, p.rowID(v.Key.Identifier), w, v.Sequence}]; !ok {
				missing++
			}
			return true
		})
		if missing > 0 {
			p.mu.Lock()
			p.fullPush, p.republish = true, true
			p.pushes++
			p.mu.Unlock()
		}
	}
	if missing > 0 {
		c := p.stats.ownRowsMissing.Add(missing)
		p.log.Warn("published rows of this region are missing from ratelimit_global_counts (deleted by hand?): publishing its cells again",
			zap.String("database", p.addr), zap.Int64("missing", missing), zap.Int64("own_rows_missing", c))
	}
}

// Overrides lost by hand: ratelimit_overrides emptied (TRUNCATE, DELETE)
// while the regions hold its rows. The regions kept applying what they
// held, but one that started afterwards loaded nothing and applied the
// Caddyfile's limits, and a reset was lost to it. Each holder keeps the
// newest row of each key it wrote or read until the row lapses
// (ovHeld), and a whole read that lacks one, or holds an older version,
// writes it back: the write keeps the newest version, so every region
// ends on the newest change again, and a removal written back keeps an
// older limit from coming back.

// lapseMargin is how close to its lapse an override missing from a whole
// read is left out of the write back: the cleanup of a region whose
// clock runs ahead deletes it that much early, and writing it back would
// only have it deleted again.
const lapseMargin = time.Minute

// holdOverrideLocked notes r as written to or read from MySQL, if it is
// the newest of its key. Callers hold p.mu.
func (p *Propagator) holdOverrideLocked(r OverrideRow) {
	k := Cell{Namespace: r.Namespace, Identifier: r.Identifier}
	if old, ok := p.ovHeld[k]; ok && old.Version >= r.Version {
		return
	}
	if len(p.ovHeld) >= maxPendingOverrides {
		return
	}
	r.UpdatedMs = 0
	p.ovHeld[k] = r
}

// checkOverrideRows compares a whole read of ratelimit_overrides (rows)
// with the overrides held here that have not lapsed at now, and queues
// those missing or older there to be written again. A replica
// (mysql_read) may not have applied a row just written: what it lacks
// is looked for on the server writes go to, and only what that lacks
// too is written back.
func (p *Propagator) checkOverrideRows(ctx context.Context, rows []OverrideRow, now int64) {
	back := p.overridesMissing(rows, now)
	if len(back) == 0 {
		return
	}
	if s, ok := p.store.(*sqlStore); ok && s.replica {
		written, done := p.writtenOverrides(ctx, s)
		if !done {
			return
		}
		if back = p.overridesMissing(written, now); len(back) == 0 {
			return
		}
	}
	for _, r := range back {
		p.PutOverride(r)
	}
	c := p.stats.overrideRowsMissing.Add(int64(len(back)))
	p.log.Warn("runtime overrides held here are missing from ratelimit_overrides (emptied by hand?): writing them back, newest version first",
		zap.String("database", p.addr), zap.Int("missing", len(back)), zap.Int64("override_rows_missing", c))
}

// writtenOverrides reads every override from the server writes go to,
// and reports whether it read to the end.
func (p *Propagator) writtenOverrides(ctx context.Context, s *sqlStore) ([]OverrideRow, bool) {
	var out []OverrideRow
	whole, err := eachPage(p, ctx, Read{Limit: pageSize}, s.ReadWrittenOverrides, (*OverrideRow).key,
		func(rows []OverrideRow) { out = append(out, rows...) })
	if err != nil {
		p.readFailed(Overrides.what(), err)
		p.noteSchemaGone(err)
		return nil, false
	}
	return out, whole
}

// overridesMissing returns the overrides held here, not lapsed at now,
// that rows (a whole read) lacks or holds in an older version; it
// forgets those that lapsed.
func (p *Propagator) overridesMissing(rows []OverrideRow, now int64) []OverrideRow {
	there := make(map[Cell]int64, len(rows))
	for _, r := range rows {
		there[Cell{Namespace: r.Namespace, Identifier: r.Identifier}] = r.Version
	}
	var back []OverrideRow
	p.mu.Lock()
	for k, r := range p.ovHeld {
		if r.ExpiresMs != 0 && r.ExpiresMs <= now {
			delete(p.ovHeld, k)
			continue
		}
		if r.ExpiresMs != 0 && r.ExpiresMs <= now+lapseMargin.Milliseconds() {
			continue // another region's cleanup, its clock ahead, may have deleted it
		}
		if v, ok := there[k]; !ok || v < r.Version {
			back = append(back, r)
		}
	}
	p.mu.Unlock()
	return back
}
