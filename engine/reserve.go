package engine

import (
	"context"
	"time"
)

// The last tenth of a quota is decided at the origin. A cell that only this
// process touches decides locally at any pressure: nobody else adds to it.
// A shared cell cannot: the other processes' admissions of the last replay
// interval are not in this process's count yet, and two busy processes near
// a small limit would each admit what the other already had. So when a
// shared cell's effective count plus the others' expected growth until
// their units reach this process reaches 90 % of the limit (or the key is
// in strict mode), a request that would pass asks the origin, which admits
// it only if the region's count allows, and charges it in the same atomic
// step.
//
// At most one reservation per cell is in flight in a process; requests that
// arrive meanwhile wait for it and decide again on the totals it brought
// back. Denials never wait. On timeout, error or an open breaker the
// decision is local. The reservation carries this process's pending units
// too (as an idempotent write of its absolute total), so the origin judges
// the request against everything this process has admitted.

// nearLimit reports whether a would-allow decision of a shared cell at
// (cur, prev) must be made at the origin: in strict mode, or when the
// effective count with the cost plus the other processes' expected growth
// reaches 90 % of the limit.
func (e *Engine) nearLimit(lc *located, l *Limit, cur, prev, now int64) bool {
	c := lc.cur
	if c.state.Load()&stShared == 0 {
		return false
	}
	if strictUntil(lc.zone, lc.id) > now {
		return true
	}
	effective := SatAdd(SatAdd(cur, weighted(prev, lc.w, lc.r)), l.Cost)
	return pressureAtLeast(SatAdd(effective, e.foreignGrowth(lc, now)), l.Limit, 9, 10)
}

// foreignGrowth estimates the units other processes admit to lc's cell
// between this process's last view of the origin and the moment their
// units reach it: the growth seen between the last two origin answers (the
// others' admissions in about one replay interval), scaled by the age of
// the view in fast ticks, plus two ticks: the others' next replay, and a
// replay of theirs that a busy machine runs late.
func (e *Engine) foreignGrowth(lc *located, now int64) int64 {
	step := lc.cur.step.Load()
	if step <= 0 {
		return 0
	}
	tick := max(e.fastTickMs(), 1)
	ticks := int64(2)
	if seen := lc.cur.fresh.Load() - e.freshnessMs(); seen > 0 && now > seen {
		ticks += (now - seen) / tick
	}
	if step > MaxCount/ticks {
		return MaxCount
	}
	return step * ticks
}

// decideAtOrigin decides lc with an origin attached: locally, or for a
// shared cell near its limit at the origin, within the decision's deadline.
func (e *Engine) decideAtOrigin(ctx context.Context, o Origin, lc *located, l *Limit, now int64, dl *deadline) Decision {
	local := l.DryRun || l.Cost == 0 // they charge whatever the origin says, or nothing
	for {
		n, cur, prev := lc.snapshot()
		ok := fits(cur, prev, l.Cost, l.Limit, lc.w, lc.r)
		if !ok && !l.DryRun {
			return e.deny(lc, l, cur, prev)
		}
		if !local && e.nearLimit(lc, l, cur, prev, now) {
			if d, decided := e.reserveAtOrigin(ctx, o, lc, l, dl); decided {
				return d
			}
			// Joined another request's reservation, or the origin failed:
			// look again, locally once the deadline has passed.
			local = dl.expired
			continue
		}
		if charge(lc.cur, n, l.Cost) {
			return e.allow(lc, l, ok, cur, prev)
		}
	}
}

// reserveAtOrigin decides l at the origin, or waits for the reservation of
// the same cell already in flight. It reports whether it decided; when it
// did not, the caller decides again (dl.expired tells it to do so locally).
func (e *Engine) reserveAtOrigin(ctx context.Context, o Origin, lc *located, l *Limit, dl *deadline) (Decision, bool) {
	c := lc.cur
	if f, ok := e.reservations.Load(c); ok {
		e.stats.reservationWaits.Add(1)
		dl.wait(ctx, e, f.done)
		return Decision{}, false
	}
	f := &flight{done: make(chan struct{})}
	if _, loaded := e.reservations.LoadOrStore(c, f); loaded {
		return Decision{}, false // another request won the race: join it
	}
	defer func() {
		e.reservations.Delete(c)
		close(f.done)
	}()

	// Hand the origin every unit this process has admitted to the cell,
	// and the cost, as one absolute total. own rises first, so that a
	// flush overlapping the call never writes a total below it.
	d := c.pending.Swap(0)
	own := c.own.Add(d + l.Cost)
	r := Reservation{
		Key:      lc.key(),
		Sequence: c.seq,
		Own:      own - l.Cost,
		Cost:     l.Cost,
		Limit:    l.Limit,
		Elapsed:  lc.r,
		Global:   c.global.Load(),
	}
	if p := lc.en.previous(c); p != nil {
		r.GlobalPrev = p.global.Load()
	}
	dl.start(e)
	cctx, cancel := context.WithDeadline(ctx, dl.at)
	sent := e.nowMs()
	err := o.Reserve(cctx, &r)
	cancel()
	e.stats.reservations.Add(1)
	if err != nil {
		// Give everything back: the pending units replay as usual (a write
		// the origin did apply makes that replay a no-op), and the request
		// is decided locally.
		e.stats.reservationErrors.Add(1)
		c.own.Add(-(d + l.Cost))
		if d > 0 {
			c.pending.Add(d)
			e.markDirty(lc.zone, lc.id, c, true)
		}
		dl.expired = true
		return Decision{}, false
	}
	if time.Now().After(dl.at) {
		dl.expired = true
	}
	if !r.Admitted {
		e.stats.reservationsDenied.Add(1)
		c.own.Add(-l.Cost)
		e.merge(lc.en, c, r.Totals, sent)
		_, cur, prev := lc.snapshot()
		// The origin's verdict stands even if the local counts, which never
		// saw its previous cell, would let the request pass.
		cur = max(cur, SatAdd(r.Totals.Cur, r.Global))
		prev = max(prev, SatAdd(r.Totals.Prev, r.GlobalPrev))
		return e.deny(lc, l, cur, prev), true
	}
	e.stats.reservationsAdmitted.Add(1)
	addSat(&c.count, l.Cost)
	e.merge(lc.en, c, r.Totals, sent)
	_, cur, prev := lc.snapshot()
	return lc.passed(l.Limit, cur, prev), true
}
