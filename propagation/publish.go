package propagation

import (
	"cmp"
	"context"
	"errors"
	"slices"

	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Published counts: the region's count of each cell worth publishing
// becomes a row of ratelimit_global_counts, hot cells on every flush and
// the others at each global sync, highest pressure first and at most
// Batch rows a flush. The holder publishes the region's totals, as its
// Redis holds them, of the cells its nodes registered; a process of its
// own region publishes what its engine counted.

// regCell is a registered cell, as the holder keeps it.
type regCell struct {
	limit, expires int64
	hot            bool
	// published is the count last written, publishedReset the reset
	// version written with it.
	published, publishedReset int64
	// shift and shiftVer: the region lost its mark of the global reset
	// shiftVer, whose base it had published as shift (see ownMark): what
	// the region counts since is published on top of that base.
	shift, shiftVer int64
}

// ownMark is a global reset this region published for a cell, as a
// whole read or a pull of changes brings its own row back: its version
// and its base (the region's count at its mark).
//
// A Redis restarted empty loses the cell and its marks, and the nodes
// send their cells again less what the reset took off: the region's
// count starts over from the units admitted since the reset. Its row
// only grows (GREATEST), so the holder that published that count alone,
// under no reset, left the row at its count before the restart less the
// old base, and the other regions missed what the region admitted since
// until its count passed the old one: up to that base (2 admitted since
// the reset, 1 in the row, in the root's
// TestReset_RedisRestartedEmptyAfterAGlobalResetPublishesItsUnits). Once
// the region's cell says an older reset than its row, the holder
// publishes its count on top of the row's base, under the row's reset,
// and keeps doing so for the cell (a later reset's base moves by it as
// well). A holder that took the role after a later reset was marked
// cannot tell, and publishes what the region holds.
type ownMark struct {
	ver, base, expires int64
}

// candidate is a cell due to be published.
type candidate struct {
	row      *CountRow
	pressure float64
	// at is the engine's cell, for a process of its own region.
	at engineCell
}

// takeRegistrations adds the cells the region's nodes registered to those
// the holder publishes: the new ones on every flush, every live one when
// it takes the role and at each whole read.
func (p *Propagator) takeRegistrations(ctx context.Context) {
	now := p.now().UnixMilli()
	p.mu.Lock()
	all := p.fullTake
	p.mu.Unlock()
	var cells []RegionCell
	err := p.query(ctx, func(ctx context.Context) error {
		var err error
		cells, err = p.region.TakeRegistered(ctx, all, now)
		return err
	})
	if err != nil {
		p.regionFailed("taking registered cells", err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case err != nil:
		// A take that failed may have emptied the queues it never read
		// the registrations of: the next take reads every one.
		p.fullTake = true
	case all:
		p.fullTake = false
	}
	for _, c := range cells {
		r := p.reg[c.Cell]
		if r == nil {
			if len(p.reg) >= maxRegistered {
				p.stats.registryDrops.Add(1)
				continue
			}
			r = new(regCell)
			p.reg[c.Cell] = r
		}
		r.limit, r.expires, r.hot = c.Limit, max(r.expires, c.Expires), r.hot || c.Hot
	}
}

// regionRead is what a holder's flush publishes: the registered cells
// due and the region's totals of them.
type regionRead struct {
	due    []Cell
	totals []RegionTotal
	// full: a global sync's push, which ends once it all was read and
	// written; pushes, the settings of fullPush it answers (see
	// publishScanned).
	full, ok bool
	pushes   int64
}

// readRegistered reads the region's totals of the registered cells due
// (the hot ones of the last two windows, or all at a global sync).
func (p *Propagator) readRegistered(ctx context.Context) *regionRead {
	now := p.now().UnixMilli()
	rd := new(regionRead)
	p.mu.Lock()
	rd.full, rd.pushes = p.fullPush, p.pushes
	if rd.full {
		p.registerImportedLocked(now)
	}
	for c, r := range p.reg {
		if r.expires <= now {
			delete(p.reg, c)
			continue
		}
		if rd.full || (r.hot && c.Sequence >= now/c.WindowMs-1) {
			rd.due = append(rd.due, c)
		}
	}
	p.mu.Unlock()
	rd.totals, rd.ok = p.regionTotals(ctx, rd.due)
	return rd
}

// registerImportedLocked adds to the cells the holder publishes those
// other regions count, whatever the region's count of them: a node
// registers a cell below publish_floor once its own view holds other
// regions' counts, but a key its nodes no longer see requests of is never
// read again there, and its units stayed unseen by the other regions for
// the rest of its window (TestRole_ACellBelowTheFloorIsPublishedOnce-
// AnotherRegionCountsIt). Their limit is unknown until a node registers
// them: published at each global sync, least pressed first.
func (p *Propagator) registerImportedLocked(now int64) {
	for c, ci := range p.imports {
		if p.reg[c] != nil || ci.expires <= now || ci.sum() <= 0 {
			continue
		}
		if len(p.reg) >= maxRegistered {
			p.stats.registryDrops.Add(1)
			return
		}
		p.reg[c] = &regCell{expires: ci.expires}
	}
}

// publishRegistered publishes the cells of rd that grew.
func (p *Propagator) publishRegistered(ctx context.Context, rd *regionRead) {
	due, totals := rd.due, rd.totals
	var cands []candidate
	p.mu.Lock()
	for i, c := range due {
		r, n := p.reg[c], totals[i]
		if r == nil {
			continue
		}
		// The region lost its mark of a reset it published (ownMark). A
		// read that failed says 0 of everything, and tells nothing.
		//
		// Or the region's mark is the row's, under a larger base: the
		// row's count was above the region's when it marked the reset (the
		// region lost units, restarted whole with its Redis emptied, and
		// MySQL took the row's count for the base: UpsertCounts,
		// MarkResetCounts), or another holder published on top of the
		// row's base before. What the region counts since its mark is
		// published on top of the row's base, which the row's count then
		// passes as the region admits.
		if o := p.own[c]; o != nil && r.shiftVer == 0 && n.Count > 0 {
			switch {
			case n.ResetVersion < o.ver:
				r.shift, r.shiftVer = o.base, o.ver
			case n.ResetVersion == o.ver && o.base > n.ResetBase:
				r.shift, r.shiftVer = o.base-n.ResetBase, o.ver
			}
		}
		count, ver, base := n.Count, max(n.ResetVersion, MarksResets), n.ResetBase
		if r.shiftVer > 0 {
			count = engine.SatAdd(count, r.shift)
			if n.ResetVersion < r.shiftVer {
				ver, base = r.shiftVer, r.shift
			} else {
				base = engine.SatAdd(base, r.shift)
			}
		}
		// A cell the region marked with a global reset is published
		// although its count did not move: its base is news.
		if count <= r.published && ver <= r.publishedReset {
			continue
		}
		if r.limit <= 0 && count == 0 && n.ResetVersion == 0 {
			continue // imported here, counted nothing: no row
		}
		// A cell registered for its imports alone has no limit yet
		// (registerImportedLocked): never hot, and last in line.
		pressure := 0.0
		if r.limit > 0 {
			level := engine.SatAdd(n.Count, p.importSum(c))
			r.hot = r.hot || level*2 >= r.limit
			pressure = float64(level) / float64(r.limit)
		}
		cands = append(cands, candidate{row: &CountRow{
			Namespace: c.Namespace, Identifier: c.Identifier, WindowMs: c.WindowMs, Sequence: c.Sequence,
			Region: p.cfg.Region, Count: count, ResetVersion: ver, ResetBase: base,
			ExpiresMs: expiresMs(c.Sequence, c.WindowMs),
		}, pressure: pressure})
	}
	p.mu.Unlock()
	written, more, err := p.writeCounts(ctx, cands)
	if err != nil {
		return
	}
	p.mu.Lock()
	for _, c := range written {
		if r := p.reg[c.row.cell()]; r != nil {
			r.published = max(r.published, c.row.Count)
			r.publishedReset = max(r.publishedReset, c.row.ResetVersion)
		}
	}
	if rd.full && rd.ok && !more && p.pushes == rd.pushes {
		p.fullPush = false
	}
	p.mu.Unlock()
}

// regionTotals reads the region's totals of cells, a chunk at a time; ok
// is false when a chunk failed (its totals read 0: nothing published).
func (p *Propagator) regionTotals(ctx context.Context, cells []Cell) ([]RegionTotal, bool) {
	out := make([]RegionTotal, len(cells))
	ok := true
	for lo := 0; lo < len(cells); lo += regionChunk {
		hi := min(lo+regionChunk, len(cells))
		err := p.query(ctx, func(ctx context.Context) error {
			t, err := p.region.Totals(ctx, cells[lo:hi])
			copy(out[lo:hi], t)
			return err
		})
		if err != nil {
			p.regionFailed("reading the region's totals", err)
			ok = false
		}
	}
	return out, ok
}

// importSum is what other regions counted in c (p.mu held).
func (p *Propagator) importSum(c Cell) int64 {
	if ci := p.imports[c]; ci != nil {
		return ci.sum()
	}
	return 0
}

// publishScanned publishes what a process of its own region counted: hot
// cells that grew on every flush, every cell worth it at a global sync.
// A whole push clears the flags only when nothing set them again while
// it ran: a global sync (its own goroutine) that saw another server
// under the DSN during the push once had its "publish every cell again"
// cleared by it, and a count that stood still never reached the new
// server (TestFailover_SeenDuringAWholePushStillPublishesEveryCellAgain).
func (p *Propagator) publishScanned(ctx context.Context) {
	p.mu.Lock()
	full, again, pushes := p.fullPush, p.republish, p.pushes
	p.mu.Unlock()
	var cands []candidate
	p.eng.ScanCells(p.cfg.MinWindow, func(v *engine.CellView) bool {
		worth, hot, pressure := p.worth(v)
		if !worth || (v.Regional <= v.Published && !again) || !(hot || full) {
			return true
		}
		w := v.Key.Window.Milliseconds()
		cands = append(cands, candidate{row: &CountRow{
			Namespace: v.Key.Namespace, Identifier: v.Key.Identifier, WindowMs: w, Sequence: v.Sequence,
			Region: p.cfg.Region, Count: engine.ClampCount(v.Regional), ExpiresMs: expiresMs(v.Sequence, w),
		}, pressure: pressure, at: engineCell{v.Key, v.Sequence}})
		return true
	})
	// Identifiers become the rows' only for the rows written: one HMAC
	// per row under identifier_secret, none per scanned cell.
	written, more, err := p.writeCounts(ctx, cands, func(c *candidate) { c.row.Identifier = p.rowID(c.row.Identifier) })
	if err != nil {
		return
	}
	// Only now: a failed write leaves the cells due for the next tick.
	for _, c := range written {
		p.eng.MarkPublished(c.at.key, c.at.seq, c.row.Count)
	}
	if full && !more {
		p.mu.Lock()
		if p.pushes == pushes {
			p.fullPush, p.republish = false, false
		}
		p.mu.Unlock()
	}
}

// writeCounts writes the Batch candidates of highest pressure (fix, if
// given, readies each row first) and returns them; more reports that some
// were left for the next flush.
func (p *Propagator) writeCounts(ctx context.Context, cands []candidate, fix ...func(*candidate)) (written []candidate, more bool, err error) {
	if len(cands) == 0 {
		return nil, false, nil
	}
	// Ties go in unique-key order, so the cells a full flush leaves for
	// the next one do not depend on map order.
	slices.SortFunc(cands, func(a, b candidate) int {
		return cmp.Or(cmp.Compare(b.pressure, a.pressure), compareCount(a.row, b.row))
	})
	more = len(cands) > p.cfg.Batch
	if more {
		cands = cands[:p.cfg.Batch]
	}
	rows := make([]*CountRow, len(cands))
	for i := range cands {
		for _, f := range fix {
			f(&cands[i])
		}
		rows[i] = cands[i].row
	}
	if err := p.write(ctx, func(ctx context.Context) error { return p.store.UpsertCounts(ctx, rows) }); err != nil {
		p.writeFailed("published counts", len(rows), err)
		return nil, more, err
	}
	p.stats.countsPublished.Add(int64(len(rows)))
	p.stats.lastPush.Store(p.now().UnixMilli())
	return cands, more, nil
}

// writeFailed counts and logs a failed write: one line per streak start,
// then one per hundred (the metrics count every dropped batch).
func (p *Propagator) writeFailed(what string, n int, err error) {
	if errors.Is(err, errLeaseLost) || p.stopped(err) {
		return
	}
	p.noteSchemaGone(err)
	p.stats.droppedBatches.Add(1)
	if c := p.stats.writeErrors.Add(1); c == 1 || c%100 == 0 {
		p.log.Warn("mysql write failed: batch dropped (decisions stand locally; rows are retried)",
			zap.String("what", what), zap.Int("rows", n), zap.String("database", p.addr),
			zap.Int64("write_errors", c), zap.Error(err))
	}
}
