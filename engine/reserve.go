package engine

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"
)

// The last tenth of a quota is decided at the origin. A cell that only this
// process touches decides locally at any pressure: nobody else adds to it.
// A shared cell cannot: the other processes' admissions of the last replay
// interval are not in this process's count yet, and two busy processes near
// a small limit would each admit what the other already had. So when a
// shared cell's effective count, plus the others' expected growth until
// their units reach this process, plus this process's own units that have
// not reached the origin yet once more (see nearLimit), reaches 90 % of
// the limit (or the key is in strict mode), a request that would pass asks
// the origin, which admits it only if the region's count allows, and
// charges it in the same atomic step, and so for two fast ticks after a
// reservation began. Whether a cell is touched by this process only is not
// known at once: processes that meet a key together each find only those
// that read it before them, so in a region of several processes a cell
// counts them all until an answer has come from after they met it (a
// young cell, see heard).
//
// At most one reservation per cell is in flight in a process; requests
// that arrive meanwhile form the next one, sent when it returns, which
// decides them all in one round trip (see group). Denials never wait. On
// timeout, error or an open breaker the decision is local. The reservation
// carries this process's pending units too (as an idempotent write of its
// absolute total), so the origin judges the request against everything
// this process has admitted.

// nearLimit reports whether a would-allow decision of a shared or young
// cell at (cur, prev) must be made at the origin: in strict mode, when the
// effective count with the cost, plus the other processes' expected
// growth, plus this process's units not yet handed over once more for
// each other process, reaches 90 % of the limit, for a young cell also
// when those units, counted once for each other process, reach a tenth of
// it, and for two fast ticks after a reservation so started (sticky). arms
// tells that the reservation starts those two ticks again: any reason but
// sticky. A batch (DecideMany) asks it of each limit, as Decide does.
func (e *Engine) nearLimit(lc *located, l *Limit, cur, prev, now int64) (near, arms bool) {
	c := lc.cur
	x := c.links()
	st := c.state()
	shared := st&stShared != 0
	// A young cell (see heard), in a region of several processes, may not
	// know yet of every process that met its key at about the same moment:
	// each read registers its process in the cell, so the first to read
	// found none of the others there, the second one, and so on. It counts
	// as many others as the region has (Engine.SetProcesses), shared or
	// not; but not while the origin fails, when it would only wait for
	// calls that fail (its partition's: see Partitioned).
	region := e.processes.Load()
	young := region > 1 && x != nil && st&stGrown == 0 && !e.failingFor(lc.key())
	if !shared && !young {
		return false, false
	}
	if strictUntil(lc.zone, lc.id, now) > now {
		return true, true
	}
	effective := SatAdd(SatAdd(cur, weighted(prev, lc.w, lc.r)), l.Cost)
	// The units this process has admitted since it last handed them over
	// (pending and the cost) count once more for each other process the
	// origin records in the cell (at least one): the others have not seen
	// them, and what the others admitted meanwhile is not in this count.
	// The growth measures that from their past pace, which is too low when
	// they, like this process, have just come back from deciding each
	// request at the origin, a round trip apiece, or meet the key at once
	// (no pace yet). Counted so, N processes that decide locally at once
	// keep what they admit unseen to a share of the room each, whatever
	// pace they measured: counted twice only, four processes meeting a key
	// in a burst took about 45 % each, 1.9 × the limit. The units of a
	// reservation in flight count among them until it returns: handed
	// over, they left pending, but the others have not seen them either,
	// and deciding locally meanwhile four processes took 1.16 to 1.43 ×
	// the limit in a burst.
	unseen := SatAdd(l.Cost, c.pending())
	if st&stReserved != 0 {
		if g, ok := e.reservations.Load(c); ok {
			unseen = SatAdd(unseen, g.handed.Load())
		}
	}
	others := int64(1)
	if x != nil {
		others = max(others, int64(x.procs.Load())-1)
	}
	if young {
		others = max(others, region-1)
	}
	if pressureAtLeast(SatAdd(SatAdd(effective, satMul(unseen, others)), e.foreignGrowth(lc, now)), l.Limit, 9, 10) {
		return true, true
	}
	// A share of 90 % each is not enough while the processes meet the key:
	// one whose view is from its read, before the others' units reached
	// the origin, still admits its share after they took the region to the
	// limit there. So a young cell keeps its unseen units, counted for
	// each other process, to a tenth of the limit: all the processes'
	// together then stay within the last tenth that the origin decides.
	if young && pressureAtLeast(satMul(unseen, others), l.Limit, 1, 10) {
		return true, true
	}
	// After a reservation the others still hold what they admitted unseen
	// before it, which this process's count does not show and its own
	// unseen units (handed over) no longer stand for: deciding locally
	// again at once, four processes took 1.24 × the limit in a burst. For
	// two fast ticks, until the others' replays have brought those units
	// to the origin, a shared cell's requests go there too; a reservation
	// made only for that starts no new ticks.
	return shared && x.sticky(now, e.fastTickMs()), false
}

// foreignGrowth estimates the units other processes admit to lc's cell
// between this process's last view of the origin and the moment their
// units reach it: the growth seen between the last two origin answers (the
// others' admissions in about one replay interval), scaled by the age of
// the view in fast ticks, plus two ticks: the others' next replay, and a
// replay of theirs that a busy machine runs late.
func (e *Engine) foreignGrowth(lc *located, now int64) int64 {
	x := lc.cur.links()
	if x == nil {
		return 0
	}
	step := x.step.Load()
	if step <= 0 {
		return 0
	}
	tick := max(e.fastTickMs(), 1)
	ticks := int64(2)
	if seen := x.fresh.Load() - e.freshnessMs(); seen > 0 && now > seen {
		ticks += (now - seen) / tick
	}
	if step > MaxCount/ticks {
		return MaxCount
	}
	return step * ticks
}

// decideAtOrigin decides lc with an origin attached: locally, or for a
// shared cell near its limit at the origin, within the decision's deadline.
// With relocate set it returns false, having decided nothing, when the
// key's entry was let go while a reservation was awaited (see
// decideLocated).
func (e *Engine) decideAtOrigin(ctx context.Context, d *Decision, o Origin, lc *located, l *Limit, now int64, dl *deadline, relocate bool) bool {
	local := l.DryRun || l.Cost == 0 // they charge whatever the origin says, or nothing
	for {
		n, cur, prev := lc.snapshot()
		ok := fits(cur, prev, l.Cost, l.Limit, lc.w, lc.r)
		if !ok && !l.DryRun {
			e.deny(d, lc, l, cur, prev)
			return true
		}
		if !local {
			if near, arms := e.nearLimit(lc, l, cur, prev, now); near {
				if od, decided := e.reserveAtOrigin(ctx, o, lc, l, dl, arms); decided {
					*d = od
					return true
				}
				if relocate && lc.en.cur.Load() == tombstone {
					return false
				}
				// Joined another request's reservation, or the origin
				// failed: look again, locally once the deadline has passed.
				local = dl.expired
				continue
			}
		}
		if charge(lc.cur, n, l.Cost) {
			e.allow(d, lc, l, ok, cur, prev)
			return true
		}
	}
}

// A group is one reservation at the origin: the request that sends it (its
// leader) and the requests that joined it while the reservation before it
// was in flight. One group per cell is in flight; the next forms behind it
// and is sent as soon as it returns, so a busy process pays one round trip
// for every request that arrived meanwhile rather than one per request,
// and admits as many of them as the region's count allows.
type group struct {
	limit int64
	done  chan struct{}

	mu       sync.Mutex
	costs    []int64 // costs[0] is the leader's; a member that left before the send costs 0
	sent     bool    // no member joins any more
	finished bool    // no longer in flight: next, if any, is
	next     *group
	// arms: a member came for a reason other than sticky (see
	// nearLimit), so sending the group starts the sticky ticks again.
	arms bool

	// handed is what the group hands the origin of this process's units
	// (pending and the costs) while it is in flight; nearLimit counts it
	// among the unseen units.
	handed atomic.Int64

	// Set before done is closed.
	decided            bool // false: the reservation failed or was given up
	admitted           []bool
	totals             Totals
	global, globalPrev int64
}

func newGroup(l *Limit, arms bool) *group {
	return &group{limit: l.Limit, done: make(chan struct{}), costs: []int64{l.Cost}, arms: arms}
}

// reserveAtOrigin decides l at the origin: it sends a reservation, or joins
// the group that will be sent when the one in flight returns. It reports
// whether it decided; when it did not, the caller decides again
// (dl.expired tells it to do so locally).
//
// A member that runs out of time before its group is sent leaves it at no
// cost. One that runs out after (the round trip outlasted its read
// timeout) decides locally, and the origin may have charged it too: an
// over-count by its cost, on the strict side.
func (e *Engine) reserveAtOrigin(ctx context.Context, o Origin, lc *located, l *Limit, dl *deadline, arms bool) (Decision, bool) {
	c := lc.cur
	for {
		g, ok := e.reservations.Load(c)
		if !ok {
			n := newGroup(l, arms)
			n.sent = true // in flight at once: joiners go behind it
			if _, loaded := e.reservations.LoadOrStore(c, n); loaded {
				continue // another request won the race: join it
			}
			return e.sendGroup(ctx, o, lc, l, n, dl)
		}
		g.mu.Lock()
		if g.finished {
			g.mu.Unlock()
			continue // the next group is in flight now: look again
		}
		n := g.next
		if n == nil {
			n = newGroup(l, arms)
			g.next = n
			g.mu.Unlock()
			e.stats.reservationWaits.Add(1)
			return e.leadNext(ctx, o, lc, l, g, n, dl)
		}
		g.mu.Unlock()
		n.mu.Lock()
		if n.sent {
			n.mu.Unlock()
			continue // given up by its leader
		}
		if n.limit != l.Limit {
			// The limit changed under a reload: wait for the cell's
			// reservations to move on, then decide again.
			n.mu.Unlock()
			dl.wait(ctx, e, g.done)
			return Decision{}, false
		}
		i := len(n.costs)
		n.costs = append(n.costs, l.Cost)
		n.arms = n.arms || arms
		n.mu.Unlock()
		e.stats.reservationWaits.Add(1)
		if !dl.wait(ctx, e, n.done) {
			n.mu.Lock()
			if !n.sent {
				n.costs[i] = 0
			}
			n.mu.Unlock()
			return Decision{}, false
		}
		return e.memberDecision(lc, l, n, i)
	}
}

// leadNext waits for g, the reservation in flight, and then sends n, the
// group behind it, which g installed as the cell's reservation in flight.
// Out of time before g returns, it gives n up: its members decide again.
func (e *Engine) leadNext(ctx context.Context, o Origin, lc *located, l *Limit, g, n *group, dl *deadline) (Decision, bool) {
	arrived := dl.wait(ctx, e, g.done)
	installed := arrived
	if !arrived {
		g.mu.Lock()
		if installed = g.finished; !installed {
			g.next = nil
		}
		g.mu.Unlock()
	}
	n.mu.Lock()
	n.sent = true
	n.mu.Unlock()
	switch {
	case !installed:
		close(n.done)
		return Decision{}, false
	case !arrived:
		// g returned as time ran out, and n is in flight: hand over to the
		// group behind it unsent.
		e.finishGroup(lc.cur, n)
		return Decision{}, false
	case !e.anyFits(lc, n):
		// g brought back a count with no room for any member: the origin,
		// whose counts only grow, would deny them all. A denial never pays
		// a round trip.
		n.admitted = make([]bool, len(n.costs))
		n.decided = true
		e.finishGroup(lc.cur, n)
		return e.memberDecision(lc, l, n, 0)
	}
	return e.sendGroup(ctx, o, lc, l, n, dl)
}

// anyFits reports whether the local view, which holds at least what the
// origin last answered, has room for the cheapest request of the group n.
func (e *Engine) anyFits(lc *located, n *group) bool {
	_, cur, prev := lc.snapshot()
	for _, cost := range n.costs {
		// A cost of 0 is a member that left: it needs no verdict.
		if cost > 0 && fits(cur, prev, cost, n.limit, lc.w, lc.r) {
			return true
		}
	}
	return false
}

// sendGroup sends n, the cell's reservation in flight, and decides its
// leader, whose limit is l; its members read their verdicts once n.done is
// closed.
func (e *Engine) sendGroup(ctx context.Context, o Origin, lc *located, l *Limit, n *group, dl *deadline) (Decision, bool) {
	c := lc.cur
	x := c.links() // a linked cell: with an origin, locate upgrades the cell
	defer e.finishGroup(c, n)
	if !e.holdWrites(ctx, lc, dl) {
		return Decision{}, false // a write of the cell outlasted the deadline: decided locally
	}
	defer e.releaseWrites(lc)
	var sum int64
	for _, cost := range n.costs {
		sum = SatAdd(sum, cost)
	}
	if n.arms { // n.sent is set (under n.mu): no member sets arms any more
		x.setTime(32, ms32(e.nowMs()), false)
	}
	// Hand the origin every unit this process has admitted to the cell as
	// one absolute total, with the costs beside it. own takes the pending
	// units now and the costs only as the origin admits them (admit): it
	// is what an answer merged meanwhile (a read's, a refresh's) counts as
	// this process's in the count, and the costs are not in the count yet.
	// Raised by them before the call, as it was, an answer from before
	// the reservation landed put them in the count, and the verdict added
	// them again (TestReserve_AnAnswerDuringAReservationCountsItsCostsOnce).
	// No write of the cell overlaps the call (holdWrites), and a write
	// never lowers what the origin holds. The requests decided meanwhile
	// count the units handed over as unseen still (see nearLimit).
	n.handed.Store(SatAdd(x.pending.Load(), sum))
	if c.state()&stReserved == 0 {
		c.setBits(stReserved)
	}
	d := x.pending.Swap(0)
	n.handed.Store(SatAdd(d, sum))
	own := x.own.Add(d)
	r := Reservation{
		Key:         lc.key(),
		Sequence:    c.seq(),
		Incarnation: c.incarnation(),
		Own:         own,
		Cost:        n.costs[0],
		Joined:      n.costs[1:],
		Limit:       n.limit,
		Elapsed:     lc.r,
		Global:      x.global.Load(),
	}
	if p := lc.en.previous(c); p != nil {
		r.GlobalPrev = p.globalCount()
	}
	dl.start(e)
	// Not cancelled with the leader's request: the reservation decides the
	// requests that joined it too, and a client that left says nothing of
	// the origin. A leader whose client had left sent it cancelled: it
	// failed unsent, counted as a failed origin call, and set the engine
	// failing.
	cctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), dl.at)
	sent := e.nowMs()
	err := o.Reserve(cctx, &r)
	cancel()
	e.stats.reservations.Add(1)
	if err == nil && len(r.JoinedAdmitted) != len(r.Joined) {
		err = errors.New("the origin returned no verdict for the joined requests")
	}
	if err != nil {
		// Decided locally: the units go back to pending, and the next
		// request weighs them as before.
		c.clearBits(stReserved)
		e.reservationFailed(lc, n, d)
		dl.expired = true
		return Decision{}, false
	}
	if time.Now().After(dl.at) {
		dl.expired = true
	}
	e.answered(r.Key, e.nowMs())
	e.admit(c, n, &r)
	e.merge(lc.zone, lc.en, c, r.Totals, sent, r.Key, true)
	n.totals, n.global, n.globalPrev = r.Totals, r.Global, r.GlobalPrev
	n.decided = true
	c.clearBits(stReserved)
	return e.memberDecision(lc, l, n, 0)
}

// holdWrites takes c's write bit (stFlushing) for a reservation, once no
// write of the cell is in flight, waiting within the request's deadline;
// false when a write outlasted it (dl.expired then). The reservation once
// raised this process's own total by the costs before it was sent, and a
// write that carried those costs and reached the origin first made the
// reservation charge them again (and a refused cost stayed counted): one
// write or reservation of a cell at a time, as writes already are.
//
// While the origin fails it does not wait: a write in flight on a hung
// origin lasts its own timeout, longer than the request's, and the replay
// sends a hot cell again every fast tick, so each request for the key
// waited its whole read timeout to decide locally in the end, breaker
// open or not, for as long as the origin hung. It decides locally at once
// (dl.expired), as the read path does after a failure of the key's
// partition; and so does a request once another's wait for a write ran
// out, until a write ends (Engine.outlasted): before the write failed,
// every request near its key's limit waited its whole read timeout for
// it (an audit with a hung Redis: 16 requests a node in a row, where the
// breaker opens after 5 failed calls), and such a wait was counted in no
// metric (read_wait_timeouts_total counts it now, as a read's).
func (e *Engine) holdWrites(ctx context.Context, lc *located, dl *deadline) bool {
	c := lc.cur
	for !c.setBits(stFlushing) {
		ch := e.flushEndedWhile(c)
		if ch == nil {
			continue
		}
		if e.failingFor(lc.key()) || e.outlasted.Load() == ch {
			dl.expired = true
			return false
		}
		fresh := !dl.expired
		if !dl.wait(ctx, e, ch) {
			if fresh {
				e.stats.readWaitTimeouts.Add(1)
			}
			if ctx.Err() == nil { // the deadline ran out, not the client
				e.outlasted.Store(ch)
			}
			return false
		}
	}
	return true
}

// releaseWrites gives the cell's write bit back after a reservation, and
// queues the cell if units arrived meanwhile (a replay skipped it, as it
// skips a cell with a write in flight).
func (e *Engine) releaseWrites(lc *located) {
	c := lc.cur
	c.clearBits(stFlushing)
	e.endedFlush()
	if c.pending() > 0 {
		e.markDirty(lc.zone, lc.en, c, true)
	}
}

// reservationFailed gives back the pending units a failed reservation of n
// handed the origin: they replay as usual (a write the origin did apply
// makes that replay a no-op), and the requests are decided again,
// locally. The origin may hold them (it ran the call and the answer was
// lost), so the cell is unsure until they replay, as after a lost write:
// an answer about the next window, whose previous total held them, once
// counted them twice in the previous cell
// (TestReserve_AFailedReservationsUnitsCountOnceInThePreviousCell).
func (e *Engine) reservationFailed(lc *located, n *group, pending int64) {
	e.stats.reservationErrors.Add(int64(len(n.costs)))
	e.originFailed(e.partition(lc.key()))
	x := lc.cur.links()
	if pending > 0 {
		lc.cur.setBits(stUnsure) // first: the origin may hold them
	}
	x.own.Add(-pending)
	if pending > 0 {
		x.pending.Add(pending)
		e.markDirty(lc.zone, lc.en, lc.cur, true)
	}
}

// admit records the origin's verdicts r on the members of n: an admitted
// cost joins the cell's count, then this process's own total, which the
// origin raised by it. In that order: an answer merged in between counts
// own as this process's part of the count, and with own first it would
// put the cost in the count before the count took it.
func (e *Engine) admit(c *cell, n *group, r *Reservation) {
	n.admitted = append(make([]bool, 0, len(n.costs)), r.Admitted)
	n.admitted = append(n.admitted, r.JoinedAdmitted...)
	var charged int64
	for i, ok := range n.admitted {
		if ok {
			e.stats.reservationsAdmitted.Add(1)
			addSat(&c.count, n.costs[i])
			charged = SatAdd(charged, n.costs[i])
		} else {
			e.stats.reservationsDenied.Add(1)
		}
	}
	c.links().own.Add(charged)
}

// finishGroup takes n out of flight, puts the group behind it in flight,
// and wakes n's members and the next group's leader.
func (e *Engine) finishGroup(c *cell, n *group) {
	n.mu.Lock()
	n.finished = true
	if n.next != nil {
		e.reservations.Store(c, n.next)
	} else {
		e.reservations.Delete(c)
	}
	n.mu.Unlock()
	close(n.done)
}

// memberDecision is the decision of member i of the decided group n: the
// origin's verdict, with the totals it brought back. The origin's denial
// stands even if the local counts, which never saw its previous cell,
// would let the request pass.
func (e *Engine) memberDecision(lc *located, l *Limit, n *group, i int) (Decision, bool) {
	if !n.decided {
		return Decision{}, false
	}
	_, cur, prev := lc.snapshot()
	var d Decision
	if n.admitted[i] {
		lc.passed(&d, l.Limit, cur, prev)
		return d, true
	}
	cur = max(cur, SatAdd(n.totals.Cur, n.global))
	prev = max(prev, SatAdd(n.totals.Prev, n.globalPrev))
	e.deny(&d, lc, l, cur, prev)
	return d, true
}

// satMul is a × n for a count a and a small n ≥ 1, saturated at MaxCount.
func satMul(a, n int64) int64 {
	a = ClampCount(a)
	if a > MaxCount/n {
		return MaxCount
	}
	return a * n
}
