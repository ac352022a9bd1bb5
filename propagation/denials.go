package propagation

import (
	"context"
	"slices"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Denial gossip: a cell's first denial becomes a row of
// ratelimit_blocklist with the region's counts of the cell and of the one
// before it. A process of its own region writes its rows; the nodes of a
// region leave theirs in the region (member.go) and the holder writes
// them.

// drainDenials moves the queued first denials into rows (the lock that
// guards rows is held).
func (p *Propagator) drainDenials(rows map[Cell]*BlocklistRow) {
	for {
		select {
		case d := <-p.denials:
			p.addDenial(rows, d)
		default:
			return
		}
	}
}

// addDenial merges a first denial into rows, keyed by the row's cell: a
// later denial of the same cell raises its counts.
func (p *Propagator) addDenial(rows map[Cell]*BlocklistRow, d engine.GlobalDenial) {
	w := d.Window.Milliseconds()
	c := Cell{d.Namespace, p.rowID(d.Identifier), w, d.Sequence}
	if r := rows[c]; r != nil {
		n := *r
		n.CountCur, n.CountPrev = max(n.CountCur, d.Cur), max(n.CountPrev, d.Prev)
		n.Limit = d.Limit.Limit
		rows[c] = &n
		return
	}
	if len(rows) >= maxPendingDenials {
		p.stats.denialQueueDrops.Add(1)
		return
	}
	rows[c] = &BlocklistRow{
		Namespace: c.Namespace, Identifier: c.Identifier, WindowMs: w, Sequence: d.Sequence,
		Region: p.cfg.Region, Limit: d.Limit.Limit, CountCur: d.Cur, CountPrev: d.Prev,
		ExpiresMs: expiresMs(d.Sequence, w),
	}
}

// mergeDenial merges a row into the pending ones (p.mu held), and
// reports false when they are full and it was dropped.
func (p *Propagator) mergeDenial(r BlocklistRow) bool {
	c := r.cell()
	if cur := p.pending[c]; cur != nil {
		r.CountCur, r.CountPrev = max(r.CountCur, cur.CountCur), max(r.CountPrev, cur.CountPrev)
		r.ExpiresMs = max(r.ExpiresMs, cur.ExpiresMs)
	} else if len(p.pending) >= maxPendingDenials {
		p.stats.denialQueueDrops.Add(1)
		return false
	}
	p.pending[c] = &r
	return true
}

// takeDenials takes the rows the region's nodes left, to write them. They
// stay in the region until written, so a holder that dies first leaves
// them to the next. A row the pending ones have no room for stays there
// for a later take, and is not remembered as taken; one that expired
// there is removed at once. The rows past the bound were remembered and
// never removed, expired or not: the region's hashes (without expiry)
// and the holder's memory grew with every flood of first denials that
// MySQL did not take as fast as it came
// (TestRole_DenialsPastTheBacklogLeaveTheRegionAtTheirExpiry).
func (p *Propagator) takeDenials(ctx context.Context) {
	var rows []BlocklistRow
	err := p.query(ctx, func(ctx context.Context) error {
		var err error
		rows, err = p.region.TakeDenials(ctx)
		return err
	})
	if err != nil {
		p.regionFailed("taking denial rows", err)
	}
	now := p.now().UnixMilli()
	var expired []BlocklistRow
	p.mu.Lock()
	for _, r := range rows {
		c := r.cell()
		_, pending := p.pending[c]
		switch {
		case !pending && r.ExpiresMs <= now:
			expired = append(expired, r)
			p.stats.denialsExpired.Add(1)
			continue
		case !pending && len(p.pending) >= maxPendingDenials:
			// Left in the region, not dropped: read again at the next
			// take, and counted not written once, at its expiry there.
			// Counted as a drop here, it was counted again at every
			// flush (TestRole_ARowPastTheBacklogIsCountedNotWrittenOnce).
			continue
		}
		if p.mergeDenial(r) {
			p.taken[c] = r
		}
	}
	p.mu.Unlock()
	if len(expired) > 0 {
		if err := p.query(ctx, func(ctx context.Context) error { return p.region.DenialsWritten(ctx, expired) }); err != nil {
			p.regionFailed("removing expired denial rows", err)
		}
	}
}

// writeDenials writes the pending denial rows, up to maxDenialBatches
// batches of Batch rows: rows past their expiry are dropped, and a failed
// write keeps the rest for the next tick. Rows taken from the region and
// written (or expired) are removed there.
func (p *Propagator) writeDenials(ctx context.Context) {
	now := p.now().UnixMilli()
	var done []BlocklistRow
	p.mu.Lock()
	if p.region == nil {
		p.drainDenials(p.pending)
	}
	rows := make([]*BlocklistRow, 0, len(p.pending))
	for c, r := range p.pending {
		if r.ExpiresMs <= now {
			delete(p.pending, c)
			done = p.doneTaken(done, c)
			p.stats.denialsExpired.Add(1)
			continue
		}
		rows = append(rows, r)
	}
	p.mu.Unlock()
	slices.SortFunc(rows, compareBlock)
	for i := 0; i < len(rows) && i < maxDenialBatches*p.cfg.Batch; i += p.cfg.Batch {
		batch := rows[i:min(i+p.cfg.Batch, len(rows))]
		if err := p.write(ctx, func(ctx context.Context) error { return p.store.UpsertDenials(ctx, batch) }); err != nil {
			p.writeFailed("denial rows", len(batch), err)
			break
		}
		done = p.denialsWritten(batch, done)
	}
	if len(done) > 0 && p.region != nil {
		if err := p.query(ctx, func(ctx context.Context) error { return p.region.DenialsWritten(ctx, done) }); err != nil {
			p.regionFailed("removing written denial rows", err)
		}
	}
}

// denialsWritten forgets the rows written, unless a newer row of the
// same cell came meanwhile, and returns done with the taken rows they
// were.
func (p *Propagator) denialsWritten(rows []*BlocklistRow, done []BlocklistRow) []BlocklistRow {
	p.stats.denialsEmitted.Add(int64(len(rows)))
	p.stats.lastPush.Store(p.now().UnixMilli())
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, r := range rows {
		// A newer row of the cell, merged meanwhile, stays pending, and
		// so does the region's copy of it.
		if c := r.cell(); p.pending[c] == r {
			delete(p.pending, c)
			done = p.doneTaken(done, c)
		}
		p.recentOut = appendRecent(p.recentOut, *r)
	}
	return done
}

// doneTaken appends the row taken from the region for c, if any, to done
// (p.mu held).
func (p *Propagator) doneTaken(done []BlocklistRow, c Cell) []BlocklistRow {
	if t, ok := p.taken[c]; ok {
		delete(p.taken, c)
		done = append(done, t)
	}
	return done
}

func appendRecent(s []BlocklistRow, r BlocklistRow) []BlocklistRow {
	if len(s) >= recentRows {
		s = append(s[:0], s[len(s)-recentRows+1:]...)
	}
	return append(s, r)
}

// Recent returns copies of the denial rows this process wrote and
// applied most recently, oldest first.
func (p *Propagator) Recent() (emitted, applied []BlocklistRow) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.recentOut), slices.Clone(p.recentIn)
}
