package propagation

import (
	"cmp"
	"context"
	"database/sql"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// FlushOnce is one flush tick: it writes pending denial rows, publishes
// the counts of cells at half their limit or more (and of every eligible
// cell when a global sync asked for it), and pulls the rows of the
// busiest cells by a targeted query. Each step is bounded by Batch rows.
func (p *Propagator) FlushOnce(ctx context.Context) {
	p.handDue()
	p.writeDenials(ctx)
	hot := p.pushCounts(ctx)
	p.pullCells(ctx, hot)
}

// writeDenials writes up to Batch denial rows: new first denials join the
// rows kept from failed writes, rows past their expiry are dropped, and a
// failed write keeps the rest for the next tick.
func (p *Propagator) writeDenials(ctx context.Context) {
	now := p.now().UnixMilli()
	p.mu.Lock()
drain:
	for {
		select {
		case d := <-p.denials:
			p.addDenial(d)
		default:
			break drain
		}
	}
	rows := make([]*BlocklistRow, 0, len(p.pending))
	for k, r := range p.pending {
		if r.ExpiresMs <= now {
			delete(p.pending, k)
			p.stats.denialsExpired.Add(1)
			continue
		}
		rows = append(rows, r)
	}
	p.mu.Unlock()
	if len(rows) == 0 {
		return
	}
	slices.SortFunc(rows, compareBlock)
	if len(rows) > p.cfg.Batch {
		rows = rows[:p.cfg.Batch]
	}
	// Rows hold row identifiers; pending is keyed by raw ones.
	out := make([]*BlocklistRow, len(rows))
	for i, r := range rows {
		c := *r
		c.Identifier = p.rowID(r.Identifier)
		out[i] = &c
	}
	err := p.write(ctx, func(ctx context.Context) error { return upsertBlocklist(ctx, p.db, out) })
	if err != nil {
		p.stats.droppedBatches.Add(1)
		p.stats.writeErrors.Add(1)
		p.logWriteError("denial rows", len(out), err)
		return
	}
	p.stats.denialsEmitted.Add(int64(len(out)))
	p.stats.lastPush.Store(p.now().UnixMilli())
	p.mu.Lock()
	for i, r := range rows {
		k := cellKey{r.Namespace, r.Identifier, r.WindowMs, r.Sequence}
		// A newer denial of the same cell (counts grew) stays pending.
		if cur := p.pending[k]; cur == r {
			delete(p.pending, k)
		}
		p.recentOut = appendRecent(p.recentOut, *out[i])
	}
	p.mu.Unlock()
}

// addDenial merges a first denial into the pending rows; p.mu is held.
func (p *Propagator) addDenial(d engine.GlobalDenial) {
	w := d.Window.Milliseconds()
	k := cellKey{d.Namespace, d.Identifier, w, d.Sequence}
	if r := p.pending[k]; r != nil {
		n := *r
		n.CountCur, n.CountPrev = max(n.CountCur, d.Cur), max(n.CountPrev, d.Prev)
		n.Limit = d.Limit.Limit
		p.pending[k] = &n
		return
	}
	if len(p.pending) >= maxPendingDenials {
		p.stats.denialQueueDrops.Add(1)
		return
	}
	p.pending[k] = &BlocklistRow{
		Namespace: d.Namespace, Identifier: d.Identifier, WindowMs: w, Sequence: d.Sequence,
		Region: p.cfg.Region, Limit: d.Limit.Limit, CountCur: d.Cur, CountPrev: d.Prev,
		ExpiresMs: expiresMs(d.Sequence, w),
	}
}

func appendRecent(s []BlocklistRow, r BlocklistRow) []BlocklistRow {
	if len(s) >= recentRows {
		s = append(s[:0], s[len(s)-recentRows+1:]...)
	}
	return append(s, r)
}

// candidate is a cell worth publishing or pulling.
type candidate struct {
	view     engine.CellView
	pressure float64
}

// pushCounts publishes up to Batch grown cells, highest pressure first,
// and returns the keys at half their limit or more (for the targeted
// pull), highest pressure first.
func (p *Propagator) pushCounts(ctx context.Context) []cellKey {
	p.mu.Lock()
	full := p.fullDue
	p.mu.Unlock()
	var push, hot []candidate
	floor := p.cfg.PublishFloor
	p.eng.ScanCells(p.cfg.MinWindow, func(v *engine.CellView) bool {
		// The limit the count was decided against: a zone may carry
		// different limits in different sites, and overrides.
		limit := v.Limit
		if limit <= 0 {
			return true
		}
		pressure := float64(v.Effective) / float64(limit)
		pressed := v.Effective*2 >= limit
		if pressed && v.Sequence == p.now().UnixMilli()/v.Key.Window.Milliseconds() {
			hot = append(hot, candidate{*v, pressure})
		}
		if v.Regional <= v.Published {
			return true
		}
		level := max(float64(v.Regional+v.Global), float64(v.Effective)) / float64(limit)
		if !pressed && !(full && (v.Global > 0 || level >= floor)) {
			return true
		}
		push = append(push, candidate{*v, pressure})
		return true
	})
	byPressure := func(a, b candidate) int { return cmp.Compare(b.pressure, a.pressure) }
	slices.SortFunc(hot, byPressure)
	if len(hot) > p.cfg.Batch {
		hot = hot[:p.cfg.Batch]
	}
	keys := make([]cellKey, len(hot))
	for i, c := range hot {
		keys[i] = cellKey{c.view.Key.Namespace, p.rowID(c.view.Key.Identifier), c.view.Key.Window.Milliseconds(), c.view.Sequence}
	}
	if len(push) == 0 {
		if full {
			p.mu.Lock()
			p.fullDue = false
			p.mu.Unlock()
		}
		return keys
	}
	slices.SortFunc(push, byPressure)
	more := len(push) > p.cfg.Batch
	if more {
		push = push[:p.cfg.Batch]
	}
	rows := make([]*CountRow, len(push))
	for i, c := range push {
		w := c.view.Key.Window.Milliseconds()
		rows[i] = &CountRow{
			Namespace: c.view.Key.Namespace, Identifier: p.rowID(c.view.Key.Identifier), WindowMs: w,
			Sequence: c.view.Sequence, Region: p.cfg.Region, Count: engine.ClampCount(c.view.Regional),
			ExpiresMs: expiresMs(c.view.Sequence, w),
		}
	}
	err := p.write(ctx, func(ctx context.Context) error { return upsertCounts(ctx, p.db, rows) })
	if err != nil {
		p.stats.droppedBatches.Add(1)
		p.stats.writeErrors.Add(1)
		p.logWriteError("published counts", len(rows), err)
		return keys
	}
	// Only now: a failed write leaves the cells due for the next tick.
	for _, c := range push {
		p.eng.MarkPublished(c.view.Key, c.view.Sequence, c.view.Regional)
	}
	p.stats.countsPublished.Add(int64(len(rows)))
	p.stats.lastPush.Store(p.now().UnixMilli())
	if full && !more {
		p.mu.Lock()
		p.fullDue = false
		p.mu.Unlock()
	}
	return keys
}

func (p *Propagator) logWriteError(what string, n int, err error) {
	// One line per streak start, then one per hundred: the metrics count
	// every dropped batch.
	if c := p.stats.writeErrors.Load(); c == 1 || c%100 == 0 {
		p.log.Warn("mysql write failed: batch dropped (decisions stand locally; rows are retried)",
			zap.String("what", what), zap.Int("rows", n), zap.String("database", p.addr),
			zap.Int64("write_errors", c), zap.Error(err))
	}
}

// pullCells reads both tables' rows of the given cells: the targeted pull
// of the busiest keys, so staleness near the limit is one flush.
func (p *Propagator) pullCells(ctx context.Context, cells []cellKey) {
	if len(cells) == 0 {
		return
	}
	now := p.now().UnixMilli()
	var counts []CountRow
	var blocks []BlocklistRow
	err := p.query(ctx, func(ctx context.Context) error {
		q, args := cellsQuery("ratelimit_global_counts", countColumns, cells)
		rs, err := p.db.QueryContext(ctx, q, args...)
		if err != nil {
			return err
		}
		if counts, err = scanCounts(rs); err != nil {
			return err
		}
		if p.cfg.NoDenialGossip {
			return nil
		}
		q, args = cellsQuery("ratelimit_blocklist", blocklistColumns, cells)
		if rs, err = p.db.QueryContext(ctx, q, args...); err != nil {
			return err
		}
		blocks, err = scanBlocklist(rs)
		return err
	})
	if err != nil {
		p.readFailed("targeted pull", err)
	}
	p.applyCounts(counts, now)
	p.applyBlocklist(blocks, now)
	if err == nil {
		p.stats.lastPull.Store(p.now().UnixMilli())
	}
}

func (p *Propagator) readFailed(what string, err error) {
	if c := p.stats.readErrors.Add(1); c == 1 || c%100 == 0 {
		p.log.Warn("mysql read failed: keeping the imported counts we have",
			zap.String("what", what), zap.String("database", p.addr), zap.Int64("read_errors", c), zap.Error(err))
	}
}

// GlobalSyncOnce reads every active published count, page by page, prunes
// what expired, and asks the next flush to publish every eligible cell.
func (p *Propagator) GlobalSyncOnce(ctx context.Context) {
	now := p.now().UnixMilli()
	if pullPages(p, ctx, "ratelimit_global_counts", countColumns, "region", "published counts", now,
		scanCounts, func(r CountRow) []any {
			return []any{[]byte(r.Namespace), []byte(r.Identifier), r.WindowMs, r.Sequence, []byte(r.Region)}
		}, func(rows []CountRow) { p.applyCounts(rows, now) }) {
		p.stats.lastPull.Store(p.now().UnixMilli())
	}
	p.prune(now)
	p.mu.Lock()
	p.fullDue = true
	p.mu.Unlock()
}

// BlocklistSyncOnce reads every active denial row, page by page.
func (p *Propagator) BlocklistSyncOnce(ctx context.Context) {
	if p.cfg.NoDenialGossip {
		return
	}
	now := p.now().UnixMilli()
	if pullPages(p, ctx, "ratelimit_blocklist", blocklistColumns, "origin_region", "denial rows", now,
		scanBlocklist, func(r BlocklistRow) []any {
			return []any{[]byte(r.Namespace), []byte(r.Identifier), r.WindowMs, r.Sequence, []byte(r.Region)}
		}, func(rows []BlocklistRow) { p.applyBlocklist(rows, now) }) {
		p.stats.lastBlocklistPull.Store(p.now().UnixMilli())
	}
}

// pullPages reads the active rows of table in unique-key order, a page at a
// time (at most maxPages), and hands each page to apply. It reports whether
// it read to the end; a failed read is logged and ends the pull, keeping
// what was imported.
func pullPages[T any](p *Propagator, ctx context.Context, table, columns, regionCol, what string, now int64,
	scan func(*sql.Rows) ([]T, error), key func(T) []any, apply func([]T)) bool {
	var after []any
	for page := 0; page < maxPages; page++ {
		var rows []T
		err := p.query(ctx, func(ctx context.Context) error {
			q, args := pageQuery(table, columns, regionCol, after, now, pageSize)
			rs, err := p.db.QueryContext(ctx, q, args...)
			if err != nil {
				return err
			}
			rows, err = scan(rs)
			return err
		})
		if err != nil {
			p.readFailed(what, err)
			return false
		}
		apply(rows)
		if len(rows) < pageSize {
			return true
		}
		after = key(rows[len(rows)-1])
	}
	return false
}

// CleanupOnce deletes expired rows of both tables in bounded chunks. Safe
// on every node at once: a row deleted twice is deleted once.
func (p *Propagator) CleanupOnce(ctx context.Context) int64 {
	now := p.now().UnixMilli()
	var total int64
	for _, table := range []string{"ratelimit_blocklist", "ratelimit_global_counts"} {
		for i := 0; i < cleanupMaxChunks; i++ {
			var n int64
			err := p.query(ctx, func(ctx context.Context) error {
				var err error
				n, err = deleteExpired(ctx, p.db, table, now, cleanupChunk)
				return err
			})
			if err != nil {
				p.readFailed("cleanup", err)
				break
			}
			total += n
			if n < cleanupChunk {
				break
			}
		}
	}
	p.stats.cleanupDeleted.Add(total)
	return total
}

// update is an import to hand to the engine once p.mu is released (the
// engine may call EntryCreated, which takes it).
type update struct {
	key      engine.Key
	seq, sum int64
	create   bool
	own      bool
	// wait: the key is not held here yet; the import waits in the map.
	wait bool
}

// applyCounts merges published counts into the import map.
func (p *Propagator) applyCounts(rows []CountRow, now int64) {
	if len(rows) == 0 {
		return
	}
	var ups []update
	for i := range rows {
		r := &rows[i]
		if r.ExpiresMs <= now || r.WindowMs < p.cfg.MinWindow.Milliseconds() {
			continue
		}
		// The lock is taken per row: EntryCreated takes it on the request
		// path and must never wait for a whole page.
		p.mu.Lock()
		u, ok := p.mergeLocked(cellKey{r.Namespace, r.Identifier, r.WindowMs, r.Sequence}, r.Region, r.Count, r.ExpiresMs)
		p.mu.Unlock()
		if ok {
			ups = append(ups, u)
			p.stats.countsApplied.Add(1)
		}
	}
	p.hand(ups)
}

// applyBlocklist merges denial rows: count_cur into the row's own
// sequence, count_prev into the one before.
func (p *Propagator) applyBlocklist(rows []BlocklistRow, now int64) {
	if len(rows) == 0 {
		return
	}
	var ups []update
	for i := range rows {
		r := &rows[i]
		if r.ExpiresMs <= now || r.WindowMs < p.cfg.MinWindow.Milliseconds() {
			continue
		}
		p.mu.Lock() // per row, as in applyCounts
		applied := false
		if u, ok := p.mergeLocked(cellKey{r.Namespace, r.Identifier, r.WindowMs, r.Sequence}, r.Region, r.CountCur, r.ExpiresMs); ok {
			ups, applied = append(ups, u), true
		}
		if r.CountPrev > 0 {
			if u, ok := p.mergeLocked(cellKey{r.Namespace, r.Identifier, r.WindowMs, r.Sequence - 1}, r.Region, r.CountPrev, r.ExpiresMs-r.WindowMs); ok {
				ups, applied = append(ups, u), true
			}
		}
		if applied && r.Region != p.cfg.Region {
			p.stats.denialsApplied.Add(1)
			p.recentIn = appendRecent(p.recentIn, *r)
		}
		p.mu.Unlock()
	}
	p.hand(ups)
}

// mergeLocked records that region counted n in cell k and returns the
// engine update it calls for, if the count is news. Own rows only raise
// the regional count; foreign ones are kept per region, and the cell's
// global count is their sum. p.mu is held.
func (p *Propagator) mergeLocked(k cellKey, region string, n, expires int64) (update, bool) {
	if n <= 0 {
		return update{}, false
	}
	raw, known := k.id, true
	if p.cfg.MapID != nil {
		raw, known = p.index[zoneID{k.ns, k.id, k.w}]
	}
	key := engine.Key{Namespace: k.ns, Identifier: raw, Window: time.Duration(k.w) * time.Millisecond}
	if region == p.cfg.Region {
		if !known {
			return update{}, false
		}
		return update{key: key, seq: k.seq, sum: n, own: true}, true
	}
	ci := p.imports[k]
	if ci == nil {
		if len(p.imports) >= maxImports {
			p.stats.importDrops.Add(1)
			return update{}, false
		}
		ci = &cellImport{regions: make(map[string]int64, 2), expires: expires}
		p.imports[k] = ci
		p.importCount.Store(int64(len(p.imports)))
	}
	if old, ok := ci.regions[region]; ok && old >= n {
		return update{}, false
	}
	ci.regions[region] = n
	ci.expires = max(ci.expires, expires)
	if !known {
		// Waits in the map until the key's entry is created here.
		return update{wait: true}, true
	}
	return update{key: key, seq: k.seq, sum: ci.sum(), create: p.cfg.MapID == nil}, true
}

// hand applies updates to the engine. An import for a window that has not
// begun on this node's clock (the other region's clock is ahead, or this
// one behind) waits until it begins here: the engine holds no cell ahead
// of its clock, and the count, recorded as imported, would not be news to
// the next pull.
func (p *Propagator) hand(ups []update) {
	now := p.now().UnixMilli()
	for _, u := range ups {
		if u.wait {
			continue
		}
		if u.own {
			p.eng.RaiseRegional(u.key, u.seq, u.sum)
			continue
		}
		if u.seq > now/u.key.Window.Milliseconds() {
			p.defer_(u)
			continue
		}
		p.eng.ImportGlobal(u.key, u.seq, u.sum, u.create)
	}
}

// defer_ keeps u, an import for a window ahead of this node's clock, for
// handDue; a later import of the same cell replaces it (sums only grow).
func (p *Propagator) defer_(u update) {
	k := cellKey{u.key.Namespace, u.key.Identifier, u.key.Window.Milliseconds(), u.seq}
	p.mu.Lock()
	if len(p.ahead) < maxImports {
		p.ahead[k] = u
	}
	p.mu.Unlock()
}

// handDue applies the imports kept for windows that have begun here since,
// and forgets those whose window has passed.
func (p *Propagator) handDue() {
	now := p.now().UnixMilli()
	var due []update
	p.mu.Lock()
	for k, u := range p.ahead {
		switch cur := now / k.w; {
		case u.seq <= cur-2:
			delete(p.ahead, k)
		case u.seq <= cur:
			due = append(due, u)
			delete(p.ahead, k)
		}
	}
	p.mu.Unlock()
	for _, u := range due {
		p.eng.ImportGlobal(u.key, u.seq, u.sum, u.create)
	}
}

// prune forgets expired imports and index entries of keys the engine no
// longer holds.
func (p *Propagator) prune(now int64) {
	p.mu.Lock()
	for k, ci := range p.imports {
		if ci.expires <= now {
			delete(p.imports, k)
		}
	}
	p.importCount.Store(int64(len(p.imports)))
	idx := make([]zoneID, 0, len(p.index))
	raws := make([]string, 0, len(p.index))
	for z, raw := range p.index {
		idx = append(idx, z)
		raws = append(raws, raw)
	}
	p.mu.Unlock()
	var gone []zoneID
	for i, z := range idx {
		if !p.eng.HasEntry(engine.Key{Namespace: z.ns, Identifier: raws[i], Window: time.Duration(z.w) * time.Millisecond}) {
			gone = append(gone, z)
		}
	}
	if len(gone) == 0 {
		return
	}
	p.mu.Lock()
	for _, z := range gone {
		delete(p.index, z)
	}
	p.mu.Unlock()
}

// ForeignCounts returns, for the cell (key, seq), what each foreign region
// counted, as imported; nil when nothing was.
func (p *Propagator) ForeignCounts(key engine.Key, seq int64) map[string]int64 {
	k := cellKey{key.Namespace, p.rowID(key.Identifier), key.Window.Milliseconds(), seq}
	p.mu.Lock()
	defer p.mu.Unlock()
	ci := p.imports[k]
	if ci == nil {
		return nil
	}
	out := make(map[string]int64, len(ci.regions))
	for r, n := range ci.regions {
		out[r] = n
	}
	return out
}

// Recent returns copies of the denial rows this node emitted and applied
// most recently, oldest first.
func (p *Propagator) Recent() (emitted, applied []BlocklistRow) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.recentOut), slices.Clone(p.recentIn)
}
