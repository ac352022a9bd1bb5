package engine

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/puzpuzpuz/xsync/v4"
)

// Replay hands committed units to the origin off the request path. A commit
// adds its cost to the cell's pending delta and, the first time, queues the
// cell in the slow or the fast queue by its pressure (a shared cell always
// in the fast one); the ticks drain the queues in batches to the workers,
// which call Origin.Flush and merge the totals back with max. A full queue
// leaves the delta pending in its cell (counted as a drop) until the next
// commit or the janitor queues it again: the request path never waits for
// replay, and nothing committed is stranded.

const (
	// replayQueueLen is the capacity of each replay queue: more cells than a
	// node commits to in a fast tick, at 56 bytes a slot.
	replayQueueLen = 1 << 14
	// replayBatch is the number of cells per Flush: one pipeline each.
	replayBatch = 256
	// flushTimeout bounds one Flush. It is off the request path, so it may
	// be longer than a read, but a hung origin must not stall replay.
	flushTimeout = time.Second
)

// Tier names a replay queue.
type Tier int

const (
	// Slow is the queue of cells below half their limit that only this
	// process touches.
	Slow Tier = iota
	// Fast is the queue of cells at half their limit or more, and of shared
	// cells: other processes need their units soon.
	Fast
)

// dirtyCell is a cell waiting in a replay queue, with what names it.
type dirtyCell struct {
	zone *Zone
	id   string
	cell *cell
}

// queue is a bounded lock-free queue of dirty cells with an approximate
// length (xsync's MPMC queue has none; the loop sizes its batches by it).
type queue struct {
	q *xsync.MPMCQueue[dirtyCell]
	n atomic.Int64
}

func newQueue(n int) *queue { return &queue{q: xsync.NewMPMCQueue[dirtyCell](n)} }

// push enqueues c and reports false when the queue is full.
func (q *queue) push(z *Zone, id string, c *cell) bool {
	if !q.q.TryEnqueue(dirtyCell{z, id, c}) {
		return false
	}
	q.n.Add(1)
	return true
}

// pop dequeues one cell; ok is false when the queue is empty.
func (q *queue) pop() (dirtyCell, bool) {
	d, ok := q.q.TryDequeue()
	if ok {
		q.n.Add(-1)
	}
	return d, ok
}

// len returns about how many cells are queued.
func (q *queue) len() int { return int(max(q.n.Load(), 0)) }

// replayQueues are the two replay queues.
type replayQueues struct{ slow, fast *queue }

// queue returns the tier's queue; with no origin ever set, an empty one.
func (e *Engine) queue(t Tier) *queue {
	q := e.queues.Load()
	switch {
	case q == nil:
		return emptyQueue
	case t == Fast:
		return q.fast
	}
	return q.slow
}

// emptyQueue stands in for the queues of an engine that never had an
// origin; nothing is ever pushed to it.
var emptyQueue = newQueue(1)

// markDirty queues c for replay in the tier its pressure (or sharing) asks
// for. A cell already queued in that tier is not queued again. Whatever
// the queues hold, a cell with pending units ends up in a queue or, when
// both are full, with no dirty bit, so that the janitor queues it again.
func (e *Engine) markDirty(z *Zone, id string, c *cell, fast bool) {
	st := c.state.Load()
	if fast {
		if st&stFast != 0 || !c.setBits(stDirty|stFast) {
			return
		}
		if e.queue(Fast).push(z, id, c) {
			return
		}
		e.stats.replayDrops.Add(1)
		if st&stDirty != 0 {
			// Already in the slow queue: it replays there.
			c.clearBits(stFast)
			return
		}
		c.clearBits(stDirty | stFast)
	} else if st&stDirty != 0 {
		return
	}
	if !c.setBits(stDirty) {
		return
	}
	if !e.queue(Slow).push(z, id, c) {
		c.clearBits(stDirty)
		e.stats.replayDrops.Add(1)
	}
}

// drain takes up to max due deltas from the tier's queue.
func (e *Engine) drain(t Tier, max int, out []Delta) []Delta {
	q := e.queue(t)
	for len(out) < max {
		d, ok := q.pop()
		if !ok {
			break
		}
		out = e.take(out, d.zone, d.id, d.cell, t == Fast)
	}
	return out
}

// take moves c's pending delta into a Delta. The dirty bits are cleared
// first, so a commit that lands after the swap queues the cell again. A
// cell with a flush in flight is skipped: that flush queues it again when
// it ends (see settle). A plain cell has nothing to replay; every cell that
// goes into a Delta is a linked cell.
func (e *Engine) take(out []Delta, z *Zone, id string, c *cell, fast bool) []Delta {
	x := c.links()
	if x == nil {
		return out
	}
	c.clearBits(stDirty | stFast)
	if !c.setBits(stFlushing) {
		return out
	}
	// The write carries every unit pending holds: none is unsure any more
	// (cleared first: a Resend meanwhile sets it again).
	c.clearBits(stUnsure)
	d := x.pending.Swap(0)
	if d == 0 {
		c.clearBits(stFlushing)
		return out
	}
	return append(out, Delta{Key: z.key(id), Sequence: c.seq, Incarnation: c.inc, Delta: d, Own: x.own.Add(d), zone: z, cell: c, fast: fast})
}

// flush sends one batch to the origin and merges the results. Items the
// origin did not apply go back to their cells, to be replayed later.
func (e *Engine) flush(ctx context.Context, o Origin, batch []Delta) error {
	if len(batch) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, flushTimeout)
	defer cancel()
	sent := e.nowMs()
	err := o.Flush(ctx, batch)
	now := e.nowMs()
	failed := false
	for i := range batch {
		d := &batch[i]
		if d.Done {
			// A replay refreshes what a read would: both cells.
			if en, ok := d.zone.entries.Load(d.Key.Identifier); ok {
				e.merge(en, d.cell, d.Totals, sent)
			} else {
				d.cell.observe(d.Totals, now, e.fastTickMs())
				d.cell.mergeAnswer(d.Totals.Cur, d.Totals.Mine)
				d.cell.setBits(stRead)
				d.cell.extendFresh(sent + e.freshnessMs())
			}
		} else {
			failed = true
			x := d.cell.links()
			d.cell.setBits(stUnsure) // the origin may have applied it
			x.own.Add(-d.Delta)
			x.pending.Add(d.Delta)
		}
		e.settle(d)
	}
	if failed || err != nil {
		e.stats.flushErrors.Add(1)
		e.originFailed()
	} else {
		e.stats.flushes.Add(1)
		e.stats.lastFlush.Store(now)
		e.originAnswered(now)
	}
	return err
}

// ReplayOnce drains the tier's queue and flushes it on the calling
// goroutine: one iteration of the replay loop, for tests and shutdown. It
// returns the number of cells flushed and the first error.
func (e *Engine) ReplayOnce(ctx context.Context, t Tier) (int, error) {
	o := e.getOrigin()
	if o == nil {
		return 0, nil
	}
	var first error
	n := 0
	for budget := e.queue(t).len(); budget > 0; budget -= replayBatch {
		batch := e.drain(t, replayBatch, make([]Delta, 0, replayBatch))
		if len(batch) == 0 && e.queue(t).len() == 0 {
			break
		}
		if err := e.flush(ctx, o, batch); err != nil && first == nil {
			first = err
		}
		n += len(batch)
	}
	return n, first
}

// replayLoop runs the ticks and the workers until Close.
func (e *Engine) replayLoop() {
	defer e.wg.Done()
	work := make(chan []Delta)
	done := make(chan struct{})
	for i := 0; i < e.cfg.ReplayWorkers; i++ {
		go func() {
			defer func() { done <- struct{}{} }()
			for batch := range work {
				if o := e.getOrigin(); o != nil {
					_ = e.flush(context.Background(), o, batch)
				}
			}
		}()
	}
	slow := time.NewTimer(time.Duration(e.slowTick.Load()))
	fast := time.NewTimer(time.Duration(e.fastTick.Load()))
	defer func() {
		slow.Stop()
		fast.Stop()
		close(work)
		for i := 0; i < e.cfg.ReplayWorkers; i++ {
			<-done
		}
	}()
	for {
		var t Tier
		select {
		case <-e.stop:
			return
		case <-slow.C:
			t = Slow
			slow.Reset(time.Duration(e.slowTick.Load()))
		case <-fast.C:
			t = Fast
			fast.Reset(time.Duration(e.fastTick.Load()))
		}
		if e.getOrigin() == nil {
			continue
		}
		for budget := e.queue(t).len(); budget > 0; budget -= replayBatch {
			batch := e.drain(t, replayBatch, make([]Delta, 0, min(budget, replayBatch)))
			if len(batch) == 0 {
				continue
			}
			select {
			case work <- batch:
			case <-e.stop:
				e.giveBack(batch)
				return
			}
		}
	}
}

// settle ends a cell's flush and queues the cell again if units arrived
// (or came back) meanwhile, on the fast tick if it came from there: a cell
// near its limit whose flush failed goes out at the first fast tick after
// the origin returns.
func (e *Engine) settle(d *Delta) {
	d.cell.clearBits(stFlushing)
	if d.cell.pending() > 0 {
		e.markDirty(d.zone, d.Key.Identifier, d.cell, d.fast || d.cell.state.Load()&stShared != 0)
	}
}

// giveBack returns drained deltas to their cells unflushed.
func (e *Engine) giveBack(batch []Delta) {
	for i := range batch {
		d := &batch[i]
		x := d.cell.links()
		x.own.Add(-d.Delta)
		x.pending.Add(d.Delta)
		d.cell.clearBits(stFlushing)
	}
}

// flushAll replays every pending delta of every cell, for shutdown.
func (e *Engine) flushAll(ctx context.Context, o Origin) error {
	batch := make([]Delta, 0, replayBatch)
	var first error
	send := func() {
		if err := e.flush(ctx, o, batch); err != nil && first == nil {
			first = err
		}
		batch = batch[:0]
	}
	// Queued cells first: an evicted or long rotated cell is only there.
	for _, q := range []*queue{e.queue(Fast), e.queue(Slow)} {
		for {
			d, ok := q.pop()
			if !ok {
				break
			}
			if batch = e.take(batch, d.zone, d.id, d.cell, false); len(batch) >= replayBatch {
				send()
			}
		}
	}
	e.rangeZones(func(z *Zone) bool {
		z.entries.Range(func(id string, en *entry) bool {
			c := en.cur.Load()
			if c == tombstone {
				return true
			}
			if p := en.prev.Load(); p != nil {
				batch = e.take(batch, z, id, p, false)
			}
			batch = e.take(batch, z, id, c, false)
			if len(batch) >= replayBatch {
				send()
			}
			return ctx.Err() == nil
		})
		return ctx.Err() == nil
	})
	send()
	if first == nil {
		first = ctx.Err()
	}
	return first
}

// Resend queues every cell's whole own total for replay again, for an
// origin that lost what it held (a Redis restarted empty): writes are
// idempotent, so the origin gets back exactly what this process had added,
// also for keys no request touches any more. It returns the number of
// cells queued. Units move from own to pending, so the next write carries
// the same absolute total as before: a write in flight meanwhile cannot
// count twice. Every cell held goes, whatever its age by this process's
// clock, which may be the one that is off: a write of a cell past its
// expiry sets an expiry in the past, which removes it again.
func (e *Engine) Resend() int {
	if e.getOrigin() == nil {
		return 0
	}
	n := 0
	resend := func(z *Zone, id string, c *cell) {
		if c == nil || c == tombstone {
			return
		}
		x := c.links()
		if x == nil {
			return
		}
		if o := x.own.Load(); o > 0 {
			c.setBits(stUnsure) // first: the origin may still hold them
			x.own.Add(-o)
			x.pending.Add(o)
			e.markDirty(z, id, c, true)
			n++
			e.awaitQueued(z, id, c)
		}
	}
	e.rangeZones(func(z *Zone) bool {
		z.entries.Range(func(id string, en *entry) bool {
			resend(z, id, en.cur.Load())
			resend(z, id, en.prev.Load())
			return true
		})
		return true
	})
	// Cells dropped in their window (forgotten, evicted) hold units the
	// origin had too; the replay queue holds a dropped cell as well as a
	// live one.
	g := &e.graves
	g.mu.Lock()
	graves := append([]dirtyCell(nil), g.cells...)
	g.mu.Unlock()
	for _, d := range graves {
		resend(d.zone, d.id, d.cell)
	}
	e.stats.resends.Add(int64(n))
	e.distrust(e.nowMs()) // the others' totals come back within a flush period
	return n
}

// awaitQueued waits, a fast tick at a time, until c is queued for replay
// (or with it), when both queues were full: Resend sends every live cell,
// more than the queues hold at once. A manual engine does not wait (its
// janitor's Sweep queues the cell again), nor does a closed one.
func (e *Engine) awaitQueued(z *Zone, id string, c *cell) {
	for !e.cfg.Manual && c.state.Load()&(stDirty|stFlushing) == 0 && c.pending() > 0 {
		t := time.NewTimer(time.Duration(e.fastTick.Load()))
		select {
		case <-e.stop:
			t.Stop()
			return
		case <-t.C:
		}
		e.markDirty(z, id, c, true)
	}
}

// DropUnsent gives up the committed units no origin has received yet, when
// the origin goes away for good (a reload without Redis after its last
// flush, or shutdown): it returns their number, which the caller reports
// as lost, and counts it in Stats.LostUnits. Cells keep their counts; only
// the replay of the units is given up.
func (e *Engine) DropUnsent() int64 {
	var lost int64
	drop := func(c *cell) {
		if c == nil || c == tombstone {
			return
		}
		if x := c.links(); x != nil {
			lost = SatAdd(lost, x.pending.Swap(0))
		}
	}
	for _, q := range []*queue{e.queue(Fast), e.queue(Slow)} {
		for {
			d, ok := q.pop()
			if !ok {
				break
			}
			d.cell.clearBits(stDirty | stFast)
			drop(d.cell)
		}
	}
	e.rangeZones(func(z *Zone) bool {
		z.entries.Range(func(_ string, en *entry) bool {
			drop(en.cur.Load())
			drop(en.prev.Load())
			return true
		})
		return true
	})
	e.stats.lostUnits.Add(lost)
	return lost
}
