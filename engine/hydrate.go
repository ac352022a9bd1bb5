package engine

import (
	"context"
	"time"
)

// Reads from the origin on the request path, by pressure tier
// (effective / limit, cost included):
//
//	cold cell (first touch)        read synchronously, once (single flight)
//	< 50 %                         a stale cell refreshes in the background
//	50–90 %                        a stale cell refreshes synchronously first
//	≥ 90 %, or strict mode         a decision that would allow refreshes
//	                               synchronously first, unless the cell was
//	                               synced within the last fast tick
//
// The last rule keeps the final tenth of a quota decided on a count at most
// one fast tick old, which is as fresh as the replays of other nodes can
// make it, without one round trip per request.
//
// Every synchronous wait is bounded by the read timeout, whatever the
// origin does; on timeout, error or an open breaker the decision proceeds on
// local state and the cell is not marked fresh.

// hydrateRetry is how long a cell whose hydration failed decides locally
// before it reads again: long enough that a dead origin costs no request a
// read each, short enough that a recovered origin is used within a blink.
const hydrateRetry = 250 * time.Millisecond

// maxBackgroundReads bounds background refreshes in flight, so a burst of
// stale keys cannot start unbounded goroutines.
const maxBackgroundReads = 64

// flight is one origin read shared by every request that needs it.
type flight struct {
	done chan struct{}
}

// converge brings lc's cell as close to the origin as its tier asks for.
func (e *Engine) converge(ctx context.Context, o Origin, lc *located, l *Limit, now int64) {
	c := lc.cur
	if c.state.Load()&stHydrated == 0 {
		if now >= c.fresh.Load() {
			e.read(ctx, o, lc, true)
		}
		return
	}
	cur, prev := lc.counts()
	effective := cur + weighted(prev, lc.w, lc.r) + l.Cost
	if effective > l.Limit {
		return // a denial: never pays a round trip
	}
	fresh := c.fresh.Load()
	switch {
	case pressureAtLeast(effective, l.Limit, 9, 10) || strictUntil(lc.zone, lc.id) > now:
		if now-(fresh-e.freshnessMs()) >= e.fastTickMs() {
			e.read(ctx, o, lc, true)
		}
	case now < fresh:
	case pressureAtLeast(effective, l.Limit, 1, 2):
		e.read(ctx, o, lc, true)
	default:
		e.read(ctx, o, lc, false)
	}
}

// read refreshes lc's cells from the origin, sharing one read per cell. With
// wait it returns when the read is done or the read timeout has passed;
// without, it starts the read in the background (if the background budget
// allows) and returns at once.
func (e *Engine) read(ctx context.Context, o Origin, lc *located, wait bool) {
	f, started := e.startRead(o, lc, wait)
	if f == nil || !wait {
		if started {
			e.stats.backgroundReads.Add(1)
		}
		return
	}
	e.stats.syncReads.Add(1)
	if !started {
		e.stats.sharedReads.Add(1)
	}
	t := time.NewTimer(e.readTimeoutD())
	defer t.Stop()
	select {
	case <-f.done:
	case <-t.C:
		e.stats.readWaitTimeouts.Add(1)
	case <-ctx.Done():
	}
}

// startRead returns the read in flight for lc's cell, starting one if
// there is none. It reports whether this call started it. A background
// caller over budget gets nil.
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
	key, en, c := lc.key(), lc.en, lc.cur
	go func() {
		defer func() {
			e.flights.Delete(c)
			close(f.done)
			if !wait {
				e.bgReads.Add(-1)
			}
		}()
		e.readCell(o, key, en, c)
	}()
	return f, true
}

// readCell performs one origin read of c and the cell before it and merges
// the totals.
func (e *Engine) readCell(o Origin, key Key, en *entry, c *cell) {
	ctx, cancel := context.WithTimeout(context.Background(), e.readTimeoutD())
	defer cancel()
	start := e.nowMs()
	curTotal, prevTotal, err := o.Read(ctx, key, c.seq)
	now := e.nowMs()
	if err != nil {
		e.stats.readErrors.Add(1)
		if c.state.Load()&stHydrated == 0 {
			c.fresh.Store(now + hydrateRetry.Milliseconds())
		}
		return
	}
	e.stats.reads.Add(1)
	e.stats.lastRead.Store(now)
	c.mergeOrigin(curTotal)
	if prevTotal > 0 {
		p := en.previous(c)
		if p == nil && en.cur.Load() == c {
			// The origin knows a previous cell this process never saw.
			old := en.prev.Load()
			n := &cell{seq: c.seq - 1}
			n.state.Store(stHydrated)
			if (old == nil || old.seq < n.seq) && en.prev.CompareAndSwap(old, n) {
				p = n
			} else {
				p = en.previous(c)
			}
		}
		if p != nil {
			p.mergeOrigin(prevTotal)
		}
	}
	c.setBits(stHydrated)
	// Freshness counts from when the read was sent: the origin's answer is
	// at least that recent.
	c.extendFresh(start + e.freshnessMs())
}
