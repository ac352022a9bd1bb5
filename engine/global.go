package engine

import (
	"strings"
	"sync/atomic"
	"time"
)

// The hooks of the cross-region layer (package propagation). That layer
// publishes each cell's regional count (what this region counted: the
// origin's totals and this process's committed units, never a count
// imported from another region, never a speculative reservation) and
// imports other regions' counts into the cell's global count, which
// decisions weigh but which is never replayed or published again.
//
// Everything here runs off the request path except the two Global
// callbacks, which run on it and must not block.

// Global is what the engine tells a cross-region layer.
type Global interface {
	// EntryCreated is called when key gets an entry (a first touch, or a
	// touch after the janitor dropped it), before the request that created
	// it is decided, with the current sequence. Imports waiting for the key
	// can be applied from here, so that its first request already weighs
	// them.
	EntryCreated(key Key, seq int64)
	// FirstDenial is called once per cell, when it denies its first
	// request, after Config.OnFirstDenial.
	FirstDenial(d GlobalDenial)
}

// GlobalDenial is a cell's first denial with the regional counts that a
// denial row carries.
type GlobalDenial struct {
	Denial
	// Cur and Prev are the regional counts of the denying cell and of the
	// cell before it (committed units only).
	Cur, Prev int64
	// RegionalUsed is the regional part of Denial.Used: Cur plus Prev
	// weighted as the denial weighed it, before the request's cost.
	RegionalUsed int64
}

type globalBox struct{ g Global }

// SetGlobal attaches the cross-region layer, or detaches it with nil.
func (e *Engine) SetGlobal(g Global) {
	if g == nil {
		e.global.Store(nil)
	} else {
		e.global.Store(&globalBox{g})
	}
	e.relink()
}

// swapGlobal replaces the cross-region layer with new only if it is old,
// and reports whether it did, so that a config detaching its layer on stop
// never undoes a newer config's.
func (e *Engine) swapGlobal(old, new Global) bool {
	for {
		cur := e.global.Load()
		if (cur == nil && old != nil) || (cur != nil && cur.g != old) {
			return false
		}
		var n *globalBox
		if new != nil {
			n = &globalBox{new}
		}
		if e.global.CompareAndSwap(cur, n) {
			e.relink()
			return true
		}
	}
}

// relink sets linkAll from what it stands for (see Engine.linkAll).
func (e *Engine) relink() {
	e.linkMu.Lock()
	defer e.linkMu.Unlock()
	e.linkAll.Store(e.global.Load() != nil || e.unsent.Load())
}

func (e *Engine) getGlobal() Global {
	if b := e.global.Load(); b != nil {
		return b.g
	}
	return nil
}

// entryCreated tells the cross-region layer about a new entry.
func (e *Engine) entryCreated(z *Zone, id string, seq int64) {
	if g := e.getGlobal(); g != nil {
		g.EntryCreated(z.key(id), seq)
	}
}

// globalDenial tells the cross-region layer about a cell's first denial;
// cur and prev are the weighed counts the denial was computed from.
func (e *Engine) globalDenial(lc *located, l *Limit, cur, prev int64) {
	g := e.getGlobal()
	if g == nil {
		return
	}
	var d GlobalDenial
	d.Limit = *l
	d.Key, d.Zone = lc.key(), lc.zone
	d.Sequence = lc.cur.seq()
	d.Used = SatAdd(cur, weighted(prev, lc.w, lc.r))
	d.Cur = lc.cur.committed()
	if p := lc.en.previous(lc.cur); p != nil {
		d.Prev = p.committed()
	}
	d.RegionalUsed = SatAdd(d.Cur, weighted(d.Prev, lc.w, lc.r))
	g.FirstDenial(d)
}

// CellView is one cell as the cross-region layer sees it.
type CellView struct {
	// Key and Sequence name the cell.
	Key      Key
	Sequence int64
	// Regional is the cell's committed regional count; Global the count
	// imported from other regions; Published the regional count last
	// published (see MarkPublished).
	Regional, Global, Published int64
	// Effective is the key's effective count now (current and weighted
	// previous cell, regional and global): the same for both cells of a
	// key, it measures the key's pressure.
	Effective int64
	// Limit is the limit of the key's last decision here (0 when none was
	// made: a cell made only by an import): the same for both cells.
	Limit int64
}

// ScanCells calls f with the current and the previous cell of every key
// whose window is at least minWindow, until f returns false. Cells that
// weigh nothing any more (older than the previous window) are skipped. The
// view is reused between calls: f must copy what it keeps.
func (e *Engine) ScanCells(minWindow time.Duration, f func(v *CellView) bool) {
	now := e.nowMs()
	var v CellView
	e.rangeZones(func(z *Zone) bool {
		if z.window < minWindow {
			return true
		}
		seq := now / z.w
		r := now - seq*z.w
		more := true
		z.entries.Range(func(id string, en *entry) bool {
			c := en.cur.Load()
			if c == tombstone || c.seq() < seq-1 {
				return true
			}
			var cur, prev *cell
			if c.seq() >= seq {
				cur, prev = c, en.previous(c)
			} else {
				prev = c
			}
			var eff, limit int64
			for _, x := range [2]*cell{cur, prev} {
				if xs := x.linksOrNil(); xs != nil && limit == 0 {
					limit = xs.limit.Load()
				}
			}
			if cur != nil {
				eff = cur.total()
			}
			if prev != nil {
				eff = SatAdd(eff, weighted(prev.total(), z.w, r))
			}
			for _, x := range [2]*cell{cur, prev} {
				if x == nil {
					continue
				}
				spec := x.spec.Load()
				v = CellView{
					Key:       z.key(id),
					Sequence:  x.seq(),
					Regional:  x.count.Load() - spec,
					Effective: eff,
					Limit:     limit,
				}
				if xs := x.links(); xs != nil {
					v.Global, v.Published = xs.global.Load(), xs.published.Load()
				}
				if more = f(&v); !more {
					return false
				}
			}
			return true
		})
		return more
	})
}

// findNormalized is findKey for identifiers that come back from the layer
// above: they were normalized already (a view's, a row's), and a hashed
// identifier must not be hashed a second time.
func (e *Engine) findNormalized(key Key) (*Zone, string, bool) {
	id := key.Identifier
	if len(id) > MaxIdentifierLen && !(len(id) == len(hashedPrefix)+64 && strings.HasPrefix(id, hashedPrefix)) {
		id = NormalizeIdentifier(id)
	}
	z, ok := e.lookupZone(key)
	return z, id, ok
}

// linkedCellAt returns the cell (key, seq) if this process holds it, as a
// linked cell: a plain cell is upgraded first (see upgrade).
func (e *Engine) linkedCellAt(key Key, seq int64) *cell {
	z, id, ok := e.findNormalized(key)
	if !ok {
		return nil
	}
	en, ok := z.entries.Load(id)
	if !ok {
		return nil
	}
	for {
		c, slot := en.cur.Load(), &en.cur
		if c != tombstone && c.seq() != seq {
			c, slot = en.previous(c), &en.prev
		}
		if c == nil || c == tombstone || c.seq() != seq {
			return nil
		}
		if c = e.link(z, id, en, slot, c); c != nil {
			return c
		}
	}
}

// MarkPublished records that the cell's regional count n has been
// published; the mark only grows. It reports whether the cell is held.
func (e *Engine) MarkPublished(key Key, seq, n int64) bool {
	c := e.linkedCellAt(key, seq)
	if c == nil {
		return false
	}
	raise(&c.links().published, n)
	return true
}

// RaiseRegional raises the cell's regional count to at least n, without
// adding pending units on top (n is a count this region already published,
// which may include them). It reports whether the cell is held. The cell
// is upgraded first, so that a plain cell keeps holding only this
// process's own units (see upgrade).
func (e *Engine) RaiseRegional(key Key, seq, n int64) bool {
	c := e.linkedCellAt(key, seq)
	if c == nil {
		return false
	}
	raise(&c.count, ClampCount(n))
	return true
}

// raise lifts a to at least v; counts here only ever grow.
func raise(a *atomic.Int64, v int64) {
	for {
		old := a.Load()
		if v <= old || a.CompareAndSwap(old, v) {
			return
		}
	}
}

// HasEntry reports whether the engine holds an entry for key.
func (e *Engine) HasEntry(key Key) bool {
	z, id, ok := e.findNormalized(key)
	if !ok {
		return false
	}
	en, ok := z.entries.Load(id)
	return ok && en.cur.Load() != tombstone
}

// ImportGlobal raises the global count of the cell (key, seq) to at least
// total: the sum of what other regions counted in it. With create, a key
// this process does not hold gets an entry (its zone must exist), so that
// a region that has not seen the key yet already weighs the others'
// counts. A cell is never rotated backwards: an import for a sequence
// older than the key's previous cell, or newer than the current sequence,
// is dropped. It reports whether the import was applied.
func (e *Engine) ImportGlobal(key Key, seq, total int64, create bool) bool {
	z, id, ok := e.findNormalized(key)
	if !ok || total <= 0 {
		return false
	}
	nowMs := e.nowMs()
	now := nowMs / z.w
	if seq > now || seq < now-1 {
		return false
	}
	// The cells made here are linked cells whatever the engine's layers:
	// they are made to hold a global count.
	for {
		en, ok := z.entries.Load(id)
		if !ok {
			if !create {
				return false
			}
			en = e.insert(z, id, now, nowMs, true)
		}
		cur, gone := en.current(seq, nowMs, true, e.origin.Load() == nil)
		if gone[0] != nil || gone[1] != nil {
			e.buryCells(z, en, gone)
		}
		if cur == nil {
			continue // dropped by the janitor meanwhile: look again
		}
		var c *cell
		slot := &en.cur
		switch {
		case cur.seq() == seq:
			c = cur
		case cur.seq() == seq+1:
			c, slot = e.previousFor(z, en, cur), &en.prev
		}
		if c == nil {
			return false
		}
		if c = e.link(z, id, en, slot, c); c == nil {
			continue // rotated or upgraded meanwhile: look again
		}
		raise(&c.links().global, ClampCount(total))
		return true
	}
}

// previousFor returns the cell before cur, creating it when the entry has
// none (a key first seen in the current window that other regions counted
// in the previous one).
func (e *Engine) previousFor(z *Zone, en *entry, cur *cell) *cell {
	if p := en.previous(cur); p != nil {
		return p
	}
	old := en.prev.Load()
	if old != nil && old.seq() >= cur.seq()-1 {
		return en.previous(cur)
	}
	n := newCell(cur.seq()-1, true)
	n.setBits(stRead)
	if en.cur.Load() == cur && en.prev.CompareAndSwap(old, n) {
		e.letGoPrevious(z, en, old)
		return n
	}
	return en.previous(cur)
}
