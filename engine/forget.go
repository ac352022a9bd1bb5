package engine

import (
	"context"
	"errors"
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// Forget drops key's entry and strict deadline on this process. With an
// origin the next request reads the key again from it. It reports whether
// there was anything to forget.
func (e *Engine) Forget(key Key) bool {
	z, id, ok := e.findKey(key)
	if !ok {
		return false
	}
	return e.forget(z, id, noDrop)
}

// ForgetMatching forgets, as Forget does, every key of the zone namespace
// with window whose identifier (as the engine holds it: normalized, see
// NormalizeIdentifier) match accepts, and returns how many. For a key
// named as it left the process (an HMAC, a hashed long identifier), as a
// region's reset names it; it scans the zone.
func (e *Engine) ForgetMatching(namespace string, window time.Duration, match func(id string) bool) int {
	return e.forgetMatching(namespace, window, match, noDrop)
}

// DropMatching forgets the keys ForgetMatching would, for a reset made at
// at (Unix ms), in the window of sequence at / window: the units this
// process has not replayed of their cells of that window and the one
// before (those the reset marks at the origin) are dropped, not written.
// They were admitted before it heard of the reset, nearly all of
// them before the reset itself (the others hear of it within a round trip
// or two), and a reset takes off every unit of those cells before it;
// written now, after the reset's marks, they would count again. Units
// held through an outage of Redis would count in full: the reset reaches
// such a process when Redis does, before its replay resumes (the
// breaker's wait). But a cell made after at (see madeAt) holds only units
// admitted after the reset, which the region must count: they are written,
// as are the units of later windows, which no mark covers, as Forget
// writes them. Before, a process cut off from Redis that met a key after
// a reset dropped what it admitted of the key, and the region admitted
// the limit again. What it had written stays written (the marks take it
// off); a write on its way lands as it would.
func (e *Engine) DropMatching(namespace string, window time.Duration, match func(id string) bool, at int64) int {
	return e.forgetMatching(namespace, window, match, resetDrop{upTo: at / window.Milliseconds(), at: at})
}

// resetDrop is what a reset drops (DropMatching): the units of the cells
// up to sequence upTo not made after at (Unix ms).
type resetDrop struct{ upTo, at int64 }

// covers reports whether the reset drops the units of c: a cell of the
// two windows the reset marks at the origin (upTo and the one before),
// not made after it. A cell of an older window keeps its units, which
// no mark takes off: a process whose clock had stepped back an hour held
// units of a window then that it dropped at a reset made on the true
// clock, and once its clock stepped back again it admitted them anew (9
// for a limit of 8, property seed 1795908793839211404;
// TestDropMatching_AResetKeepsTheUnitsOfOlderWindows).
func (r resetDrop) covers(c *cell) bool {
	return c != nil && c != tombstone && c.seq() <= r.upTo && c.seq() >= r.upTo-1 && !c.madeAfter(r.at)
}

// coversAny reports whether the reset drops the units of a cell of en.
func (r resetDrop) coversAny(en *entry) bool {
	cur := en.cur.Load()
	return cur == tombstone || r.covers(cur) || r.covers(en.prev.Load())
}

// noDrop is forget's drop when it drops nothing: below every sequence.
var noDrop = resetDrop{upTo: math.MinInt64}

func (e *Engine) forgetMatching(namespace string, window time.Duration, match func(id string) bool, drop resetDrop) int {
	z, ok := e.lookupZone(Key{Namespace: namespace, Window: window})
	if !ok {
		return 0
	}
	ids := matchingEntries(z, match)
	z.strict.Range(func(id string, _ *atomic.Int64) bool {
		if match(id) {
			ids = append(ids, id)
		}
		return true
	})
	n := 0
	for _, id := range ids {
		if e.forget(z, id, drop) {
			n++
		}
	}
	if drop != noDrop {
		e.graves.dropReset(z, match, drop)
		// Cells let go before with units the reset takes off: a key
		// that took them back would count them again.
		e.orphans.prune(e.nowMs(), func(k Key, cells [2]*cell) bool {
			return k.Namespace == namespace && k.Window == window && match(k.Identifier) &&
				(drop.covers(cells[0]) || drop.covers(cells[1]))
		})
	}
	return n
}

// matchingEntries returns the identifiers of z's entries that match
// accepts, collected before anything is done to them.
func matchingEntries(z *Zone, match func(id string) bool) []string {
	var ids []string
	z.entries.Range(func(id string, _ *entry) bool {
		if match(id) {
			ids = append(ids, id)
		}
		return true
	})
	return ids
}

// FlushMatching writes, now, what this process has not replayed yet of
// every key of the zone namespace with window whose identifier match
// accepts (as ForgetMatching), and returns the first error: a failed write
// leaves its units queued. It forgets nothing. A region's reset calls it
// before it marks the key's cells, and forgets the key only once the
// region took the reset: a reset Redis refuses changes nothing here.
func (e *Engine) FlushMatching(namespace string, window time.Duration, match func(id string) bool) error {
	o := e.getOrigin()
	if o == nil {
		return nil
	}
	z, ok := e.lookupZone(Key{Namespace: namespace, Window: window})
	if !ok {
		return nil
	}
	ids := matchingEntries(z, match)
	var first error
	for _, id := range ids {
		if err := e.flushHeld(o, z, id); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// errNotWritten is flushHeld's error when the origin refused a cell of
// the key alone (a key holding another type).
var errNotWritten = errors.New("engine: the origin did not take a write of the key")

// errStillFlushing is flushHeld's error when a write of the key's already
// on its way has not ended within a write's own bound.
var errStillFlushing = errors.New("engine: a write of the key is still on its way")

// flushHeld writes the units of the normalized id this process has not
// replayed yet, after any write of the key's already on its way (its units
// would otherwise reach the origin after what follows, a read or a
// reset's mark). A failed write leaves them queued.
func (e *Engine) flushHeld(o Origin, z *Zone, id string) error {
	en, ok := z.entries.Load(id)
	if !ok {
		return nil
	}
	return e.flushCells(o, z, en, [2]*cell{en.cur.Load(), en.prev.Load()})
}

// flushCells writes the units of cells, en's, as flushHeld does.
func (e *Engine) flushCells(o Origin, z *Zone, en *entry, cells [2]*cell) error {
	batch, err := e.takeCells(make([]Delta, 0, 2), z, en, cells)
	if ferr := e.flush(context.Background(), o, batch); ferr != nil {
		err = ferr
	}
	for i := range batch {
		if !batch[i].Done && err == nil {
			err = errNotWritten
		}
	}
	return err
}

// takeCells appends the units of cells, en's, to batch, once any write of
// theirs already on its way has ended (errStillFlushing when one has not
// within a write's own bound).
func (e *Engine) takeCells(batch []Delta, z *Zone, en *entry, cells [2]*cell) ([]Delta, error) {
	var err error
	for _, c := range cells {
		if c == nil || c == tombstone {
			continue
		}
		for {
			if !e.awaitFlush(c) {
				err = errStillFlushing
				break
			}
			n := len(batch)
			if batch = e.take(batch, z, en, c, true); len(batch) > n || c.state()&stFlushing == 0 {
				break
			}
			// A write of the replay took the cell between the wait and
			// the take: its units reach the origin with that write, which
			// this one must not end before.
		}
	}
	return batch, err
}

// forget drops the entry and strict deadline of the normalized id, and
// the unreplayed units of its cells that drop covers (DropMatching; noDrop
// for none).
//
// With an origin, the units this process has not replayed yet go out
// first: the key's next request here reads the origin, which must hold
// them, or it would admit them again. The entry is let go before that
// write, not after: kept in place during the write's round trip, it took
// every request that came meanwhile, whose units reached the replay queue
// after the write and the origin after the key's next read (see
// TestForget_UnitsAdmittedDuringItsWriteAreReadBack). A read of the key
// made meanwhile, for the entry that takes its place, waits for the write
// (see forgetting).
func (e *Engine) forget(z *Zone, id string, drop resetDrop) bool {
	if drop != noDrop {
		if en, ok := z.entries.Load(id); ok && !drop.coversAny(en) {
			// Only units admitted after the reset (cells made after it,
			// or of later windows): the reset takes nothing off them, and
			// the entry stays with its counts. Forgotten, a process whose
			// request breaker was still open when it heard of the reset
			// decided the key from nothing and admitted its limit again
			// (TestDropMatching_AKeyMetOnlyAfterTheResetKeepsItsCount).
			e.dropStrict(z, id)
			return true
		}
	}
	found := false
	o := e.getOrigin()
	if o != nil {
		defer e.forgets.begin(z.key(id))()
	}
	if en, ok := z.entries.LoadAndDelete(id); ok {
		found = true
		// A request that still holds the entry sees the tombstone and
		// looks the key up again.
		cur := en.cur.Swap(tombstone)
		if cur != tombstone {
			e.live.Add(-1)
		}
		cells := [2]*cell{cur, en.prev.Load()}
		if o != nil && drop == noDrop {
			// For the key's next entry, which takes them back: should the
			// write fail, no read of the origin sees their units.
			e.orphans.put(z.key(id), cells)
		}
		if drop != noDrop {
			for _, c := range cells {
				if x := c.linksOrNil(); x != nil && drop.covers(c) {
					x.pending.Store(0)
				}
			}
		}
		if o != nil {
			_ = e.flushCells(o, z, en, cells)
			e.orphans.landed(z.key(id), cells)
		}
		if e.origin.Load() != nil {
			e.requeueCells(z, en, cells) // units charged since still reach the origin
		}
		if drop != noDrop {
			// The reset took off what its cells held here: a Redis that
			// restarts empty, losing its marks, must not get it again.
			for _, c := range cells {
				resetCell(c, drop)
			}
		}
		e.buryCells(z, en, cells) // and those of an origin gone reach the next (sendUnsent)
	}
	return e.dropStrict(z, id) || found
}

// dropStrict drops the strict deadline of the normalized id, and reports
// whether it had one.
func (e *Engine) dropStrict(z *Zone, id string) bool {
	if _, ok := z.strict.LoadAndDelete(id); ok {
		e.strictLive.Add(-1)
		return true
	}
	return false
}

// forgetting holds the keys whose forget is writing their units (see
// forget): a read of such a key waits for the write, at most a read
// timeout. Reads look at the map only while a forget is under way.
type forgetting struct {
	n  atomic.Int64
	mu sync.Mutex
	m  map[Key]*forgetWait
}

// forgetWait is the forgets of one key under way, and the channel that
// the last of them closes.
type forgetWait struct {
	n    int
	done chan struct{}
}

// begin records a forget of k under way, and returns its end.
func (f *forgetting) begin(k Key) (end func()) {
	f.mu.Lock()
	if f.m == nil {
		f.m = map[Key]*forgetWait{}
	}
	w := f.m[k]
	if w == nil {
		w = &forgetWait{done: make(chan struct{})}
		f.m[k] = w
	}
	w.n++
	f.n.Add(1)
	f.mu.Unlock()
	return func() {
		f.mu.Lock()
		if w.n--; w.n == 0 {
			delete(f.m, k)
			close(w.done)
		}
		f.n.Add(-1)
		f.mu.Unlock()
	}
}

// wait waits, at most timeout, until no forget of k is under way.
func (f *forgetting) wait(k Key, timeout time.Duration) {
	if f.n.Load() == 0 {
		return
	}
	f.mu.Lock()
	w := f.m[k]
	f.mu.Unlock()
	if w == nil {
		return
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-w.done:
	case <-t.C:
	}
}

// resetCell takes off c's own total and pending units when the reset drop
// covers c: a Redis restarted empty loses the reset's marks, and Resend,
// which sends every cell's own total again, would count what the reset
// took off after it.
func resetCell(c *cell, drop resetDrop) {
	if !drop.covers(c) {
		return
	}
	if x := c.links(); x != nil {
		x.pending.Store(0)
		x.own.Store(0)
	}
}

// dropReset takes off, as resetCell, the totals of the cells among the
// graves that a reset of z's identifiers match and drop covers: a key
// forgotten or evicted earlier in the reset's windows left them there.
func (g *graveyard) dropReset(z *Zone, match func(id string) bool, drop resetDrop) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, d := range g.cells {
		if d.zone == z && match(d.en.id()) {
			resetCell(d.cell, drop)
		}
	}
}
