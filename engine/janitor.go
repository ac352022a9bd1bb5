package engine

import (
	"context"
	"math/bits"
	"sync"
	"sync/atomic"
	"time"
)

// The janitor bounds memory. Every JanitorInterval it drops entries whose
// cells are both older than the previous window (they weigh nothing any
// more) and expired strict deadlines. When live entries pass MaxEntries it
// evicts down to evictLowWater of the cap, coldest and lowest-count first,
// so that a flood of fresh identifiers (one request each) is evicted before
// any key that is busy now.

// graveCells is how many dropped cells (forgotten or evicted while their
// window still weighs) a process remembers for Resend: an origin restarted
// empty gets their units back too, though no entry holds them any more.
// Each holds its entry (with the identifier) alive; past it the oldest are
// let go, and a restart in the same window would lose their units.
const graveCells = 4096

// graveyard remembers recently dropped cells for Resend.
type graveyard struct {
	mu    sync.Mutex
	cells []dirtyCell
	next  int
}

// list returns a copy of the cells remembered.
func (g *graveyard) list() []dirtyCell {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]dirtyCell(nil), g.cells...)
}

// buryCells remembers the cells an entry of z let go (forgotten, evicted,
// rotated past) whose units the origin holds (or will). Their age is not
// judged by this process's clock, which may be the one that is off.
func (e *Engine) buryCells(z *Zone, en *entry, cs [2]*cell) {
	for _, c := range cs {
		if c != nil {
			e.buryCell(z, en, c)
		}
	}
}

// buryCell remembers c, which no entry holds any more, if it holds units
// of this process that an origin has or will have. A cell that a rotation
// over an idle gap let go is remembered too: it weighs nothing now, but a
// clock that jumped forward and comes back finds its window live again.
func (e *Engine) buryCell(z *Zone, en *entry, c *cell) {
	if c == tombstone || (e.origin.Load() == nil && !e.unsent.Load()) {
		return
	}
	if x := c.links(); x == nil || x.own.Load()+x.pending.Load() == 0 {
		return
	}
	if !c.setBits(stBuried) {
		return // remembered already
	}
	g := &e.graves
	g.mu.Lock()
	if len(g.cells) < graveCells {
		g.cells = append(g.cells, dirtyCell{z, en, c})
	} else {
		old := g.cells[g.next].cell
		g.cells[g.next] = dirtyCell{z, en, c}
		g.next = (g.next + 1) % graveCells
		// A cell queued or in a write when it leaves may come back: if
		// the queues drop it later (markDirty), it is buried again.
		old.clearBits(stBuried)
		if old.state()&(stDirty|stFlushing) == 0 {
			// Units a let-go cell holds that no replay queue holds are
			// only here (without an origin; or with one whose queues were
			// full, as when an eviction's write failed): past the bound
			// they are given up, and counted as lost.
			if n := old.links().pending.Swap(0); n > 0 {
				e.stats.lostUnits.Add(n)
			}
		}
	}
	g.mu.Unlock()
}

// resendAll hands an origin that comes back after the engine let one go
// everything this process counted: the origin may have restarted empty
// meanwhile, unseen by a process that had no origin to watch, so every
// cell's own total goes again (Resend: writes are idempotent), and the
// units admitted meanwhile go for the first time (sendUnsent). A manual
// engine does it at once; another in the background, as Resend may wait
// for room in the replay queues.
func (e *Engine) resendAll() {
	if e.cfg.Manual {
		e.Resend()
		e.sendUnsent()
		return
	}
	e.background(func() {
		e.Resend()
		e.sendUnsent()
	})
}

// ResendAsync runs Resend in the background (it may wait for room in the
// replay queues), as the engine's own work: Close waits for it, and a
// closed engine runs none. done, if set, gets the number of cells queued.
func (e *Engine) ResendAsync(done func(cells int)) {
	e.background(func() {
		n := e.Resend()
		if done != nil {
			done(n)
		}
	})
}

// background runs f on a goroutine Close waits for, unless the engine is
// closed.
func (e *Engine) background(f func()) {
	e.life.Lock()
	defer e.life.Unlock()
	if e.stopped {
		return
	}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		f()
	}()
}

// sendUnsent queues, once an origin is back, every cell holding units
// admitted while the engine had none (see allow): the live ones, and the
// ones dropped meanwhile (rotated past, forgotten, evicted), which sit in
// no queue. Without it the live ones waited for the janitor, every
// JanitorInterval, while the region's other nodes admitted as if the
// units did not exist; the dropped ones were never sent.
func (e *Engine) sendUnsent() {
	e.rangeZones(func(z *Zone) bool {
		z.entries.Range(func(_ string, en *entry) bool {
			e.requeue(z, en)
			return true
		})
		return true
	})
	e.requeueGraves()
}

// requeueGraves queues the buried cells that hold units no queue holds:
// those of a key let go while both replay queues were full (an eviction
// whose writes the budget cut off, a forget or rotation behind a slow
// origin), or while the engine had no origin. No entry holds them, so the
// janitor's pass over the entries never finds them: they waited for an
// origin to come back, and a shutdown never sent them
// (TestEvict_TheBudgetCountsTheKeysItDefers).
func (e *Engine) requeueGraves() {
	for _, d := range e.unqueuedGraves() {
		e.markDirty(d.zone, d.en, d.cell, d.cell.state()&stShared != 0)
	}
}

// unqueuedGraves lists the buried cells holding pending units that sit in
// no replay queue and no write.
func (e *Engine) unqueuedGraves() []dirtyCell {
	g := &e.graves
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []dirtyCell
	for _, d := range g.cells {
		if c := d.cell; c.pending() > 0 && c.state()&(stDirty|stFlushing) == 0 {
			out = append(out, d)
		}
	}
	return out
}

// evictLowWater is the fraction of MaxEntries that eviction shrinks to, so
// that a steady flood evicts in batches rather than on every insert.
const evictLowWater = 0.9

func (e *Engine) janitorLoop() {
	defer e.wg.Done()
	t := time.NewTicker(e.cfg.JanitorInterval)
	defer t.Stop()
	for {
		select {
		case <-e.stop:
			return
		case <-t.C:
			e.Sweep()
			e.Evict()
		case <-e.evictNow:
			e.Evict()
		}
	}
}

// Sweep is one janitor pass: it drops idle entries and expired strict
// deadlines and requeues pending deltas that a full replay queue left
// behind, in live entries and in the graves. With an origin, a live
// entry's plain current cell, counted before the engine had any, is
// upgraded, which hands its units over. It returns the number of
// entries dropped.
func (e *Engine) Sweep() int {
	now := e.nowMs()
	hasOrigin := e.origin.Load() != nil
	dropped := 0
	e.rangeZones(func(z *Zone) bool {
		oldest := now/z.w - 1
		dropped += z.entries.DeleteMatching(func(id string, en *entry) (bool, bool) {
			c := en.cur.Load()
			if c == tombstone {
				return true, false
			}
			if c.seq() >= oldest {
				if hasOrigin {
					if c.state()&stLinked == 0 {
						// Counted before the engine had any origin (a
						// local-only config reloaded into a region): the
						// upgrade hands its units over, as a request's
						// does, for a key no request meets again too.
						e.upgrade(z, id, en, &en.cur, c)
					}
					e.requeue(z, en)
				}
				return false, false
			}
			if hasOrigin && !e.requeue(z, en) {
				return false, false // units no queue could take: keep them
			}
			cells := [2]*cell{c, en.prev.Load()}
			// A request that still holds the entry sees the tombstone and
			// looks the key up again, so nothing is counted into a dropped
			// cell.
			if !en.cur.CompareAndSwap(c, tombstone) {
				return false, false
			}
			if hasOrigin {
				// Units a request charged between the requeue above and the
				// swap, that a full queue refused while the entry still held
				// the cell: queued now, or, refused again, in the graves
				// (markDirty), no longer left with an entry that is gone.
				e.requeueCells(z, en, cells)
			} else {
				// Units counted without an origin, for the next
				// (sendUnsent): buried once the entry let the cells go,
				// with what a request charged up to then.
				e.buryCells(z, en, cells)
			}
			return true, false
		})
		e.strictLive.Add(-int64(z.strict.DeleteMatching(func(_ string, d *atomic.Int64) (bool, bool) {
			u := d.Load()
			return u <= now || strictStale(z, u, now), false
		})))
		return true
	})
	if hasOrigin {
		e.requeueGraves()
	}
	e.orphans.prune(now, nil)
	e.live.Add(-int64(dropped))
	return dropped
}

// requeue queues the entry's cells that hold pending units but sit in no
// queue, and reports whether every such cell is now queued (or with the
// replay): false when a full queue refused one.
func (e *Engine) requeue(z *Zone, en *entry) bool {
	return e.requeueCells(z, en, [2]*cell{en.cur.Load(), en.prev.Load()})
}

// requeueCells is requeue of cells, en's.
func (e *Engine) requeueCells(z *Zone, en *entry, cells [2]*cell) bool {
	all := true
	for _, x := range cells {
		if x == nil || x == tombstone || x.pending() == 0 || x.state()&(stDirty|stFlushing) != 0 {
			continue
		}
		e.markDirty(z, en, x, x.state()&stShared != 0)
		if x.state()&(stDirty|stFlushing) == 0 && x.pending() > 0 {
			all = false
		}
	}
	return all
}

// Evict enforces MaxEntries: when live entries exceed it, it evicts down to
// evictLowWater of it, lightest first: in order of the keys' weight now,
// then of age (see evictClass). It returns the number evicted.
//
// With an origin, the units of evicted cells that it has not replayed yet
// are written before Evict returns, as a forget writes them, and a read of
// such a key meanwhile waits for that write (see forgetting): queued for
// the replay instead, they reached the origin after the key's next entry
// had read it, which admitted them again: a cap below the keys busy at
// once evicted busy keys, and an audit saw 119 admitted for a limit of 50
// (TestEvict_UnitsOfAnEvictedKeyAreReadBack,
// TestRace_ALoneProcessEvictingAKeyItDecidesStaysWithinTheLimit). The
// write is on the caller's goroutine, the janitor's, never on a
// request's: an insert past the cap only signals the janitor (see
// insert). Meanwhile the janitor evicts nothing more, so the write is
// bounded in time (see writeEvicted).
func (e *Engine) Evict() int {
	if e.live.Load() <= int64(e.cfg.MaxEntries) {
		return 0
	}
	want := e.live.Load() - int64(float64(e.cfg.MaxEntries)*evictLowWater)
	now := e.nowMs()
	var hist [evictClasses]int64
	e.rangeZones(func(z *Zone) bool {
		z.entries.Range(func(_ string, en *entry) bool {
			if c := en.cur.Load(); c != tombstone {
				hist[evictClass(z, en, c, now)]++
			}
			return true
		})
		return true
	})
	// Find the class at which the coldest want entries end.
	threshold, atThreshold := 0, int64(0)
	for acc := int64(0); threshold < evictClasses; threshold++ {
		if acc+hist[threshold] >= want {
			atThreshold = want - acc
			break
		}
		acc += hist[threshold]
	}
	hasOrigin := e.origin.Load() != nil
	evicted := 0
	var unwritten []evictedEntry
	e.rangeZones(func(z *Zone) bool {
		evicted += z.entries.DeleteMatching(func(id string, en *entry) (bool, bool) {
			c := en.cur.Load()
			if c == tombstone {
				return true, false
			}
			class := evictClass(z, en, c, now)
			if class > threshold || (class == threshold && atThreshold <= 0) {
				return false, false
			}
			if hasOrigin {
				// A full queue refuses the units: the write below takes
				// them, and when it fails the graveyard holds them. Keeping
				// the entry instead let a flood past the cap grow memory
				// without bound while the origin was down
				// (TestEvict_TheCapHoldsWhileTheOriginIsDown).
				e.requeue(z, en)
			}
			cells := [2]*cell{c, en.prev.Load()}
			var end func()
			if hasOrigin && holdsUnwritten(cells) {
				// Marked before the entry leaves the map: the read of
				// the entry that takes its place waits for the write.
				// Buried after the write, as forget buries: buried
				// now, past the graveyard's bound they gave up the
				// units of the cells buried before them, unwritten
				// though the origin answered (64,842 of 101,000 one-unit
				// keys evicted at once, before 2026-11-27).
				end = e.forgets.begin(z.key(id))
				// And the entry that takes its place, made during the
				// write, takes the cells back: a write that fails leaves
				// their units queued, which no read of the origin sees.
				e.orphans.put(z.key(id), cells)
			}
			if !en.cur.CompareAndSwap(c, tombstone) {
				if end != nil {
					e.orphans.taken(z.key(id), cells)
					end()
				}
				return false, false
			}
			if end != nil {
				unwritten = append(unwritten, evictedEntry{z, en, cells, end})
			} else {
				// Buried once the entry has let the cells go: a request
				// that charged a cell between the look above and the swap,
				// with the replay queues full, left its units to the
				// graves, since the entry still held the cell then, and
				// buried before, a cell that held nothing was not
				// remembered. Its unit was then neither written nor
				// counted as lost (TestEvict_EveryUnitIsSentOrCountedAsLost,
				// one run in a few under load). The cells as the entry
				// held them: it holds the tombstone now.
				e.buryCells(z, en, cells)
			}
			// Its strict deadline goes with it: a deadline is a live
			// key's, and the deadlines stay within the entries, so the
			// cap on them (markStrict) binds only when every key is in
			// strict mode. Kept, a zone of a long window held the cap
			// with the deadlines of keys evicted long before (a 30-day
			// signup limit: a month of them), and a key denied in any
			// other zone got no strict mode (an audit of 2026-11-29:
			// TestEvict_TakesTheKeysStrictDeadline). The key's next
			// request reads the origin first, as strict mode would, but
			// for a limit far above its cost (see unread), which then
			// passes the share a key met afresh passes.
			e.dropStrict(z, id)
			if class == threshold {
				atThreshold--
			}
			return true, false
		})
		return true
	})
	e.live.Add(-int64(evicted))
	e.stats.evictions.Add(int64(evicted))
	e.writeEvicted(unwritten)
	if evicted > 0 && e.cfg.OnEvict != nil {
		e.cfg.OnEvict(evicted)
	}
	return evicted
}

// evictedEntry is an entry Evict let go holding units the origin may not
// have yet, and the end of the mark that makes the key's reads wait.
type evictedEntry struct {
	zone  *Zone
	en    *entry
	cells [2]*cell
	end   func()
}

// holdsUnwritten reports whether a cell of cells holds units that no
// write has taken yet, or has a write of the replay on its way.
func holdsUnwritten(cells [2]*cell) bool {
	for _, c := range cells {
		if c != nil && c != tombstone && (c.pending() > 0 || c.state()&stFlushing != 0) {
			return true
		}
	}
	return false
}

// Writes of an eviction. Each is bounded by flushTimeout, as the replay's.
// A pass with a slow but working origin wrote 256 cells a round trip one
// after another: with 100,000 keys evicted and 0.5 s a call, it took
// minutes, while the janitor evicted nothing more and a flood of new keys
// grew memory far past the cap (TestEvict_ASlowOriginDoesNotHoldTheCapOff).
const (
	// evictBatch is the most cells one write of an eviction carries. The
	// origin sends a batch in one round trip, a pipeline of calls of 64
	// cells each, so Redis is held no longer at a time than by the
	// replay's batches of 256.
	evictBatch = 1024
	// evictWrites is how many writes of an eviction are in flight at once:
	// 4,096 cells, about what the fast tier's workers send at once.
	evictWrites = 4
	// evictBudget is how long a pass starts writes: past it, the units of
	// the keys left are queued for the replay, or remembered in the
	// graveyard, as after a failed write, and the reads of those keys wait
	// for nothing. A read waits at most a read timeout for a write anyway
	// (see forgetting), and a Redis that slow has the request path's
	// breaker open, so the reads they were kept from are not made: what
	// the budget gives up is units, counted as lost past the graveyard,
	// not admissions. A pass writes for at most evictBudget + flushTimeout.
	// A working Redis writes far more than a pass evicts at the default
	// cap (100,000 keys) within it.
	evictBudget = time.Second
)

// writeEvicted writes what the cells of evicted hold that the origin has
// not, in batches of evictBatch, evictWrites at a time, and then buries
// them and ends their marks. A cell that a write of the replay holds is
// left out of the batch, and what it took since goes in a second write
// once that one has ended (as forget waits for it before its own):
// waited for one by one before each batch, a pass took a replay's round
// trip for each such cell in turn. So do units charged during the first
// write by a request that still held the entry. A failed write leaves the
// units queued, as the replay's does (and no second write follows it); so
// does the end of the budget (evictBudget) for the keys whose write it
// did not start.
func (e *Engine) writeEvicted(evicted []evictedEntry) {
	deadline := time.Now().Add(evictBudget)
	slots := make(chan struct{}, evictWrites)
	var wg sync.WaitGroup
	from := 0
	for from < len(evicted) {
		o := e.getOrigin()
		if o == nil {
			break
		}
		slots <- struct{}{}
		if time.Now().After(deadline) {
			<-slots
			e.stats.evictionsDeferred.Add(int64(len(evicted) - from))
			break
		}
		batch := make([]Delta, 0, min(len(evicted)-from, evictBatch))
		to := from
		for ; to < len(evicted) && len(batch) < evictBatch; to++ {
			d := evicted[to]
			for _, c := range d.cells {
				if c != nil && c != tombstone {
					batch = e.take(batch, d.zone, d.en, c, true)
				}
			}
		}
		part := evicted[from:to]
		from = to
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-slots }()
			if e.flush(context.Background(), o, batch) == nil {
				batch = batch[:0]
				for _, d := range part {
					batch, _ = e.takeCells(batch, d.zone, d.en, d.cells)
				}
				_ = e.flush(context.Background(), o, batch)
			}
			e.endEvicted(part)
		}()
	}
	wg.Wait()
	e.endEvicted(evicted[from:])
}

// endEvicted queues what the cells of evicted still hold (a failed write,
// units charged since), buries them, lets the key's next entry start from
// the origin when it has them all (see orphans) and ends their marks.
func (e *Engine) endEvicted(evicted []evictedEntry) {
	for _, d := range evicted {
		if e.origin.Load() != nil {
			e.requeueCells(d.zone, d.en, d.cells)
		}
		e.buryCells(d.zone, d.en, d.cells)
		e.orphans.landed(d.zone.key(d.en.id()), d.cells)
		d.end()
	}
}

const (
	ageClasses    = 4  // touched this window, last window, two ago, older
	weightClasses = 65 // bit length of the weight
	evictClasses  = ageClasses * weightClasses
)

// evictClass orders entries for eviction: lower classes go first. The
// order is the key's weight now, what its cells weigh in its next decision
// (the current cell's count, and the previous one's as the sliding window
// weighs it), by bit length, and then its age (windows since it was last
// touched, oldest first). Age came first once: a key that took its whole
// limit at the end of a window, which still weighs nearly all of it just
// after, went before a flood of one-request keys of the new window, and
// was admitted its limit again.
func evictClass(z *Zone, en *entry, c *cell, now int64) int {
	w := z.w
	seq := now / w
	r := now - seq*w
	age := seq - c.seq()
	var weight int64
	switch {
	case age <= 0: // this window's (or ahead of it: a clock stepped back)
		age = 0
		weight = c.count.Load()
		if p := en.previous(c); p != nil {
			weight = SatAdd(weight, weighted(max(p.count.Load(), 0), w, r))
		}
	case age == 1: // last window's: it is the previous cell now
		weight = weighted(max(c.count.Load(), 0), w, r)
	}
	if age >= ageClasses {
		age = ageClasses - 1
	}
	if weight < 0 {
		weight = 0
	}
	return bits.Len64(uint64(weight))*ageClasses + int(ageClasses-1-age)
}
