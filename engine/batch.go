package engine

import (
	"cmp"
	"context"
	"slices"
)

// DecideMany decides several limits all-or-nothing: every cost is reserved
// speculatively, and either every reservation commits (the request passes
// every limit) or every one is rolled back, so a denial by one limit charges
// no other. out[i] receives limit i's own verdict; len(out) must be at least
// len(ls). It reports whether the request passes.
//
// With an origin, the limits' reads are made in parallel and waited for
// together, within one read timeout. A limit that a lone Decide would
// decide at the origin (a shared or young cell in its last tenth, or in
// strict mode) is decided there here too, once every other limit of the
// batch fits: the batch then admits the request only if the origin did,
// and the others reserve after it; the one nearest its limit goes first.
// A limit the origin admitted stays charged if a later one of the batch
// denies (another limit at the origin, or a local one that a concurrent
// request filled meanwhile), and its Decision says so (ChargedAnyway): an
// over-count on the strict side, never an admission past a limit. Before,
// a batch only read the origin's count, so what the other processes had
// admitted and not replayed was never weighed: four processes in a burst
// took up to 4 × the limit (TestDecideMany_BurstOverProcesses).
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
		out[i].ChargedAnyway = false
		clampLimit(&ls[i])
		e.locate(&lcs[i], &ls[i], now, linked)
	}
	if o != nil {
		var dl deadline
		defer dl.stop()
		// A key let go while the batch waited for its read is decided in
		// the entry in its place, which reads again (as Decide does).
		for i := 0; ; i++ {
			e.convergeAll(ctx, o, lcs, ls, now, &dl, nil)
			if i >= maxRelocations || !e.relocateGone(lcs, ls, now, linked, nil) {
				break
			}
		}
		var flags [8]bool
		atOrigin := flags[:0]
		if len(ls) > len(flags) {
			atOrigin = make([]bool, len(ls))
		}
		atOrigin = atOrigin[:len(ls)]
		if e.originLimits(lcs, ls, now, atOrigin) {
			return e.decideManyAtOrigin(ctx, o, lcs, ls, out, now, &dl, atOrigin)
		}
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

// relocateGone locates again each limit of a batch whose key's entry was
// let go (forgotten, evicted) since it was located, and reports whether
// there was one: charged to the cell let go, the request would count
// where no read of the key looks any more. Limits marked in skip (nil:
// none) are left as they are.
func (e *Engine) relocateGone(lcs []located, ls []Limit, now int64, linked bool, skip []bool) bool {
	gone := false
	for i := range lcs {
		if skip != nil && skip[i] {
			continue
		}
		if lcs[i].en.cur.Load() == tombstone {
			e.locate(&lcs[i], &ls[i], now, linked)
			gone = true
		}
	}
	return gone
}

// originLimits marks in atOrigin the limits of a batch that Decide would
// decide at the origin now: a charge that fits locally, in a shared or
// young cell near its limit or in strict mode (see nearLimit). It reports
// whether there is one.
func (e *Engine) originLimits(lcs []located, ls []Limit, now int64, atOrigin []bool) bool {
	any := false
	for i := range ls {
		l := &ls[i]
		if l.Cost == 0 || l.DryRun {
			continue // they charge nothing, or whatever the origin says
		}
		_, cur, prev := lcs[i].snapshot()
		if !fits(cur, prev, l.Cost, l.Limit, lcs[i].w, lcs[i].r) {
			continue // denied locally: a denial never waits
		}
		if near, _ := e.nearLimit(&lcs[i], l, cur, prev, now); near {
			atOrigin[i], any = true, true
		}
	}
	return any
}

// decideManyAtOrigin is DecideMany when some limits (atOrigin) are to be
// decided at the origin. Every other limit must fit first (a denial never
// waits); then the marked ones are decided at the origin one after the
// other, each charged when admitted, within the batch's deadline; then the
// others reserve and commit as a batch does.
func (e *Engine) decideManyAtOrigin(ctx context.Context, o Origin, lcs []located, ls []Limit, out []Decision, now int64, dl *deadline, atOrigin []bool) bool {
	for i := range ls {
		if atOrigin[i] || ls[i].DryRun {
			continue
		}
		_, cur, prev := lcs[i].snapshot()
		if !fits(cur, prev, ls[i].Cost, ls[i].Limit, lcs[i].w, lcs[i].r) {
			e.refused(lcs, ls, out) // nothing charged yet
			return false
		}
	}
	// The limit nearest its limit first: the one most likely to deny is
	// decided before any other is charged.
	var stack [8]ranked
	order := stack[:0]
	for i := range ls {
		if atOrigin[i] {
			_, cur, prev := lcs[i].snapshot()
			used := SatAdd(SatAdd(cur, weighted(prev, lcs[i].w, lcs[i].r)), ls[i].Cost)
			order = append(order, ranked{i, float64(used) / float64(max(ls[i].Limit, 1))})
		}
	}
	slices.SortStableFunc(order, func(a, b ranked) int { return cmp.Compare(b.pressure, a.pressure) })
	for k, r := range order {
		e.decideAtOrigin(ctx, &out[r.i], o, &lcs[r.i], &ls[r.i], now, dl, false)
		if out[r.i].Allowed {
			continue
		}
		// The origin (or the local count it brought back) denied: the
		// limits it admitted before stay charged, the others charge
		// nothing.
		for _, d := range order[:k] {
			out[d.i].ChargedAnyway = true
		}
		for _, u := range order[k+1:] {
			e.refuse(&lcs[u.i], &ls[u.i], &out[u.i])
		}
		for j := range ls {
			if !atOrigin[j] {
				e.refuse(&lcs[j], &ls[j], &out[j])
			}
		}
		return false
	}
	// A key of the others let go while the origin decided: the limit is
	// decided in the entry in its place, which reads again, as before the
	// round trips (the origin's limits are decided, charged there).
	for i := 0; i < maxRelocations && e.relocateGone(lcs, ls, now, true, atOrigin); i++ {
		e.convergeAll(ctx, o, lcs, ls, now, dl, atOrigin)
	}
	for i := range ls {
		if atOrigin[i] {
			continue
		}
		if !e.reserve(&lcs[i], &ls[i]) {
			// A concurrent request took the room meanwhile.
			for j := 0; j < i; j++ {
				if !atOrigin[j] {
					rollBack(lcs[j:j+1], ls[j:j+1])
				}
			}
			for j := range ls {
				if atOrigin[j] {
					out[j].ChargedAnyway = true
				} else {
					e.refuse(&lcs[j], &ls[j], &out[j])
				}
			}
			return false
		}
	}
	for i := range ls {
		if !atOrigin[i] {
			e.commit(&lcs[i], &ls[i], &out[i])
		}
	}
	return true
}

// ranked is a limit of a batch (its index) and its pressure: the share of
// its limit its count and the request's cost take.
type ranked struct {
	i        int
	pressure float64
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
		e.refuse(&lcs[i], &ls[i], &out[i])
	}
}

// refuse writes to d the verdict of lc, a limit l of a batch that does not
// pass, on the counts without the batch's units.
func (e *Engine) refuse(lc *located, l *Limit, d *Decision) {
	_, cur, prev := lc.snapshot()
	ok := fits(cur, prev, l.Cost, l.Limit, lc.w, lc.r)
	if !ok && !l.DryRun {
		e.deny(d, lc, l, cur, prev)
		return
	}
	// A dry-run limit reports its verdict and records nothing.
	lc.passed(d, l.Limit, cur, prev)
	if !ok {
		d.Allowed = false
		d.RetryAfter = lc.retryAfter(cur, prev, l.Cost, l.Limit)
	}
}

// commitAll commits the reservations of a batch that passes, queues their
// units for replay and writes the verdicts to out.
func (e *Engine) commitAll(lcs []located, ls []Limit, out []Decision) {
	if testHookCommit != nil {
		testHookCommit()
	}
	for i := range ls {
		e.commit(&lcs[i], &ls[i], &out[i])
	}
}

// commit commits lc's reservation of l, queues its units for replay and
// writes its verdict to d.
func (e *Engine) commit(lc *located, l *Limit, d *Decision) {
	// Commit: the reservation stops being speculative. count already
	// holds it, so the committed count only grows.
	lc.cur.spec.Add(-l.Cost)
	_, cur, prev := lc.snapshot()
	e.committed(lc, l.Cost, SatAdd(cur, weighted(prev, lc.w, lc.r)), l.Limit)
	lc.passed(d, l.Limit, cur, prev)
	if lc.wouldDeny {
		d.Allowed = false
		d.RetryAfter = lc.dryRetry
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

// testHookCommit, set by tests, runs when a batch that passes has reserved
// every limit and commits none yet.
var testHookCommit func()
