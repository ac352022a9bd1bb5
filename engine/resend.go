package engine

import "time"

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
	resend := func(z *Zone, en *entry, c *cell) {
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
			e.markDirty(z, en, c, true)
			n++
			e.awaitQueued(z, en, c)
		}
	}
	e.rangeZones(func(z *Zone) bool {
		z.entries.Range(func(id string, en *entry) bool {
			resend(z, en, en.cur.Load())
			resend(z, en, en.prev.Load())
			return true
		})
		return true
	})
	// Cells dropped in their window (forgotten, evicted) hold units the
	// origin had too; the replay queue holds a dropped cell as well as a
	// live one.
	for _, d := range e.graves.list() {
		resend(d.zone, d.en, d.cell)
	}
	e.stats.resends.Add(int64(n))
	e.distrust(-1, e.nowMs()) // the others' totals come back within a flush period
	return n
}

// awaitQueuedStep bounds one wait of awaitQueued.
const awaitQueuedStep = 100 * time.Millisecond

// awaitQueued waits, a fast tick at a time, until c is queued for replay
// (or with it), when both queues were full: Resend sends every live cell,
// more than the queues hold at once. A manual engine does not wait (its
// janitor's Sweep queues the cell again), nor does a closed one, nor one
// whose origin a reload took away (the queues no longer drain; the next
// origin gets every count, resendAll).
func (e *Engine) awaitQueued(z *Zone, en *entry, c *cell) {
	for !e.cfg.Manual && e.getOrigin() != nil && c.state()&(stDirty|stFlushing) == 0 && c.pending() > 0 {
		// A fast tick, at most awaitQueuedStep: the origin may go meanwhile.
		t := time.NewTimer(min(time.Duration(e.fastTick.Load()), awaitQueuedStep))
		select {
		case <-e.stop:
			t.Stop()
			return
		case <-t.C:
		}
		e.markDirty(z, en, c, true)
	}
}
