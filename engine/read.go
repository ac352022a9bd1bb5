package engine

import (
	"context"
	"errors"
	"time"
)

// Reads from the origin on the request path, by pressure tier
// (effective / limit, cost included):
//
//	cold cell (first touch)        read synchronously, once (single flight);
//	                               with a limit far above the cost, no read
//	                               until this process admits 1/1024 of it:
//	                               its first replay reads (see unread); a
//	                               request its local counts already deny
//	                               reads in the background
//	fresh cell                     no read
//	stale, < 50 %, not shared      no read when the request charges units:
//	                               their replay (within a tick) returns
//	                               both cells as a read would; else refresh
//	                               in the background
//	stale, ≥ 50 % or shared        refresh synchronously first
//	after an origin outage         refresh synchronously first (see suspect)
//
// Near the limit, a shared cell (one the origin has shown other processes'
// units in) is decided at the origin instead (reserve.go); a cell only this
// process touches decides locally, so a lone process pays no round trip per
// admission. A denial never reads.
//
// Every synchronous wait is bounded by the read timeout, whatever the
// origin does, and one decision waits at most one read timeout in all, for
// every zone it decides; on timeout, error or an open breaker the decision
// proceeds on local state and the cell is not marked fresh.

// After the origin failed and answers again, this process's view of a key
// may lack what the other processes admitted meanwhile: they replay it
// within a flush period of the origin's return (their pending units, on
// the fast tick, or on the slow one below half the limit). For that long,
// and for a freshness period after, a view taken before the end of it is
// suspect: the key's next decision reads first, at any pressure, as a cold
// key does, so that the outage's admissions are weighed at once rather
// than a tick of admissions later. A denial still never reads. The same
// holds after Resend (the origin restarted empty), while the others'
// totals come back.
//
// An origin of several partitions (Partitioned) fails and comes back
// partition by partition, and so do these states: a key's decisions follow
// its own partition's. With one record for the whole origin, every call
// flipped it while one partition was down: a failure there made the live
// partitions' young cells decide locally (nearLimit), and an answer from
// a live one made each request for a key of the dead one read it again
// (TestPartitions_ADeadPartitionLeavesAYoungCellOnALiveOneWithTheOrigin,
// TestPartitions_ACellOnADeadPartitionWaitsToReadAgain). The partition of
// a key is asked for only while a partition fails or is suspect: one
// atomic load otherwise, as before.

// partition returns the index of key's partition (see Partitioned), 0
// when the origin has one.
func (e *Engine) partition(key Key) int {
	if b := e.origin.Load(); b != nil && b.parts != nil {
		return int(uint(b.parts.Partition(key)) % maxPartitions)
	}
	return 0
}

// originFailed records a failed origin call on partition p.
func (e *Engine) originFailed(p int) {
	if bit := uint64(1) << p; e.failing.Load()&bit == 0 {
		e.failing.Or(bit)
	}
}

// originAnswered records a successful origin call on partition p at now;
// the first after a failure there starts a suspect period there.
func (e *Engine) originAnswered(p int, now int64) {
	if bit := uint64(1) << p; e.failing.Load()&bit != 0 && e.failing.And(^bit)&bit != 0 {
		e.distrust(p, now)
	}
}

// answered records a successful origin call about key at now: its
// partition is asked for only while one fails.
func (e *Engine) answered(key Key, now int64) {
	if e.failing.Load() != 0 {
		e.originAnswered(e.partition(key), now)
	}
}

// failingFor reports whether the partition of key is failing: one load
// while none is.
func (e *Engine) failingFor(key Key) bool {
	m := e.failing.Load()
	return m != 0 && m&(uint64(1)<<e.partition(key)) != 0
}

// distrust makes views taken on partition p before one flush period from
// now suspect; p < 0: on every partition.
func (e *Engine) distrust(p int, now int64) {
	period := time.Duration(e.slowTick.Load() + 2*e.fastTick.Load()).Milliseconds()
	if p < 0 {
		for i := range e.untrusted {
			raise(&e.untrusted[i], now+period)
		}
	} else {
		raise(&e.untrusted[p], now+period)
	}
	raise(&e.untrustedMax, now+period)
}

// untrustedFor is when the suspect period of key's partition ends, given
// u, the latest end of any (untrustedMax): the key's partition is asked
// for only when there are several.
func (e *Engine) untrustedFor(key Key, u int64) int64 {
	if b := e.origin.Load(); b == nil || b.parts == nil {
		return u
	}
	return e.untrusted[e.partition(key)].Load()
}

// suspect reports whether a cell of key whose freshness deadline is fresh
// holds a view from before the end of a suspect period of its partition
// (see distrust), at now.
func (e *Engine) suspect(key Key, now, fresh int64) bool {
	u := e.untrustedMax.Load()
	if u == 0 {
		return false
	}
	f := e.freshnessMs()
	if !(now < u+f && fresh-f < u) {
		return false // not within the latest period: within none
	}
	u = e.untrustedFor(key, u)
	return now < u+f && fresh-f < u
}

// coldReadRetry is how long a cell whose cold read failed decides locally
// before it reads again, while the origin keeps failing: long enough that a
// dead origin costs no request a read each, short enough that a recovered
// origin is used within a flush period (two slow ticks and a fast one),
// which is how long the accuracy bound allows after a fault. At most a
// slow tick; once any call of the process on the key's partition succeeds
// again, the next decision reads at once.
func (e *Engine) coldReadRetry() int64 {
	return min(maxColdReadRetry, time.Duration(e.slowTick.Load())).Milliseconds()
}

const maxColdReadRetry = 250 * time.Millisecond

// maxBackgroundReads bounds background refreshes in flight, so a burst of
// stale keys cannot start unbounded goroutines.
const maxBackgroundReads = 64

// flight is one origin call shared by every request that needs it.
type flight struct {
	done chan struct{}
	// refused is set, before done is closed, when the origin refused the
	// read without sending it (see refused).
	refused bool
	// What the read reads, for the decision that started it and runs it
	// (see startRead); noGrow: its answer does not grow the cell up.
	o      Origin
	z      *Zone
	key    Key
	en     *entry
	c      *cell
	noGrow bool
}

// refused reports whether err says the origin refused a call without
// sending it (an open breaker): an error with a method Refused() bool.
func refused(err error) bool {
	var r interface{ Refused() bool }
	return errors.As(err, &r) && r.Refused()
}

// waitRead waits for f within dl, counting a decision that waited for a
// read (syncReads: one the origin refused at once waited for nothing) and
// one that ran out of time. A read lc's decision started (lc.started) it
// runs itself, on its own goroutine, within dl: a goroutine of its own
// for every synchronous read, and the timer a decision waited for it
// with, cost a cold decision's CPU (BenchmarkColdDecide).
func (e *Engine) waitRead(ctx context.Context, dl *deadline, lc *located, f *flight) {
	if lc.started == f {
		lc.started = nil
		dl.start(e)
		if e.runRead(f, dl.at) {
			e.stats.readWaitTimeouts.Add(1)
		}
		if !f.refused {
			e.stats.syncReads.Add(1)
		}
		return
	}
	e.waitFor(ctx, dl, f)
}

// waitFor waits for another's read f within dl, counting as waitRead does.
func (e *Engine) waitFor(ctx context.Context, dl *deadline, f *flight) {
	if !dl.wait(ctx, e, f.done) {
		e.stats.readWaitTimeouts.Add(1)
		e.stats.syncReads.Add(1)
	} else if !f.refused {
		e.stats.syncReads.Add(1)
	}
}

// launch runs the read lc's decision started on a goroutine of its own,
// for a batch that waits for several at once.
func (e *Engine) launch(lc *located, f *flight) {
	if lc.started != f {
		return
	}
	lc.started = nil
	go e.runRead(f, time.Now().Add(e.readTimeoutD()))
}

// runRead performs the read f, started by startRead, by deadline, and
// ends it for every decision waiting: it reports whether the deadline
// passed before the origin answered.
func (e *Engine) runRead(f *flight, deadline time.Time) (late bool) {
	defer func() {
		e.flights.Delete(f.c)
		close(f.done)
	}()
	f.refused, late = e.readCell(f.o, f.z, f.key, f.en, f.c, deadline, !f.noGrow)
	return late
}

// deadline is one decision's budget for the origin: one read timeout from
// the first time it is used, shared by every wait and call of the decision.
type deadline struct {
	at      time.Time
	t       *time.Timer
	expired bool
}

// start fixes the deadline at the first use.
func (d *deadline) start(e *Engine) {
	if d.at.IsZero() {
		d.at = time.Now().Add(e.readTimeoutD())
	}
}

// wait waits for done until the deadline or ctx ends, and reports whether
// done was reached.
func (d *deadline) wait(ctx context.Context, e *Engine, done <-chan struct{}) bool {
	select {
	case <-done:
		return true
	default:
	}
	if d.expired {
		return false
	}
	d.start(e)
	if d.t == nil {
		d.t = time.NewTimer(time.Until(d.at))
	}
	select {
	case <-done:
		return true
	case <-d.t.C:
	case <-ctx.Done():
	}
	d.expired = true
	return false
}

func (d *deadline) stop() {
	if d.t != nil {
		d.t.Stop()
	}
}

// converge brings lc's cell as close to the origin as its tier asks for. It
// returns the read to wait for before deciding, or nil.
func (e *Engine) converge(o Origin, lc *located, l *Limit, now int64, denied bool) *flight {
	c := lc.cur
	st := c.state()
	fresh := c.freshUntil()
	if fresh > now+max(e.freshnessMs(), maxColdReadRetry.Milliseconds()) {
		fresh = 0 // set by a clock that has since stepped back: not fresh
	}
	if st&stRead == 0 {
		if now < fresh && e.failingFor(lc.key()) {
			return nil // a failed cold read waits before it retries
		}
		if e.unread(lc, l, now) {
			e.stats.unreadDecisions.Add(1)
			return nil
		}
		if _, cur, prev := lc.snapshot(); !fits(cur, prev, l.Cost, l.Limit, lc.w, lc.r) {
			// Denied on what this process already counts (a previous
			// cell it held at its limit while its reads failed, the
			// counts other regions left): a read only raises counts, so
			// it could not turn the denial into an allow. It goes on in
			// the background, for the requests after this one.
			return e.readFor(o, lc, true)
		}
		return e.readFor(o, lc, denied)
	}
	suspect := e.suspect(lc.key(), now, fresh)
	behind := e.behind(lc, fresh, now)
	// A read for a view behind the region does not grow a young cell up
	// (see heard): a key met again after a pause, as the view's, a moment
	// before another process met it, grown up by that read admitted a
	// whole burst on its view: 40 of 40 in 9 of 18 runs of an audit with
	// three Caddy processes, where staying young it went to the origin
	// within a few units (0 to 4). The cell's next answer grows it.
	lc.noGrow = behind
	if now < fresh && !suspect && !behind {
		return nil
	}
	_, cur, prev := lc.snapshot()
	effective := SatAdd(SatAdd(cur, weighted(prev, lc.w, lc.r)), l.Cost)
	switch {
	case effective > l.Limit:
		return nil // a denial never pays a round trip
	case suspect || pressureAtLeast(effective, l.Limit, 1, 2) || (st&stShared != 0 && now >= fresh):
		// A shared cell's stale view lacks what the others admitted since:
		// far from the limit in this process's view is not far from it in
		// the region's.
		return e.readFor(o, lc, denied)
	case l.Cost > 0 && l.Cost <= l.Limit/unreadShare && strictUntil(lc.zone, lc.id, now) <= now:
		// Far from the limit, on a cell no other process has shown units
		// in, under a limit far above one request (as unread has it), this
		// request passes and its units replay within a tick; the replay
		// brings both cells back as a read would, so a read now would only
		// repeat it. A view behind the region (a shared cell's too, still
		// fresh) passes so only within the share an unread cell has, its
		// units on the fast tick: past it, it reads first. A shared key of
		// such a limit whose requests came round-robin over three nodes
		// 100-300 ms apart read at nearly every request for it (an audit:
		// 0.91 reads a request, p50 0.70 -> 1.21 ms).
		if !behind {
			return nil
		}
		if SatAdd(lc.cur.pending(), l.Cost) <= l.Limit/unreadShare {
			lc.behind = true
			return nil
		}
		return e.readFor(o, lc, denied)
	case l.Cost > 0:
		// Under a smaller limit a stale view may be far behind the region:
		// another process this one has not met yet (its last answer showed
		// none) may have taken the key to its limit since. Read first, as
		// a cold cell does.
		return e.readFor(o, lc, denied)
	}
	if _, started := e.startRead(o, lc, false); started {
		e.stats.backgroundReads.Add(1)
	}
	return nil
}

// behind reports whether lc's cell, read before, holds a view the region
// may have left far behind, whose freshness deadline is fresh, at now: in
// a region of several processes, one taken more than two slow ticks ago.
// A key this process keeps using has a newer one, from its own replay
// (within a slow tick, below half its limit); an older one is a key this
// process left idle while another may have taken it anywhere, up to its
// limit: a view fresh for a second let a node that had met a key alone
// admit 98 more of a limit of 100 after another node took it to its limit
// in the 300 ms before (an audit; TestStale_AViewBehindTheRegion). Such a
// view is read first, as a stale one is (freshness), but for a limit far
// above one request, whose share (as unread's) passes on the fast tick.
// Not while the key's partition fails, whose reads would only fail.
func (e *Engine) behind(lc *located, fresh, now int64) bool {
	if e.processes.Load() <= 1 {
		return false
	}
	seen := fresh - e.freshnessMs()
	return now-seen > 2*time.Duration(e.slowTick.Load()).Milliseconds() && !e.failingFor(lc.key())
}

// readFor returns the read of lc's cell a decision waits for, or, when the
// decision is a denial whatever the read brings (denied: it only raises
// counts), starts it in the background, within the background reads' cap,
// and returns nil.
func (e *Engine) readFor(o Origin, lc *located, denied bool) *flight {
	if !denied {
		return e.syncRead(o, lc)
	}
	if _, started := e.startRead(o, lc, false); started {
		e.stats.backgroundReads.Add(1)
	}
	return nil
}

// unreadShare bounds what a process admits in a cold cell before it has
// read it, when the limit is far above one request: 1/unreadShare of the
// limit. See unread.
const unreadShare = 1024

// unread reports whether l may be decided in lc's cold cell without
// reading the cell first. A key whose limit is at least unreadShare times
// the request's cost, in whose cell this process has admitted at most
// 1/unreadShare of the limit, decides on its own count: the units charged
// go on the fast tick (a cell's first units always do), and that replay's
// answer brings the cell and the one before it back as a read would,
// within a fast tick and a round trip. Until then the cell stays cold, and
// a request that would take this process past the share reads first, as
// every cold cell did before. The price, stated in the README: a process
// that meets a key the others have already taken to its limit admits up
// to 1/unreadShare of the limit (plus one request) too many, only before
// its first answer; a first pass over many one-off keys (a fresh process
// after a deploy, per-address limits) pays no round trip and no wait per
// key, and Redis half the work (no read beside the write). A request
// without cost charges nothing to replay, and a key in strict mode reads
// first whatever its limit; so does every limit below unreadShare units a
// request, which covers the small limits where one request matters.
func (e *Engine) unread(lc *located, l *Limit, now int64) bool {
	share := l.Limit / unreadShare
	if l.Cost <= 0 || l.Cost > share || SatAdd(lc.cur.count.Load(), l.Cost) > share {
		return false
	}
	return strictUntil(lc.zone, lc.id, now) <= now
}

// convergeAll converges every limit of a batch, reads in parallel, and
// waits for them together within the batch's deadline dl. A limit near its
// limit in a shared cell is then decided at the origin (DecideMany), whose
// answer brings its count: it reads nothing more here. Limits marked in
// skip (nil: none) are left out.
func (e *Engine) convergeAll(ctx context.Context, o Origin, lcs []located, ls []Limit, now int64, dl *deadline, skip []bool) {
	// A limit whose own counts already deny refuses the batch whatever
	// the reads bring (they only raise counts): the reads the others
	// would wait for start in the background (readFor), and the batch is
	// denied at once. Before, a batch that one limit denied waited for
	// another's cold read, up to the read timeout
	// (TestDecideMany_ADenialDoesNotWaitForAnotherLimitsRead).
	denied := false
	for i := range ls {
		if ls[i].DryRun || (skip != nil && skip[i]) {
			continue
		}
		if _, cur, prev := lcs[i].snapshot(); !fits(cur, prev, ls[i].Cost, ls[i].Limit, lcs[i].w, lcs[i].r) {
			denied = true
			break
		}
	}
	var stack [8]*flight
	fs := stack[:0]
	for i := range ls {
		if skip != nil && skip[i] {
			continue
		}
		if f := e.converge(o, &lcs[i], &ls[i], now, denied); f != nil {
			e.launch(&lcs[i], f)
			fs = append(fs, f)
		}
	}
	for _, f := range fs {
		e.waitFor(ctx, dl, f)
	}
}

// syncRead returns the read of lc's cell that a decision waits for,
// starting one (lc.started: the decision runs it, see waitRead) or
// joining the one in flight.
func (e *Engine) syncRead(o Origin, lc *located) *flight {
	f, started := e.startRead(o, lc, true)
	if f != nil && !started {
		e.stats.sharedReads.Add(1)
	}
	return f
}

// startRead returns the read in flight for lc's cell, starting one if
// there is none. It reports whether this call started it. A background
// caller over budget gets nil. A read a decision waits for (wait) is
// left to it to run (lc.started); a background one runs on its own.
func (e *Engine) startRead(o Origin, lc *located, wait bool) (*flight, bool) {
	if f, ok := e.flights.Load(lc.cur); ok {
		return f, false
	}
	if !wait {
		if e.bgReads.Add(1) > maxBackgroundReads {
			e.bgReads.Add(-1)
			return nil, false
		}
	}
	started := false
	f, _ := e.flights.LoadOrCompute(lc.cur, func() (*flight, bool) {
		started = true
		return &flight{done: make(chan struct{})}, false
	})
	if !started {
		if !wait {
			e.bgReads.Add(-1)
		}
		return f, false
	}
	f.o, f.z, f.key, f.en, f.c, f.noGrow = o, lc.zone, lc.key(), lc.en, lc.cur, lc.noGrow
	if wait {
		lc.started = f
		return f, true
	}
	go func() {
		defer e.bgReads.Add(-1)
		e.runRead(f, time.Now().Add(e.readTimeoutD()))
	}()
	return f, true
}

// readCell performs one origin read of c and the cell before it, by
// deadline, and merges the totals. It reports whether the origin refused
// the read without sending it (see refused), which counts as no read,
// failed or not, and whether the deadline passed first.
func (e *Engine) readCell(o Origin, z *Zone, key Key, en *entry, c *cell, deadline time.Time, grow bool) (notSent, late bool) {
	// A forget of the key writing its units: the origin lacks them until
	// it is done.
	e.forgets.wait(key, time.Until(deadline))
	if !time.Now().Before(deadline) {
		return true, true // the time went to the forget: no read was sent
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	start := e.nowMs()
	t, err := o.Read(ctx, key, c.seq(), c.incarnation())
	now := e.nowMs()
	if err != nil {
		late = ctx.Err() != nil
		notSent = refused(err)
		if !notSent {
			e.stats.readErrors.Add(1)
		}
		e.originFailed(e.partition(key))
		if x := c.links(); x != nil && c.state()&stRead == 0 {
			x.fresh.Store(now + e.coldReadRetry())
		}
		return notSent, late
	}
	e.stats.reads.Add(1)
	e.stats.lastRead.Store(now)
	e.answered(key, now)
	// Freshness counts from when the read was sent: the origin's answer is
	// at least that recent.
	e.mergeRead(z, en, c, t, start, key, grow, true)
	return false, false
}

// merge brings the origin's totals t of c (and of the cell before it) into
// the entry, the counts other regions counted there (the region's
// cross-region role leaves them at the origin) included, and marks c
// read and fresh from sent, the time the call that returned t was sent.
// key is the cell's; withPrev tells that t holds the previous cell's
// totals, which settle it (see stPrevSettled) once they are final.
func (e *Engine) merge(z *Zone, en *entry, c *cell, t Totals, sent int64, key Key, withPrev bool) {
	e.mergeRead(z, en, c, t, sent, key, true, withPrev)
}

// mergeRead is merge, where grow tells whether the answer may grow a
// young cell up (see heard; not a read for a view behind the region).
func (e *Engine) mergeRead(z *Zone, en *entry, c *cell, t Totals, sent int64, key Key, grow, withPrev bool) {
	c.observe(t, e.nowMs(), e.fastTickMs())
	if x := c.links(); x != nil && grow {
		c.heard(x, sent, 2*e.fastTickMs()) // after observe: a grown cell has the processes it counts
	}
	c.mergeAnswer(t.Cur, t.Mine)
	c.importGlobal(t.Global)
	if t.Prev > 0 || t.GlobalPrev > 0 {
		p := en.previous(c)
		if p == nil && en.cur.Load() == c {
			// The origin knows a previous cell this process never saw.
			old := en.prev.Load()
			n := newCell(c.seq()-1, true)
			n.setBits(stRead)
			if (old == nil || old.seq() < n.seq()) && en.prev.CompareAndSwap(old, n) {
				p = n
				e.letGoPrevious(z, en, old)
			} else {
				p = en.previous(c)
			}
		}
		if p != nil {
			p.mergeOrigin(t.Prev)
			p.importGlobal(t.GlobalPrev)
		}
	}
	if withPrev && c.state()&stPrevSettled == 0 && e.prevFinal(c, key, sent) {
		c.setBits(stPrevSettled)
	}
	c.setBits(stRead)
	c.extendFresh(sent+e.freshnessMs(), e.freshnessMs())
}

// letGoPrevious remembers old, the previous cell of en that a cell of the
// window just before replaced: one kept over a gap while the engine had
// no origin (see entry.current), holding units admitted then that no
// queue may have taken. Let go unburied, they were neither written nor
// counted as lost (TestRead_APreviousCellTheOriginReplacesIsRemembered).
func (e *Engine) letGoPrevious(z *Zone, en *entry, old *cell) {
	if old != nil {
		e.buryCell(z, en, old)
	}
}

// prevFinal reports whether an answer sent at sent holds the final totals
// of c's previous cell: every process sends its units of a cell within a
// slow tick and a fast one of the cell's end, or marks them late
// (Delta.Late), and a write sent then has landed or failed within its
// bound (flushTimeout); so an answer sent a slow tick more than that into
// c's window (room for clocks a little apart), and after any suspect
// period of its partition (whose late replays may still come), has them all, or a mark
// that brings them. With a cross-region layer the previous cell's imported
// count keeps growing for longer.
func (e *Engine) prevFinal(c *cell, key Key, sent int64) bool {
	settle := (time.Duration(2*e.slowTick.Load()+e.fastTick.Load()) + flushTimeout).Milliseconds()
	if e.getGlobal() != nil || sent < c.seq()*key.Window.Milliseconds()+settle {
		return false
	}
	u := e.untrustedMax.Load()
	return sent >= u || sent >= e.untrustedFor(key, u)
}
