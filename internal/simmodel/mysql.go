package simmodel

import (
	"context"
	"math/rand/v2"
	"sort"
	"sync"
	"time"

	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// MySQL is the database between regions: one primary that every write
// goes to, and a replica in each region that asks for one, which applies
// the primary's changes late by a lag it draws (never going back in
// time). Each region reaches the primary over its own link (the round
// trip across continents, partitions of the region) and its replica over
// a local one. The tables keep the real schema's semantics: counts only
// rise, a rise stamps updated_ms with the primary's clock (the simulated
// time a statement arrives there), reads page in the real orders, and
// expired rows stay until a cleanup deletes them. It is safe for
// concurrent use.
type MySQL struct {
	mu      sync.Mutex
	now     func() int64
	rng     *rand.Rand
	timeout float64
	// tables are the counts, the denials and the overrides; the last
	// stays empty (the simulator changes no limit at runtime), but the
	// holder pulls it every flush, as a real one does.
	tables  [3]*table
	regions []*MySQLRegion
	// Down are the primary's outages: its statements are refused.
	down     []Span
	inflight []inflight
	seq      int64
	applied  int64 // writes applied, for compaction
}

// MySQLRegion is one region's view of the database: its link to the
// primary, its replica, and what it cost.
type MySQLRegion struct {
	// ToPrimary is the link to the primary: its latency is the round trip
	// of a statement, its outages the region's partitions.
	ToPrimary Link
	// Replica: the region reads from a replica of its own (mysql_read),
	// over Local, lagging by Lag.
	Replica bool
	Local   Link
	Lag     Dist
	// Cost is what the region's statements cost.
	Cost MySQLCost

	replicaAt int64 // the replica has applied the primary's changes up to here
	// lag is the replica's lag now, drawn from Lag once every lagHold ms
	// of simulated time, or ten median lags if longer (from lagUntil on,
	// the next).
	lag, lagUntil int64
}

// lagHold is how long a replica's drawn lag holds. A lag drawn at every
// read and ratcheted (the replica never goes back) kept the lowest draws:
// at a nominal lag of 1 s reads saw a median of 0.8-1.0 s, at 5 s
// 3.1-4.0 s, and the more often the replica was read the less, where a
// real replica 2 s behind (MASTER_DELAY) kept its 2 s: its region admitted
// 446-454 of a burst's keys against the model's 312-340, and 448-452 with
// the lag held (an audit). A replica's lag moves over seconds, not reads;
// held ten median lags, a draw that rises stalls the replica for a small
// part of its hold (the replica applies nothing until it is that far
// behind), so reads see about the drawn lag.
const lagHold = 1000

// MySQLCost is what a region's statements cost the servers.
type MySQLCost struct {
	// Statements and RowsRead ran on the primary; ReplicaStatements and
	// ReplicaRowsRead on the region's replica. RowsRead counts the rows a
	// server read (MariaDB's Rows_read): those returned and those an index
	// range or scan passed over.
	Statements, RowsRead               int64
	ReplicaStatements, ReplicaRowsRead int64
	// RowsWritten are the rows upserted and deleted.
	RowsWritten int64
	// Errors are the statements that failed.
	Errors int64
}

// Add adds o to c.
func (c *MySQLCost) Add(o MySQLCost) {
	c.Statements += o.Statements
	c.RowsRead += o.RowsRead
	c.ReplicaStatements += o.ReplicaStatements
	c.ReplicaRowsRead += o.ReplicaRowsRead
	c.RowsWritten += o.RowsWritten
	c.Errors += o.Errors
}

// NewMySQL returns empty tables on the clock now (Unix ms), with the
// regions' views and the statements' timeout (mysql_timeout, ms).
func NewMySQL(now func() int64, seed uint64, timeout float64, regions []*MySQLRegion) *MySQL {
	m := &MySQL{now: now, rng: newRand(seed, 2), timeout: timeout, regions: regions}
	for i := range m.tables {
		m.tables[i] = &table{rows: map[rowKey]*row{}}
	}
	t := now()
	for _, r := range regions {
		r.replicaAt = t
	}
	return m
}

// SetPrimaryDown adds an outage of the primary.
func (m *MySQL) SetPrimaryDown(s Span) {
	m.mu.Lock()
	m.down = append(m.down, s)
	m.mu.Unlock()
}

// Cost returns region i's cost.
func (m *MySQL) Cost(i int) MySQLCost {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.regions[i].Cost
}

// Count returns region's published count of a cell on the primary (0
// when it has none).
func (m *MySQL) Count(c propagation.Cell, region string) int64 {
	m.begin()
	defer m.mu.Unlock()
	k := rowKey{c.Namespace, c.Identifier, c.WindowMs, c.Sequence, region}
	if r := m.tables[propagation.Counts].rows[k]; r != nil {
		return r.last.count
	}
	return 0
}

// Rows is the number of live rows of t on the primary.
func (m *MySQL) Rows(t propagation.Table) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.tables[t].rows)
}

// Client returns region i's store, as the propagation layer of one of its
// processes uses it; each statement adds its latency to tick.
func (m *MySQL) Client(i int, tick *Tick) propagation.Store {
	return &mysqlClient{m: m, r: m.regions[i], tick: tick}
}

// inflight is a write on its way to the primary.
type inflight struct {
	at, seq int64
	apply   func(at int64)
}

// arrive applies the writes that reached the primary by now (m.mu held).
func (m *MySQL) arrive(now int64) {
	i := 0
	for ; i < len(m.inflight) && m.inflight[i].at <= now; i++ {
		m.inflight[i].apply(m.inflight[i].at)
		m.applied++
	}
	if i > 0 {
		m.inflight = append(m.inflight[:0], m.inflight[i:]...)
		if m.applied > 4096 {
			m.applied = 0
			m.compact()
		}
	}
}

// begin locks m and applies the writes that reached the primary by now,
// which it returns: every statement and look at the tables starts so. The
// caller unlocks.
func (m *MySQL) begin() (now int64) {
	m.mu.Lock()
	now = m.now()
	m.arrive(now)
	return now
}

// send queues a write to land at at (m.mu held).
func (m *MySQL) send(at int64, apply func(at int64)) {
	m.seq++
	w := inflight{at: at, seq: m.seq, apply: apply}
	i := sort.Search(len(m.inflight), func(i int) bool { return m.inflight[i].at > at })
	m.inflight = append(m.inflight, inflight{})
	copy(m.inflight[i+1:], m.inflight[i:])
	m.inflight[i] = w
}

// primaryDown reports whether the primary is down at at.
func (m *MySQL) primaryDown(at int64) bool {
	for _, s := range m.down {
		if s.Has(at) {
			return true
		}
	}
	return false
}

// oldestView is the oldest time any replica may still read as of.
func (m *MySQL) oldestView(now int64) int64 {
	t := now
	for _, r := range m.regions {
		if r.Replica {
			t = min(t, r.replicaAt)
		}
	}
	return t
}

// replicaView moves region r's replica on and returns the time it has
// applied the primary's changes up to (m.mu held).
func (m *MySQL) replicaView(r *MySQLRegion, now int64) int64 {
	if r.ToPrimary.Down(now) {
		return r.replicaAt // cut off: the replica applies nothing
	}
	if now >= r.lagUntil {
		r.lag, r.lagUntil = int64(r.Lag.Sample(m.rng)), now+max(lagHold, int64(10*r.Lag.Median))
	}
	at := max(r.replicaAt, now-r.lag)
	r.replicaAt = min(at, now)
	return r.replicaAt
}

// mysqlClient is one process's store.
type mysqlClient struct {
	m    *MySQL
	r    *MySQLRegion
	tick *Tick
}

var _ propagation.Store = (*mysqlClient)(nil)

// toPrimary draws a statement to the primary: when it arrives there, or
// an error. The caller holds m.mu.
func (c *mysqlClient) toPrimary(now int64) (at int64, applied bool, err error) {
	m := c.m
	sent := c.sentAt(now)
	lat, applied, err := c.r.ToPrimary.call(m.rng, sent, m.timeout)
	if err == nil && m.primaryDown(sent) {
		// Refused at once: a round trip, nothing run.
		lat, applied, err = min(lat, m.timeout), false, ErrDown
	}
	at = c.tick.add(lat, m.timeout)
	if at == 0 {
		at = now
	}
	return at, applied, err
}

// sentAt is when a statement of the iteration under way leaves: after
// the calls it has made so far, which may have taken seconds (each one
// cut off takes mysql_timeout). A partition or an outage judges the
// statement then, not when the iteration began: an iteration begun
// during a cut whose statements outlast it gets through with the rest.
func (c *mysqlClient) sentAt(now int64) int64 {
	if c.tick == nil {
		return now
	}
	return max(now, c.tick.At())
}

func (c *mysqlClient) Migrate(context.Context) error { return nil }

func (c *mysqlClient) Close() error { return nil }

func (c *mysqlClient) UpsertDenials(_ context.Context, rows []*propagation.BlocklistRow) error {
	batch := sortedCopy(rows, keyOf)
	return c.write(len(batch), func(at int64) {
		for i := range batch {
			c.m.tables[propagation.Denials].upsertDenial(&batch[i], at)
		}
	})
}

func (c *mysqlClient) UpsertCounts(_ context.Context, rows []*propagation.CountRow) error {
	batch := sortedCopy(rows, countKey)
	return c.write(len(batch), func(at int64) {
		for i := range batch {
			c.m.tables[propagation.Counts].upsertCount(&batch[i], at)
		}
	})
}

// sortedCopy copies a statement's rows, which land after the call returns
// and its caller may reuse them, in unique-key order, the order the real
// store sends a batch in (propagation/store.go) and so the order its
// versions take in the change log.
func sortedCopy[R any](rows []*R, key func(*R) rowKey) []R {
	batch := make([]R, len(rows))
	for i, r := range rows {
		batch[i] = *r
	}
	sort.Slice(batch, func(i, j int) bool { return key(&batch[i]).less(key(&batch[j])) })
	return batch
}

// write sends an upsert of n rows to the primary; apply runs when it
// arrives there. The rows count as written once the primary ran the
// statement, even when its answer came too late for the caller.
func (c *mysqlClient) write(n int, apply func(at int64)) error {
	return c.onPrimary(func(_, at int64) {
		c.r.Cost.RowsWritten += int64(n)
		c.m.send(at, apply)
	})
}

// onPrimary runs one statement on the primary: it applies the writes that
// arrived by now, draws the statement's fate, and when the primary ran it
// calls run with now and the time the statement arrives. It returns the
// statement's error for the caller, which a statement that ran may still
// have (a late answer).
func (c *mysqlClient) onPrimary(run func(now, at int64)) error {
	now := c.m.begin()
	defer c.m.mu.Unlock()
	at, applied, err := c.toPrimary(now)
	c.counted(applied, err)
	if applied {
		run(now, at)
	}
	return err
}

// counted counts a statement sent to the primary.
func (c *mysqlClient) counted(applied bool, err error) {
	if applied {
		c.r.Cost.Statements++
	}
	if err != nil {
		c.r.Cost.Errors++
	}
}

// toReplica draws a statement to the region's replica and counts it: a
// statement the replica ran, or else an error. The caller holds m.mu.
func (c *mysqlClient) toReplica(now int64) (applied bool, err error) {
	lat, applied, err := c.r.Local.call(c.m.rng, c.sentAt(now), c.m.timeout)
	c.tick.add(lat, c.m.timeout)
	if !applied {
		c.r.Cost.Errors++
		return false, err
	}
	c.r.Cost.ReplicaStatements++
	return true, err
}

// readAt draws a read: the view it reads as of, and where the statement
// is counted. The caller holds m.mu.
func (c *mysqlClient) readAt(now int64) (asOf int64, replica bool, err error) {
	if c.r.Replica {
		applied, err := c.toReplica(now)
		if !applied {
			return 0, true, err
		}
		return c.m.replicaView(c.r, now), true, err
	}
	_, applied, err := c.toPrimary(now)
	c.counted(applied, err)
	if !applied {
		return 0, false, err
	}
	return now, false, err
}

func (c *mysqlClient) ReadCounts(_ context.Context, r propagation.Read) ([]propagation.CountRow, error) {
	return readRows(c, propagation.Counts, r, func(k rowKey, v *version) propagation.CountRow {
		return propagation.CountRow{Namespace: k.ns, Identifier: k.id, WindowMs: k.w, Sequence: k.seq, Region: k.region,
			Count: v.count, ResetVersion: v.ver, ResetBase: v.base, ExpiresMs: v.expires, UpdatedMs: v.updated}
	})
}

func (c *mysqlClient) ReadDenials(_ context.Context, r propagation.Read) ([]propagation.BlocklistRow, error) {
	return readRows(c, propagation.Denials, r, func(k rowKey, v *version) propagation.BlocklistRow {
		return propagation.BlocklistRow{Namespace: k.ns, Identifier: k.id, WindowMs: k.w, Sequence: k.seq, Region: k.region,
			Limit: v.limit, CountCur: v.cur, CountPrev: v.prev, ExpiresMs: v.expires, UpdatedMs: v.updated}
	})
}

// UpsertOverrides is one statement; the model keeps no overrides.
func (c *mysqlClient) UpsertOverrides(_ context.Context, rows []*propagation.OverrideRow) error {
	return c.write(len(rows), func(int64) {})
}

// ReadOverrides is one page of a pull of the overrides table, which the
// model keeps empty: a statement that reads no row.
func (c *mysqlClient) ReadOverrides(_ context.Context, r propagation.Read) ([]propagation.OverrideRow, error) {
	_, err := c.read(propagation.Overrides, r)
	return nil, err
}

// MarkResetCounts is one statement, as the store's, whose rows land when
// it arrives: it says 0 marked. The model keeps no overrides, so no pull
// of it hears of a reset to mark.
func (c *mysqlClient) MarkResetCounts(_ context.Context, region, namespace, identifier string, ver int64) (int64, error) {
	return 0, c.write(0, func(at int64) {
		c.m.tables[propagation.Counts].markReset(region, namespace, identifier, ver, at)
	})
}

// Interface guard.
var _ propagation.OverrideStore = (*mysqlClient)(nil)

// readRows runs one page of a pull of table t and returns its versions as
// the store's rows, made by row.
func readRows[R any](c *mysqlClient, t propagation.Table, r propagation.Read, row func(rowKey, *version) R) ([]R, error) {
	vs, err := c.read(t, r)
	out := make([]R, len(vs))
	for i, v := range vs {
		out[i] = row(v.row.key, v)
	}
	return out, err
}

// read runs one page of a pull on the region's replica or the primary.
func (c *mysqlClient) read(t propagation.Table, r propagation.Read) ([]*version, error) {
	m := c.m
	now := m.begin()
	defer m.mu.Unlock()
	asOf, replica, err := c.readAt(now)
	if asOf == 0 {
		return nil, err
	}
	var out []*version
	var examined int64
	if r.Changed {
		out, examined = m.tables[t].changes(r, asOf)
	} else {
		out, examined = m.tables[t].whole(r, asOf, m.oldestView(now))
	}
	if replica {
		c.r.Cost.ReplicaRowsRead += examined
	} else {
		c.r.Cost.RowsRead += examined
	}
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (c *mysqlClient) DeleteExpired(_ context.Context, t propagation.Table, now int64, chunk int) (int64, error) {
	var n int64
	err := c.onPrimary(func(sent, at int64) {
		// Expired by the node's clock and the database's, as the store's
		// statement has it.
		n = c.m.tables[t].deleteExpired(min(now, at), chunk, sent)
		c.r.Cost.RowsWritten += n
		c.r.Cost.RowsRead += n
	})
	if err != nil {
		return 0, err
	}
	return n, nil
}

// Clock is the holder's read of the database's clock at each global sync
// (propagation.ClockStore, SELECT of NOW(3)): one statement on the
// primary, whichever database the region pulls from, that reads no row.
// It returns the primary's clock when the statement arrives there, the
// clock that stamps updated_ms.
func (c *mysqlClient) Clock(context.Context) (int64, error) {
	var ms int64
	if err := c.onPrimary(func(_, at int64) { ms = at }); err != nil {
		return 0, err
	}
	return ms, nil
}

var _ propagation.ClockStore = (*mysqlClient)(nil)

func (c *mysqlClient) ReplicaLag(context.Context) (time.Duration, bool, error) {
	if !c.r.Replica {
		return 0, false, nil
	}
	m := c.m
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	applied, err := c.toReplica(now)
	if !applied {
		return 0, false, err
	}
	if c.r.ToPrimary.Down(now) {
		return 0, false, err // the replica's I/O thread is cut off: NULL
	}
	at := m.replicaView(c.r, now)
	return time.Duration((now-at)/1000) * time.Second, true, err
}

// Sub subtracts o from c.
func (c *MySQLCost) Sub(o MySQLCost) {
	c.Statements -= o.Statements
	c.RowsRead -= o.RowsRead
	c.ReplicaStatements -= o.ReplicaStatements
	c.ReplicaRowsRead -= o.ReplicaRowsRead
	c.RowsWritten -= o.RowsWritten
	c.Errors -= o.Errors
}
