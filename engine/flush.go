package engine

import (
	"context"
	"sync/atomic"
	"time"
)

const (
	// replayBatch is the number of cells per Flush: one pipeline each.
	replayBatch = 256
	// flushTimeout bounds one Flush. It is off the request path, so it may
	// be longer than a read, but a hung origin must not stall replay.
	flushTimeout = time.Second
)

// Flush replays every pending delta to the current origin now, within
// ctx's deadline; a no-op without origin.
func (e *Engine) Flush(ctx context.Context) error {
	if o := e.getOrigin(); o != nil {
		return e.flushAll(ctx, o)
	}
	return nil
}

// FlushTo replays every pending delta to o now, within ctx's deadline,
// whatever origin the engine uses: for a config whose origin is being let
// go (a reload without it) while it can still take the units.
func (e *Engine) FlushTo(ctx context.Context, o Origin) error {
	if o == nil {
		return nil
	}
	return e.flushAll(ctx, o)
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
	// A cell that ended before this is late: the others may have settled
	// it once a write sent now could still land (prevFinal waits a slow
	// tick and a write's bound more than this).
	ended := sent - time.Duration(e.slowTick.Load()+e.fastTick.Load()).Milliseconds()
	for i := range batch {
		d := &batch[i]
		d.Late = (d.Sequence+1)*d.Key.Window.Milliseconds() <= ended
	}
	err := o.Flush(ctx, batch)
	now := e.nowMs()
	failed := false
	for i := range batch {
		d := &batch[i]
		if d.Done {
			if err == nil {
				e.answered(d.Key, now) // its partition answered
			}
			// A replay refreshes what a read would: both cells. The entry
			// the cell was queued from is the key's, unless it was removed
			// since: then the key's entry, if it has one again.
			en := d.en
			if en.cur.Load() == tombstone {
				en, _ = d.zone.entries.Load(d.Key.Identifier)
			}
			if en != nil {
				e.merge(d.zone, en, d.cell, d.Totals, sent, d.Key, !d.NoPrev)
			} else {
				d.cell.observe(d.Totals, now, e.fastTickMs())
				d.cell.mergeAnswer(d.Totals.Cur, d.Totals.Mine)
				d.cell.setBits(stRead)
				d.cell.extendFresh(sent+e.freshnessMs(), e.freshnessMs())
			}
		} else {
			failed = true
			e.originFailed(e.partition(d.Key))
			x := d.cell.links()
			d.cell.setBits(stUnsure) // the origin may have applied it
			x.own.Add(-d.Delta)
			x.pending.Add(d.Delta)
		}
		e.settle(d)
	}
	e.stats.flushing.Add(-int64(len(batch)))
	e.endedFlush()
	if failed || err != nil {
		e.stats.flushErrors.Add(1)
		if !failed { // an error, though every item was applied
			for i := range batch {
				e.originFailed(e.partition(batch[i].Key))
			}
		}
	} else {
		e.stats.flushes.Add(1)
		e.stats.lastFlush.Store(now)
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
	e.eachBatch(t, func(batch []Delta) bool {
		if err := e.flush(ctx, o, batch); err != nil && first == nil {
			first = err
		}
		n += len(batch)
		return true
	})
	return n, first
}

// eachBatch drains the tier's queue in batches of up to replayBatch cells,
// as many cells as it held when it began (what arrives meanwhile waits for
// the next tick), and hands each batch to send until send returns false.
func (e *Engine) eachBatch(t Tier, send func(batch []Delta) bool) {
	for budget := e.queue(t).len(); budget > 0; budget -= replayBatch {
		batch := e.drain(t, replayBatch, make([]Delta, 0, min(budget, replayBatch)))
		if len(batch) == 0 {
			continue
		}
		if !send(batch) {
			return
		}
	}
}

// replayLoop runs the ticks and the workers until Close. The slow tier
// (keys below half their limit, most of a busy node's keys) is flushed by
// one goroutine, a batch at a time: its pipelines reach the origin one
// after another, each about a millisecond of Redis's time, rather than a
// tick's work in one burst, behind which every other client's call (a
// reservation or a cold read of another node, on its request path) waited.
// During a tick of 16 batches another client's call waited 1.0–1.1 ms
// (median) one batch at a time against 3.5–5.1 ms all together, for a
// tick 25–40 % longer (origin's BenchmarkFlush_ProbeBehindATick, on a real
// redis-server); the load harness's figures are in the README
// (replay_workers, "Side by side"). A tick that finds the last one still
// flushing counts an overrun (Stats.SlowOverruns) and runs after it. The
// fast tier (keys near their limit, whose units other nodes need soon)
// keeps the ReplayWorkers pool, so it never waits behind a slow flush.
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
				} else {
					// A reload took the origin away after the tick took
					// the batch: its units go back to pending, for the
					// next origin (sendUnsent). Dropped, its cells stayed
					// flushing, and nothing they counted was sent again.
					e.giveBack(batch)
				}
			}
		}()
	}
	// A slow tick while the slow tier is still flushing runs once more
	// after it: the kick holds one (slowBusy tells the tick it overran).
	slowKick := make(chan struct{}, 1)
	var slowBusy atomic.Bool
	go func() {
		defer func() { done <- struct{}{} }()
		for range slowKick {
			slowBusy.Store(true)
			e.flushSlow()
			slowBusy.Store(false)
		}
	}()
	slow := time.NewTimer(time.Duration(e.slowTick.Load()))
	fast := time.NewTimer(time.Duration(e.fastTick.Load()))
	defer func() {
		slow.Stop()
		fast.Stop()
		close(work)
		close(slowKick)
		for i := 0; i <= e.cfg.ReplayWorkers; i++ {
			<-done
		}
	}()
	for {
		select {
		case <-e.stop:
			return
		case <-slow.C:
			slow.Reset(time.Duration(e.slowTick.Load()))
			if slowBusy.Load() {
				e.stats.slowOverruns.Add(1)
			}
			select {
			case slowKick <- struct{}{}:
			default:
			}
			continue
		case <-fast.C:
			fast.Reset(time.Duration(e.fastTick.Load()))
		}
		if e.getOrigin() == nil {
			continue
		}
		stopped := false
		e.eachBatch(Fast, func(batch []Delta) bool {
			select {
			case work <- batch:
				return true
			case <-e.stop:
				e.giveBack(batch)
				stopped = true
				return false
			}
		})
		if stopped {
			return
		}
	}
}

// flushSlow flushes the slow tier's queue, one batch at a time, until it
// has sent what was queued when it began or the engine stops (Close
// flushes the rest).
func (e *Engine) flushSlow() {
	if e.getOrigin() == nil {
		return
	}
	e.eachBatch(Slow, func(batch []Delta) bool {
		o := e.getOrigin()
		select {
		case <-e.stop:
			o = nil
		default:
		}
		if o == nil {
			e.giveBack(batch)
			return false
		}
		_ = e.flush(context.Background(), o, batch)
		return true
	})
}

// settle ends a cell's flush and queues the cell again if units arrived
// (or came back) meanwhile, on the fast tick if it came from there: a cell
// near its limit whose flush failed goes out at the first fast tick after
// the origin returns.
func (e *Engine) settle(d *Delta) {
	d.cell.clearBits(stFlushing)
	if d.cell.pending() > 0 {
		e.markDirty(d.zone, d.en, d.cell, d.fast || d.cell.state()&stShared != 0)
	}
}

// giveBack returns drained deltas to their cells unflushed, and queues
// the cells again. Left out of the queues, a cell no entry and no grave
// held any more (evicted, its grave taken by a later one) kept its units
// where nothing would find them: a shutdown while the slow tier flushed
// gave back its batch, and Close's last flush left out up to 256 units,
// counted nowhere (TestEvict_TheBudgetCountsTheKeysItDefers).
func (e *Engine) giveBack(batch []Delta) {
	for i := range batch {
		d := &batch[i]
		x := d.cell.links()
		x.own.Add(-d.Delta)
		x.pending.Add(d.Delta)
		e.settle(d)
	}
	e.stats.flushing.Add(-int64(len(batch)))
	e.endedFlush()
}

// endedFlush wakes whoever waits for a write to end (awaitFlush); one
// atomic swap when nobody does.
func (e *Engine) endedFlush() {
	if ch := e.flushEnded.Swap(nil); ch != nil {
		close(*ch)
	}
}

// awaitFlush waits until c has no write in flight, at most flushTimeout
// (a write's own bound), and reports whether it has none.
func (e *Engine) awaitFlush(c *cell) bool {
	if c.state()&stFlushing == 0 {
		return true
	}
	timeout := time.NewTimer(flushTimeout)
	defer timeout.Stop()
	for {
		ch := e.flushEndedWhile(c)
		if ch == nil {
			return true
		}
		select {
		case <-ch:
		case <-timeout.C:
			return c.state()&stFlushing == 0
		}
	}
}

// flushEndedWhile returns a channel that the end of any write closes, or
// nil when c has no write in flight.
func (e *Engine) flushEndedWhile(c *cell) <-chan struct{} {
	return e.flushEndedWhen(func() bool { return c.state()&stFlushing != 0 })
}

// flushEndedWhen returns a channel that the end of any write closes, or
// nil when busy reports no write to wait for: asked after the channel is
// in place, so a write that ends from then on closes it.
func (e *Engine) flushEndedWhen(busy func() bool) <-chan struct{} {
	for {
		ch := e.flushEnded.Load()
		if ch == nil {
			fresh := make(chan struct{})
			if !e.flushEnded.CompareAndSwap(nil, &fresh) {
				continue
			}
			ch = &fresh
		}
		if !busy() {
			return nil
		}
		return *ch
	}
}

// AwaitWrites waits, within ctx, until no write of the replay is in
// flight, and reports whether none is. A write that fails gives its units
// back to their cells: once the origin is let go (SetOrigin(nil)), no new
// write starts, and a caller that counts what is left unsent (DropUnsent)
// waits first. Once a write on a stalled Redis ended after that count,
// and its units, given back to a cell nobody would write again, were lost
// uncounted.
func (e *Engine) AwaitWrites(ctx context.Context) bool {
	for {
		ended := e.flushEndedWhen(func() bool { return e.stats.flushing.Load() > 0 })
		if ended == nil {
			return true
		}
		select {
		case <-ended:
		case <-ctx.Done():
			return false
		}
	}
}

// flushAll replays every pending delta of every cell, for shutdown. Cells
// with a write in flight are skipped (see AwaitWrites). A pass that fails
// is tried again after a pause, at most flushPasses in all, within ctx:
// one failed write must not give up the cells only the queues hold
// (evicted keys, long rotated cells), and an origin that keeps failing
// must not hold the caller for longer than the passes.
func (e *Engine) flushAll(ctx context.Context, o Origin) error {
	var err error
	for pass := 1; ; pass++ {
		if err = e.flushPass(ctx, o); err == nil || pass == flushPasses || ctx.Err() != nil {
			return err
		}
		t := time.NewTimer(flushRetryPause)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
	}
}

const (
	// flushPasses bounds flushAll's passes.
	flushPasses = 3
	// flushRetryPause is flushAll's pause between passes.
	flushRetryPause = 100 * time.Millisecond
)

// flushPass is one pass of flushAll, and returns its first error.
func (e *Engine) flushPass(ctx context.Context, o Origin) error {
	batch := make([]Delta, 0, replayBatch)
	var first error
	send := func() {
		if err := e.flush(ctx, o, batch); err != nil && first == nil {
			first = err
		}
		batch = batch[:0]
	}
	// Queued cells first: an evicted or long rotated cell is only there.
	// Those queued now, once: a write that fails queues its cells again
	// (settle), for the next pass; popping them again in this one would
	// loop for as long as the origin fails (with Redis down, a shutdown
	// spun on a core until the process exited without it).
	for _, q := range []*queue{e.queue(Fast), e.queue(Slow)} {
		for n := q.len(); n > 0 && ctx.Err() == nil; n-- {
			d, ok := q.pop()
			if !ok {
				break
			}
			if batch = e.take(batch, d.zone, d.en, d.cell, false); len(batch) >= replayBatch {
				send()
			}
		}
	}
	// Then the cells let go while the queues were full, which only the
	// graves hold, and the live entries'.
	for _, d := range e.unqueuedGraves() {
		if batch = e.take(batch, d.zone, d.en, d.cell, false); len(batch) >= replayBatch {
			send()
		}
	}
	e.rangeZones(func(z *Zone) bool {
		z.entries.Range(func(id string, en *entry) bool {
			c := en.cur.Load()
			if c == tombstone {
				return true
			}
			if p := en.prev.Load(); p != nil {
				batch = e.take(batch, z, en, p, false)
			}
			batch = e.take(batch, z, en, c, false)
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
	for _, d := range e.unqueuedGraves() {
		drop(d.cell)
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
