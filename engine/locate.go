package engine

import (
	"sync/atomic"
	"time"
)

// located is one limit resolved to its cell at the time of the decision.
type located struct {
	zone *Zone
	id   string
	en   *entry
	cur  *cell
	w, r int64
	// ahead is how many milliseconds the cell's window begins after now:
	// 0, but for a cell one window ahead of a clock that stepped back
	// (r is 0 then). Nothing in the cell weighs less before it has passed,
	// so Reset and Retry-After count it.
	ahead int64
	// wouldDeny and dryRetry record, for a dry-run limit of a batch, the
	// denial it would have been.
	wouldDeny bool
	dryRetry  time.Duration
	// behind records that converge let the decision pass on a view behind
	// the region (see Engine.behind): its units replay on the fast tick.
	behind bool
	// started is a read of the cell this decision started and runs (see
	// Engine.waitRead), nil once it has.
	started *flight
	// noGrow: a read this decision starts does not grow the cell up (see
	// Engine.converge).
	noGrow bool
}

func (lc *located) key() Key { return lc.zone.key(lc.id) }

// locate finds (or creates) the entry of l and its current cell at now.
// With linked set (the engine has an origin or a global layer, whose
// counters only a linked cell holds) the cell is a linked cell: a plain
// cell made before is upgraded here, before the decision charges it.
//
// Nearly every decision finds the entry's current cell to be the cell of
// now: that is tested with one multiplication, and the sequence of now (a
// division) is computed only when it is not (see rotate).
func (e *Engine) locate(lc *located, l *Limit, now int64, linked bool) {
	z := l.Zone
	if z == nil {
		z = e.Zone(l.Namespace, l.Window)
	}
	id := l.Identifier
	if len(id) > MaxIdentifierLen {
		id = NormalizeIdentifier(id)
	}
	w := z.w
	for {
		en, ok := z.entries.Load(id)
		if !ok {
			en = e.insert(z, id, now/w, now, linked)
		}
		// c.seq() ≥ 0 leaves out the tombstone (and the truncated division
		// of a clock before 1970, which rotate handles as it always did).
		c := en.cur.Load()
		if c.seq() < 0 || uint64(now-c.seq()*w) >= uint64(w) {
			if c = e.rotate(z, id, en, now, w, linked); c == nil {
				continue
			}
		}
		if linked {
			if c = e.link(z, id, en, &en.cur, c); c == nil {
				continue
			}
			// The limit the count is decided against, for the cross-region
			// layer; written only when it changes.
			if x := c.links(); x != nil && x.limit.Load() != l.Limit {
				x.limit.Store(l.Limit)
			}
		}
		r, ahead := now-c.seq()*w, int64(0)
		if r < 0 {
			r, ahead = 0, -r
		}
		lc.zone, lc.id, lc.en, lc.cur, lc.w, lc.r, lc.ahead = z, id, en, c, w, r, ahead
		return
	}
}

// rotate returns en's cell for now when the current cell is not (the
// window has moved on, the clock stepped, or the entry was removed): the
// rotated cell, or a cell ahead of now, or a replacement of a cell more
// than a window ahead. nil: removed by the janitor between the load and
// the rotation, or rotated by another request meanwhile; look again, a
// fresh entry may already stand in its place.
func (e *Engine) rotate(z *Zone, id string, en *entry, now, w int64, linked bool) *cell {
	seq := now / w
	keep := e.origin.Load() == nil
	c, gone := en.current(seq, now, linked, keep)
	if gone[0] != nil || gone[1] != nil {
		e.buryCells(z, en, gone)
	}
	if c != nil && c.state()&stRead == 0 && e.origin.Load() == nil {
		c.setBits(stRead) // nothing to read: as insert marks a new entry's cell
	}
	if c != nil && c.seq() > seq+1 && e.nowMs()/w+1 < c.seq() {
		// More than a window ahead of a clock read just now: the clock
		// stepped back (a request that read it long ago finds the clock
		// past seq and keeps the cell).
		stale := c
		var dropped *cell
		c, dropped = en.replaceStale(c, seq, now, linked, keep)
		if c != nil {
			e.buryCell(z, en, stale)
		}
		if dropped != nil {
			// Its units, replayed or not, must come back should the
			// origin restart empty (see Resend).
			e.buryCell(z, en, dropped)
		}
		if c != nil && e.origin.Load() == nil {
			c.setBits(stRead) // as insert marks a new entry's cell
		}
	}
	return c
}

// insert adds a new entry for id, or returns the one that won a race. Its
// cell, for seq, is a linked cell made at now when linked is set.
// A key let go with units the origin lacks takes its cells back (see
// orphans).
func (e *Engine) insert(z *Zone, id string, seq, now int64, linked bool) *entry {
	var back [2]*cell
	if e.orphans.n.Load() > 0 {
		back = e.orphans.find(z.key(id))
	}
	en, loaded := z.entries.loadOrAdopt(id, seq, now, linked, e.origin.Load() == nil, back)
	if !loaded {
		if back[0] != nil {
			e.orphans.taken(z.key(id), back)
		}
		e.entryCreated(z, id, seq)
		if e.live.Add(1) > int64(e.cfg.MaxEntries) {
			select {
			case e.evictNow <- struct{}{}:
			default:
			}
		}
	}
	return en
}

// link returns c, which slot (en.cur or en.prev) holds, as a linked cell:
// c itself when it is one, else its upgrade (nil: look again).
func (e *Engine) link(z *Zone, id string, en *entry, slot *atomic.Pointer[cell], c *cell) *cell {
	if c.state()&stLinked != 0 {
		return c
	}
	return e.upgrade(z, id, en, slot, c)
}

// upgrade replaces c, a plain cell that slot (en.cur or en.prev) holds,
// with a linked copy and returns the copy; nil when slot no longer holds
// c (rotated, removed, or upgraded by another caller: look again).
//
// The copy is installed by compare-and-swap, then what was charged into c
// between the copy and the swap is added to it: count and spec are read
// again after the swap and their change added. A unit charged into c after
// that re-read is lost. Only a request that located c while the engine had
// neither origin nor global layer can still charge it then (every other
// one upgrades, or finds the upgrade, before it charges), and only in the
// nanoseconds between its lookup and its compare-and-swap: at most one
// request per goroutine that was in that window at the swap.
//
// A current cell upgraded while the engine has an origin hands its
// committed units over: they become pending and replay, as if they had
// been committed with the origin in place. A plain current cell holds only
// this process's units (nothing merges into it before its upgrade), so
// none is counted twice. A previous cell is not handed over: the origin's
// totals may have been merged into it, and it weighs less every moment.
func (e *Engine) upgrade(z *Zone, id string, en *entry, slot *atomic.Pointer[cell], c *cell) *cell {
	n := newCell(c.seq(), true)
	count, spec := c.count.Load(), c.spec.Load()
	n.count.Store(count)
	n.spec.Store(spec)
	n.orState(c.state()) // n is linked already
	if testHookUpgrade != nil {
		testHookUpgrade(c)
	}
	if !slot.CompareAndSwap(c, n) {
		return nil
	}
	count2, spec2 := c.count.Load(), c.spec.Load()
	if d := count2 - count; d > 0 {
		addSat(&n.count, d)
	} else if d < 0 {
		n.count.Add(d) // a batch rolled back
	}
	n.spec.Add(spec2 - spec)
	n.setBits(c.state() & stBlocked) // a first denial meanwhile
	if testHookUpgraded != nil {
		testHookUpgraded(n)
	}
	if slot == &en.cur && (e.origin.Load() != nil || e.unsent.Load()) {
		if u := count2 - spec2; u > 0 {
			n.links().pending.Add(u)
			if e.origin.Load() != nil {
				e.markDirty(z, en, n, true) // first units: the fast tick, as in committed
			} else if !en.holds(n) {
				// For the next origin (sendUnsent), which finds only held
				// and buried cells: let go since the swap, while it held
				// nothing (as in committed).
				e.buryCell(z, en, n)
			}
		}
	}
	return n
}

// snapshot returns the current cell's own count n, as a compare-and-swap
// must expect it, with the weighed counts derived from that same load.
func (lc *located) snapshot() (n, cur, prev int64) {
	n = lc.cur.count.Load()
	cur = SatAdd(n, lc.cur.globalCount())
	if p := lc.en.previous(lc.cur); p != nil {
		// p.total(), which is over the inlining budget.
		prev = SatAdd(p.count.Load(), p.globalCount())
	}
	return n, cur, prev
}

// testHookUpgrade, set by tests, runs in an upgrade between the copy of the
// plain cell c and the swap.
var testHookUpgrade func(c *cell)

// testHookUpgraded, set by tests, runs in an upgrade after the swap, before
// the copy's units are handed over.
var testHookUpgraded func(n *cell)
