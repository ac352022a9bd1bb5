package engine

import (
	"sync/atomic"

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
//
// This file holds the queues; flush.go the ticks, the workers and the
// flush itself; resend.go what an origin that lost its units gets back.

// replayQueueLen is the capacity of each replay queue: more cells than a
// node commits to in a fast tick, at 88 bytes a slot (xsync pads each
// slot's item to a cache line of its own).
const replayQueueLen = 1 << 14

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

// dirtyCell is a cell waiting in a replay queue, with what names it: the
// entry it was queued from holds the identifier, and spares the flush a
// lookup of the key (see Engine.flush).
type dirtyCell struct {
	zone *Zone
	en   *entry
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
func (q *queue) push(z *Zone, en *entry, c *cell) bool {
	if !q.q.TryEnqueue(dirtyCell{z, en, c}) {
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
// both are full, with no dirty bit, so that the janitor queues it again:
// from its entry, or from the graves for a cell its entry let go.
func (e *Engine) markDirty(z *Zone, en *entry, c *cell, fast bool) {
	st := c.state()
	if fast {
		if st&stFast != 0 {
			return
		}
		if beforeFastMark != nil {
			beforeFastMark()
		}
		was, set := c.setBitsWas(stDirty | stFast)
		if !set {
			return
		}
		if e.queue(Fast).push(z, en, c) {
			return
		}
		e.stats.replayDrops.Add(1)
		if was&stDirty != 0 {
			// Already in the slow queue when the bits were set: it
			// replays there. Judged by the state read before, a cell
			// the slow replay took in between kept the dirty bit its
			// take had cleared, in no queue: nothing queued it again, the
			// janitor and the graves skipped it as queued, and a cell let
			// go that way was neither written nor counted as lost
			// (TestReplay_AFastMarkAsTheSlowReplayTakesTheCellLeavesItInNoQueue).
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
	if !e.queue(Slow).push(z, en, c) {
		c.clearBits(stDirty)
		e.stats.replayDrops.Add(1)
		if !en.holds(c) {
			// Let go (evicted, forgotten, rotated past): the janitor's
			// pass over the entries never finds it, the graves do
			// (TestEvict_EveryUnitIsSentOrCountedAsLost).
			e.buryCell(z, en, c)
		}
	}
}

// beforeFastMark, when set (by a test), runs in markDirty between the
// read of the cell's state and the setting of its bits for the fast queue.
var beforeFastMark func()

// drain takes up to max due deltas from the tier's queue.
func (e *Engine) drain(t Tier, max int, out []Delta) []Delta {
	q := e.queue(t)
	for len(out) < max {
		d, ok := q.pop()
		if !ok {
			break
		}
		out = e.take(out, d.zone, d.en, d.cell, t == Fast)
	}
	return out
}

// take moves c's pending delta into a Delta. The dirty bits are cleared
// first, so a commit that lands after the swap queues the cell again. A
// cell with a flush in flight is skipped: that flush queues it again when
// it ends (see settle). A plain cell has nothing to replay; every cell that
// goes into a Delta is a linked cell.
func (e *Engine) take(out []Delta, z *Zone, en *entry, c *cell, fast bool) []Delta {
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
		e.endedFlush() // a forget may have seen the bit for this moment
		return out
	}
	e.stats.flushing.Add(1) // until flush or giveBack is done with it
	return append(out, Delta{Key: z.key(en.id()), Sequence: c.seq(), Incarnation: c.incarnation(), Delta: d, Own: x.own.Add(d),
		NoPrev: c.state()&stPrevSettled != 0, zone: z, en: en, cell: c, fast: fast})
}
