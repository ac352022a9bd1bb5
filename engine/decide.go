package engine

import (
	"context"
	"time"
)

// Denial describes the first denial of a cell.
type Denial struct {
	Limit
	// Sequence is the denying cell's sequence.
	Sequence int64
	// Used is the effective count before the request's cost.
	Used int64
}

// clampLimit bounds a limit's units to [0, MaxCount], so that no cost or
// limit, however hostile, can overflow the arithmetic or refund units.
func clampLimit(l *Limit) {
	if uint64(l.Cost) > MaxCount {
		l.Cost = ClampCount(l.Cost)
	}
	if uint64(l.Limit) > MaxCount {
		l.Limit = ClampCount(l.Limit)
	}
}

// charge adds cost to the cell's count if it still holds n, the count the
// verdict was computed from, and reports whether it did. A concurrent
// allow changes the count and forces a recomputation; global and previous
// counts are not part of the swap: they only grow, and a change there can
// only have made the verdict a little early, never admit past the count.
func charge(c *cell, n, cost int64) bool {
	return cost == 0 || c.count.CompareAndSwap(n, SatAdd(n, cost))
}

// Decide decides one limit and, when it allows, charges its cost. A denial
// never waits. With an origin, a cold or stale cell is read first, and a
// shared cell near its limit (or in strict mode) is decided at the origin;
// all of it within one read timeout, after which the decision is local.
//
// The steps below fill d in place rather than return a Decision each: a
// 40-byte result handed up through three calls was copied at each level,
// and each copy read back stores just made (a store-forwarding stall),
// which cost as much as the rest of a local decision.
func (e *Engine) Decide(ctx context.Context, l Limit) (d Decision) {
	clampLimit(&l)
	now := e.nowMs()
	o := e.getOrigin()
	linked := o != nil || e.linkAll.Load()
	var lc located
	if z, id := l.Zone, l.Identifier; !linked && z != nil && len(id) <= MaxIdentifierLen {
		// The path nearly every decision of a local engine takes, the
		// key's entry and its cell of now found, written out here rather
		// than through locate: lc is this frame's, so its fields are
		// stored without write barriers, and there is no call. c.seq() ≥ 0
		// leaves out a removed entry's tombstone, as in locate.
		if en, ok := z.entries.Load(id); ok {
			c, w := en.cur.Load(), z.w
			if s := c.seq(); s >= 0 && uint64(now-s*w) < uint64(w) {
				r := now - s*w
				lc.zone, lc.id, lc.en, lc.cur, lc.w, lc.r = z, id, en, c, w, r
				e.decideLocal(&d, &lc, &l)
				return d
			}
		}
	}
	e.decideLocated(ctx, &d, &l, o, now, linked)
	return d
}

// decideLocated is Decide past its fast path: the limit located (its entry
// made, its cell rotated or linked as needed), then decided locally or
// through the origin. Out of Decide, so that the fast path's frame holds
// neither the origin's deadline nor its deferred stop: a frame of 320
// bytes with a defer, before, for every decision.
//
//go:noinline
func (e *Engine) decideLocated(ctx context.Context, d *Decision, l *Limit, o Origin, now int64, linked bool) {
	var lc located
	e.locate(&lc, l, now, linked)
	if o == nil {
		e.decideLocal(d, &lc, l)
		return
	}
	var dl deadline
	defer dl.stop()
	for i := 0; ; i++ {
		if f := e.converge(o, &lc, l, now, false); f != nil {
			e.waitRead(ctx, &dl, &lc, f)
		}
		// The key's entry let go (forgotten, evicted) while this request
		// waited for a read or a reservation: its units were written, or
		// queued, and the entry in its place reads them. Charged to the
		// cell let go, the request would count where no read of the key
		// looks any more: the key's next entry admitted it again.
		relocate := i < maxRelocations
		if relocate && lc.en.cur.Load() == tombstone {
			e.locate(&lc, l, now, linked)
			continue
		}
		if e.decideAtOrigin(ctx, d, o, &lc, l, now, &dl, relocate) {
			return
		}
		e.locate(&lc, l, now, linked)
	}
}

// maxRelocations bounds how often a decision locates its key again after
// the key's entry was let go while it waited for a read.
const maxRelocations = 2

// decideLocal decides lc on local counts alone, into d.
func (e *Engine) decideLocal(d *Decision, lc *located, l *Limit) {
	for {
		n, cur, prev := lc.snapshot()
		ok := fits(cur, prev, l.Cost, l.Limit, lc.w, lc.r)
		if !ok && !l.DryRun {
			e.deny(d, lc, l, cur, prev)
			return
		}
		if charge(lc.cur, n, l.Cost) {
			e.allow(d, lc, l, ok, cur, prev)
			return
		}
	}
}

// allow builds, into d, the decision of a charged request and queues its
// units for replay. ok is the limit's verdict, false only for a dry run
// (charged because the request is served anyway, reported as the denial
// it would have been, recording nothing a denial records).
func (e *Engine) allow(d *Decision, lc *located, l *Limit, ok bool, cur, prev int64) {
	after := SatAdd(cur, l.Cost)
	// Without an origin, after one was let go, the units wait for the
	// next (see committed).
	if l.Cost != 0 && (e.origin.Load() != nil || e.unsent.Load()) {
		e.committed(lc, l.Cost, SatAdd(after, weighted(prev, lc.w, lc.r)), l.Limit)
	}
	lc.passed(d, l.Limit, after, prev)
	if !ok {
		d.Allowed = false
		d.RetryAfter = lc.retryAfter(cur, prev, l.Cost, l.Limit)
	}
}

// passed writes to d the decision of a request that passes limit, with the
// counts (cur, prev) after it.
func (lc *located) passed(d *Decision, limit, cur, prev int64) {
	d.Allowed = true
	d.Limit = limit
	d.Remaining = remaining(cur, prev, limit, lc.w, lc.r)
	d.Reset = lc.reset()
	d.RetryAfter = 0
}

// reset is the time until the end of lc's cell's window.
func (lc *located) reset() time.Duration { return msDuration(lc.w - lc.r + lc.ahead) }

// retryAfter is the Retry-After of a denial of lc at (cur, prev), or
// Never: counted from now, also when the cell's window has not begun
// (lc.ahead), for its counts weigh whole until it has.
func (lc *located) retryAfter(cur, prev, cost, limit int64) time.Duration {
	d := retryAfter(cur, prev, cost, limit, lc.w, lc.r)
	if d != Never && lc.ahead > 0 {
		d += msDuration(lc.ahead)
	}
	return d
}

// retryAfter is the Retry-After of a denial at (cur, prev), or Never.
func retryAfter(cur, prev, cost, limit, w, r int64) time.Duration {
	ra := retryAfterMs(cur, prev, cost, limit, w, r)
	if ra < 0 {
		return Never
	}
	// At least a millisecond even where the origin denied what the local
	// counts would pass (it weighs counts this process never saw).
	return msDuration(max(ra, 1))
}

// deny builds a denial into d and records what a denial records: strict
// mode and the cell's first denial. It never waits and never calls the
// origin. An oversized request, one whose cost is above the limit (no
// count lets it pass) or that meets the key under half its limit, is
// denied for its size, not for the key's use: it records neither, so it
// sends no later request of the key to the origin (strict mode) and the
// key's first denial at its limit is still counted, logged and written as
// a denial row (a cell writes one at most, and none for a region under
// half the limit).
func (e *Engine) deny(d *Decision, lc *located, l *Limit, cur, prev int64) {
	d.Allowed = false
	d.Limit = l.Limit
	d.Remaining = remaining(cur, prev, l.Limit, lc.w, lc.r)
	d.Reset = lc.reset()
	d.RetryAfter = lc.retryAfter(cur, prev, l.Cost, l.Limit)
	if l.Cost > l.Limit || d.Remaining > l.Limit/2 {
		return // oversized: the request's size, not the key's use
	}
	if e.origin.Load() != nil {
		e.markStrict(lc.zone, lc.id, lc.cur.seq()*lc.w+lc.r+lc.w, lc.cur.seq()*lc.w+lc.r-lc.ahead)
	}
	if lc.cur.state()&stBlocked == 0 && lc.cur.setBits(stBlocked) {
		e.firstDenial(lc, l, cur, prev)
	}
}

// firstDenial records the first denial of lc's cell: counted, notified
// (Config.OnFirstDenial) and handed to the cross-region layer. Out of
// deny, so that deny, which every denial runs, stays small.
func (e *Engine) firstDenial(lc *located, l *Limit, cur, prev int64) {
	e.stats.firstDenials.Add(1)
	if f := e.cfg.OnFirstDenial; f != nil {
		used := SatAdd(cur, weighted(prev, lc.w, lc.r))
		lim := *l
		lim.Key, lim.Zone = lc.key(), lc.zone
		f(Denial{Limit: lim, Sequence: lc.cur.seq(), Used: used})
	}
	e.globalDenial(lc, l, cur, prev)
}

// committed records cost committed units in the cell for replay; effective
// is the key's effective count with them, which picks the replay tier.
// A linked cell keeps its units pending without an origin too (a reload
// took Redis out): the janitor queues them once one is back, as it does
// units a full queue left.
func (e *Engine) committed(lc *located, cost, effective, limit int64) {
	if cost == 0 {
		return
	}
	x := lc.cur.links()
	if x == nil {
		// Located before the origin was set: the units are in the count,
		// which an upgrade hands over (see upgrade).
		return
	}
	x.pending.Add(cost)
	if e.origin.Load() == nil {
		// For an origin that comes back (sendUnsent), which finds the
		// cells entries hold and the graves. A rotation, eviction or
		// forget that let the cell go between the charge and this add (a
		// batch's reservation spans its other limits) saw no units in it
		// and remembered nothing; the add comes before this check and
		// their check after their swap, so one of the two sees the other
		// and buries it (once: stBuried). An origin set after the check
		// passed finds the units by its sendUnsent; one set before it is
		// seen here, and the cell is queued below.
		if !lc.en.holds(lc.cur) {
			e.buryCell(lc.zone, lc.en, lc.cur)
		}
		return
	}
	// The first units of a cell replay on the fast tick: a key that starts
	// on several processes at once is known to be shared within a tick. So
	// do units admitted on a view behind the region (see Engine.behind).
	fast := lc.cur.state()&stShared != 0 || x.own.Load() == 0 || lc.behind || pressureAtLeast(effective, limit, 1, 2)
	e.markDirty(lc.zone, lc.en, lc.cur, fast)
}

func msDuration(ms int64) time.Duration { return time.Duration(ms) * time.Millisecond }
