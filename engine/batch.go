package engine

import "context"

// DecideMany decides several limits all-or-nothing: every cost is reserved
// speculatively, and either every reservation commits (the request passes
// every limit) or every one is rolled back, so a denial by one limit charges
// no other. out[i] receives limit i's own verdict; len(out) must be at least
// len(ls). It reports whether the request passes.
//
// With an origin, the limits' reads are made in parallel and waited for
// together, within one read timeout. A batch does not reserve at the
// origin: a shared limit near its limit reads the origin's count (a check
// without charging) and its units reach the origin by replay, on the fast
// tick. So a batch can admit past a limit by what other processes admit
// between that read and their next replay (see the README's accuracy
// bound).
func (e *Engine) DecideMany(ctx context.Context, ls []Limit, out []Decision) bool {
	if len(ls) == 1 {
		out[0] = e.Decide(ctx, ls[0])
		return out[0].Allowed
	}
	var stack [8]located
	lcs := stack[:0]
	if len(ls) > len(stack) {
		lcs = make([]located, len(ls))
	}
	lcs = lcs[:len(ls)]
	now := e.nowMs()
	o := e.getOrigin()
	linked := o != nil || e.linkAll.Load()
	for i := range ls {
		clampLimit(&ls[i])
		e.locate(&lcs[i], &ls[i], now, linked)
	}
	if o != nil {
		e.convergeAll(ctx, o, lcs, ls, now)
	}
	reserved := 0
	for i := range ls {
		if !e.reserve(&lcs[i], &ls[i]) {
			break
		}
		reserved++
	}
	if reserved < len(ls) {
		rollBack(lcs[:reserved], ls[:reserved])
		e.refused(lcs, ls, out)
		return false
	}
	e.commitAll(lcs, ls, out)
	return true
}

// rollBack gives back the reservations of lcs, whose limits are ls. It
// runs before any verdict is written, so that a limit's Remaining shows
// the state without this request. spec first: a merge that saw count
// without the units but spec with them would add them back for good.
func rollBack(lcs []located, ls []Limit) {
	for i := range lcs {
		lcs[i].cur.spec.Add(-ls[i].Cost)
		if testHookRollback != nil {
			testHookRollback(lcs[i].cur)
		}
		lcs[i].cur.count.Add(-ls[i].Cost)
	}
}

// refused writes to out the verdicts of a batch that does not pass, each
// limit's own, on the counts without the batch's units.
func (e *Engine) refused(lcs []located, ls []Limit, out []Decision) {
	for i := range ls {
		lc := &lcs[i]
		_, cur, prev := lc.snapshot()
		ok := fits(cur, prev, ls[i].Cost, ls[i].Limit, lc.w, lc.r)
		if !ok && !ls[i].DryRun {
			e.deny(&out[i], lc, &ls[i], cur, prev)
			continue
		}
		// A dry-run limit reports its verdict and records nothing.
		lc.passed(&out[i], ls[i].Limit, cur, prev)
		if !ok {
			out[i].Allowed = false
			out[i].RetryAfter = lc.retryAfter(cur, prev, ls[i].Cost, ls[i].Limit)
		}
	}
}

// commitAll commits the reservations of a batch that passes, queues their
// units for replay and writes the verdicts to out.
func (e *Engine) commitAll(lcs []located, ls []Limit, out []Decision) {
	for i := range ls {
		lc := &lcs[i]
		// Commit: the reservation stops being speculative. count already
		// holds it, so the committed count only grows.
		lc.cur.spec.Add(-ls[i].Cost)
		_, cur, prev := lc.snapshot()
		e.committed(lc, ls[i].Cost, SatAdd(cur, weighted(prev, lc.w, lc.r)), ls[i].Limit)
		lc.passed(&out[i], ls[i].Limit, cur, prev)
		if lc.wouldDeny {
			out[i].Allowed = false
			out[i].RetryAfter = lc.dryRetry
		}
	}
}

// reserve adds l's cost to the cell's count as a speculative reservation
// if it fits, or in any case for a dry run (which records the denial it
// would have been in lc).
func (e *Engine) reserve(lc *located, l *Limit) bool {
	// spec first: a reader that sees the count raised also sees it marked
	// speculative, so nothing replays a reservation that may roll back.
	lc.cur.spec.Add(l.Cost)
	for {
		n, cur, prev := lc.snapshot()
		ok := fits(cur, prev, l.Cost, l.Limit, lc.w, lc.r)
		if !ok && !l.DryRun {
			lc.cur.spec.Add(-l.Cost)
			return false
		}
		if charge(lc.cur, n, l.Cost) {
			lc.wouldDeny = !ok
			if !ok {
				lc.dryRetry = lc.retryAfter(cur, prev, l.Cost, l.Limit)
			}
			return true
		}
	}
}

// testHookRollback, set by tests, runs between the two steps of a rollback.
var testHookRollback func(c *cell)
