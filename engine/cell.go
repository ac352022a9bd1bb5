package engine

import (
	"sync/atomic"
	"unsafe"
)

// A cell holds the counters of one fixed window of one key:
// (namespace, identifier, window, sequence). Every field is atomic; the hot
// path never takes a lock. A cell holds no pointer, so the garbage collector
// never scans it: with many keys, cells are most of the engine's heap.
//
// A plain cell holds what every decision needs, in 24 bytes. The counters
// of replay and of the cross-region layer (cellLinks) exist only in linked
// cells, the cells made while the engine has an origin or a global layer:
// such a cell is allocated as a linkedCell and carries stLinked. A
// local-only engine, which never uses them, pays 24 bytes a cell instead of
// 112. Read those counters through links(): a plain cell has none, and reads
// them as 0. A plain cell made before an origin or a global layer was
// attached is replaced by a linked copy when next touched (see
// Engine.upgrade).
type cell struct {
	// count is every unit this process knows of in the cell: units committed
	// here, units merged from the origin, and units reserved speculatively by
	// a batch in flight. Decisions compare-and-swap it.
	count atomic.Int64
	// spec is the part of count reserved by batches that have not committed
	// yet; it is never replayed.
	spec atomic.Int64
	// word holds the cell's sequence in its high bits (seqShift on), which
	// never change after the cell is created, and the st* bits below: one
	// word, so that a plain cell takes 24 bytes. Read them with seq and
	// state.
	word atomic.Uint64
}

// seqShift is where a cell's sequence starts in its word: below it, the
// st* bits. The sequence keeps 52 bits with its sign, ±2^51 windows: at a
// window of one millisecond, seventy thousand years either side of 1970.
const seqShift = 12

// seq returns the cell's sequence (window number).
func (c *cell) seq() int64 { return int64(c.word.Load()) >> seqShift }

// state returns the cell's st* bits.
func (c *cell) state() uint32 { return uint32(c.word.Load() & (1<<seqShift - 1)) }

// incarnations numbers the linked cells of the process, so that no two cells
// of one key and sequence share an origin record. It wraps after 2^32
// cells, far beyond the cells of one key in one window.
var incarnations atomic.Uint32

// cellLinks is the part of a linked cell that a plain one lacks: the
// counters the backends use (replay, own total, imported count, published
// count), which only an engine with an origin or a global layer needs.
type cellLinks struct {
	// global is the count imported from other regions, kept apart from count
	// so that it is never replayed or published again.
	global atomic.Int64
	// pending is committed units not yet handed to the origin.
	pending atomic.Int64
	// own is every unit of this process handed to the origin so far: the
	// absolute total its idempotent writes raise the origin's record to.
	own atomic.Int64
	// step is the growth of other processes' units in the cell per fast
	// tick, as the origin's answers show it (see measure).
	step atomic.Int64
	// mark is where the step's measurement started: the other processes'
	// units at the origin (low 32 bits) and when (high 32 bits: Unix ms,
	// modulo 2^32); 0 before the cell's first answer.
	mark atomic.Uint64
	// fresh is, once the cell has been read, the Unix millisecond until
	// which its origin view counts as fresh; before that, the earliest time
	// to retry the cold read.
	fresh atomic.Int64
	// published is the regional count last published to other regions
	// (see global.go); it only grows, after a successful write.
	published atomic.Int64
	// limit is the limit of the last decision on the cell: what the
	// cross-region layer weighs its count against, since one zone may
	// carry different limits in different sites or overrides.
	limit atomic.Int64
	// inc is the cell's incarnation (Delta.Incarnation), set at allocation;
	// a plain cell never writes to an origin.
	inc uint32
	// made is when the cell was made to count a key's units here (Unix ms,
	// as ms32 holds it), set before any other goroutine sees the cell; 0
	// when not known (a plain cell's linked copy, a previous cell made
	// for the origin's totals). A reset heard late keeps the unreplayed
	// units of a cell made after it (see madeAfter, DropMatching): they
	// were all admitted after it. 4 bytes, and 4 of padding: a linked
	// cell takes 112 bytes (the size class it took at 104).
	made uint32
	// procs is the process records the origin's last answer showed in the
	// cell (Totals.Processes), 0 before one; in the word inc leaves free.
	procs atomic.Uint32
	// times holds two moments, Unix ms modulo 2^32 (0: none): in its low
	// half when the cell's first origin call whose answer it merged was
	// sent (its cold read, or its first write), until the cell grows up
	// (stGrown); in its high half when its last reservation at the origin
	// began (see sticky).
	times atomic.Uint64
}

// ms32 is t (Unix ms) as times holds it: modulo 2^32, 0 taken as 1.
func ms32(t int64) uint32 { return max(uint32(t), 1) }

// since32 returns how long after the moment m (from times) t is, in ms:
// negative when t is earlier (a clock stepped back). Moments 24 days apart
// or more read as some other span.
func since32(t int64, m uint32) int64 { return int64(int32(uint32(t) - m)) }

// setTime stores m in the half of times that shift selects (0 or 32),
// leaving the other half as it is; keep, when set, stores only over a 0.
func (x *cellLinks) setTime(shift uint, m uint32, keep bool) {
	for {
		old := x.times.Load()
		if keep && uint32(old>>shift) != 0 {
			return
		}
		v := old&^(uint64(1<<32-1)<<shift) | uint64(m)<<shift
		if x.times.CompareAndSwap(old, v) {
			return
		}
	}
}

// heard records, for the answer to a call sent at sent, when the cell's
// first call was sent; once an answer comes to a call sent youth ms or
// more after that one, the cell grows up (stGrown): the processes that met
// the key at about the same moment as this one have all registered in it
// by then, and that answer counts them. youth is two fast ticks, so that
// their reads, and their first writes, which a tick may hold, are in.
func (c *cell) heard(x *cellLinks, sent, youth int64) {
	if c.state()&stGrown != 0 {
		return
	}
	first := uint32(x.times.Load())
	if first == 0 {
		x.setTime(0, ms32(sent), true)
		first = uint32(x.times.Load())
	}
	switch d := since32(sent, first); {
	case d >= youth:
		c.setBits(stGrown)
	case d < 0:
		// The clock stepped back since the first call (or the call came
		// 24 days after it): that call is no measure any more, this one is.
		x.setTime(0, ms32(sent), false)
	}
}

// sticky reports whether, at now, the cell is still within two fast ticks
// (tick ms each) of the start of its last reservation: what the other
// processes had admitted unseen by then has reached the origin after
// that, by their next replay.
func (x *cellLinks) sticky(now, tick int64) bool {
	m := uint32(x.times.Load() >> 32)
	if m == 0 {
		return false
	}
	d := since32(now, m)
	return d >= 0 && d < 2*tick
}

// linkedCell is a linked cell: a cell with its links, in one allocation of
// 112 bytes (no pointer either). Everything holds it as a *cell, its first
// field.
type linkedCell struct {
	cell
	x cellLinks
}

// newCell returns an empty cell for seq, a linked cell when linked is set.
func newCell(seq int64, linked bool) *cell {
	if !linked {
		c := &cell{}
		c.init(seq)
		return c
	}
	n := &linkedCell{}
	n.init(seq)
	return &n.cell
}

// madeAt records, in c, a linked cell no other goroutine sees yet, that it
// was made at now (Unix ms) to count a key's units; a plain cell has no
// room for it. It returns c.
func (c *cell) madeAt(now int64) *cell {
	if x := c.links(); x != nil {
		x.made = ms32(now)
	}
	return c
}

// madeAfter reports whether c is known to have been made after at (Unix
// ms): later by the clock of this process, which made it, in the same
// millisecond or earlier otherwise. Cells 24 days or more apart from at
// read as either (see since32): a reset's record lives two of its zone's
// windows, so only windows of 12 days or more meet it, and a cell read as
// made after keeps units that a reset took off (they count again, on the
// side of denying).
func (c *cell) madeAfter(at int64) bool {
	x := c.links()
	return x != nil && x.made != 0 && since32(at, x.made) < 0
}

// init makes c, which no other goroutine sees yet, an empty plain cell for
// seq.
func (c *cell) init(seq int64) { c.word.Store(uint64(seq) << seqShift) }

// init makes n, which no other goroutine sees yet, an empty linked cell
// for seq with an incarnation of its own.
func (n *linkedCell) init(seq int64) {
	n.word.Store(uint64(seq)<<seqShift | uint64(stLinked))
	n.x.inc = incarnations.Add(1)
}

// incarnation returns the cell's incarnation, 0 for a plain cell.
func (c *cell) incarnation() uint32 {
	if x := c.links(); x != nil {
		return x.inc
	}
	return 0
}

// orState sets bits in the state of a cell that no other goroutine sees
// yet (one being made).
func (c *cell) orState(bits uint32) { c.word.Store(c.word.Load() | uint64(bits)) }

// linksOrNil is links for a cell that may be nil.
func (c *cell) linksOrNil() *cellLinks {
	if c == nil {
		return nil
	}
	return c.links()
}

// links returns the counters of a linked cell, or nil for a plain cell.
// stLinked is set only by newCell, on a cell allocated as a linkedCell, and
// never cleared, so the conversion stays within the object it points into (what
// the race detector's checkptr verifies).
func (c *cell) links() *cellLinks {
	if c.state()&stLinked == 0 {
		return nil
	}
	return &(*linkedCell)(unsafe.Pointer(c)).x
}

const (
	// stRead: the cell has been read from the origin, or descends from a
	// cell that was, or the engine runs without origin.
	stRead uint32 = 1 << iota
	// stDirty: the cell sits in a replay queue.
	stDirty
	// stFast: the cell sits in the fast replay queue.
	stFast
	// stBlocked: the cell has denied a request (first-denial notification
	// sent).
	stBlocked
	// stFlushing: a delta of the cell is with the replay. One flush per cell
	// at a time keeps replay batches small; correctness does not depend on
	// it (writes are idempotent).
	stFlushing
	// stShared: the origin has shown units of another process in this cell
	// or in the cell it rotated from. A shared cell replays on the fast tick
	// and decides its last tenth at the origin.
	stShared
	// stLinked: the cell is a linked cell (see links). Set at allocation
	// only.
	stLinked
	// stUnsure: pending may hold units the origin already has, moved back
	// from own by Resend or by a write whose answer was lost. A total that
	// does not say what the origin holds of this process (the previous
	// cell's, in an answer about the current one) is then not merged: it
	// would count those units twice (see mergeOrigin). Cleared when the
	// replay takes pending, whose write carries them all.
	stUnsure
	// stPrevSettled: an answer read the previous cell once nothing more
	// could reach it in time (a flush period and a write's bound into this
	// cell's window, after any suspect period, without a cross-region
	// layer, whose imports arrive later): the replays of this cell leave it
	// out (Delta.NoPrev), a command less each in Redis, unless a late write
	// marked the cell (Delta.Late). Reads and reservations still bring it.
	stPrevSettled
	// stBuried: the cell is among the graves (buryCell); cleared when a
	// later one takes its place, so a cell the queues drop after that is
	// buried again (markDirty).
	stBuried
	// stReserved: a reservation of the cell is in flight (see nearLimit).
	stReserved
	// stGrown: the cell is no longer young: an answer has come to a call
	// sent two fast ticks or more after its first (see heard). A cell
	// rotated from the window just before takes it from that cell.
	stGrown
)

// The st* bits fit below a cell's sequence (a negative constant would not
// compile).
const _ uint32 = 1<<seqShift - 2*stGrown

// setBits sets bits in the state and reports whether this call set any of
// them (false when all were already set).
func (c *cell) setBits(bits uint32) bool {
	_, set := c.setBitsWas(bits)
	return set
}

// setBitsWas is setBits that also returns the state bits as they were
// just before it set them.
func (c *cell) setBitsWas(bits uint32) (was uint32, set bool) {
	for {
		old := c.word.Load()
		if uint32(old)&bits == bits {
			return uint32(old), false
		}
		if c.word.CompareAndSwap(old, old|uint64(bits)) {
			return uint32(old), true
		}
	}
}

// clearBits clears bits in the state.
func (c *cell) clearBits(bits uint32) {
	for {
		old := c.word.Load()
		if uint32(old)&bits == 0 || c.word.CompareAndSwap(old, old&^uint64(bits)) {
			return
		}
	}
}

// committed is the cell's count without the speculative part.
func (c *cell) committed() int64 { return c.count.Load() - c.spec.Load() }

// total is what decisions weigh: local and regional units plus the count
// imported from other regions.
func (c *cell) total() int64 { return SatAdd(c.count.Load(), c.globalCount()) }

// globalCount returns the count the cell imported from other regions.
func (c *cell) globalCount() int64 {
	if x := c.links(); x != nil {
		return x.global.Load()
	}
	return 0
}

// pending returns the cell's committed units not yet handed to the origin.
func (c *cell) pending() int64 {
	if x := c.links(); x != nil {
		return x.pending.Load()
	}
	return 0
}

// mergeOrigin merges an origin total, which does not say what the origin
// holds of this process, into the cell: count rises to at least total plus
// what the origin has not seen (this process's pending units and
// speculative reservations). Counts only ever grow by merges, so a late or
// repeated merge can never undo units counted since. While pending may
// hold units the origin has (stUnsure), such a total is not merged: the
// cell's own answer, at its next replay, says exactly (mergeAnswer).
func (c *cell) mergeOrigin(total int64) {
	if c.state()&stUnsure != 0 && c.pending() > 0 {
		return
	}
	c.raiseCount(ClampCount(total))
}

// mergeAnswer merges an answer about the cell itself: the others' units
// (the total less this process's record, mine) plus every unit of this
// process (own, pending and speculative), each once, whether or not the
// origin has them: a unit moved back to pending after a lost answer is in
// mine and in pending, and counted once.
func (c *cell) mergeAnswer(total, mine int64) {
	others := max(ClampCount(total)-ClampCount(mine), 0)
	if x := c.links(); x != nil {
		others = SatAdd(others, x.own.Load())
	}
	c.raiseCount(others)
}

// raiseCount raises count to at least base plus the cell's pending units
// and speculative reservations.
//
// The speculative count is read on both sides of the count, and the merge
// retries when a batch rolled back in between: a rollback lowers spec, then
// count, and a merge that saw the old spec with the new count would add the
// rolled-back units back for good.
func (c *cell) raiseCount(base int64) {
	for {
		s := c.spec.Load()
		old := c.count.Load()
		v := SatAdd(SatAdd(base, c.pending()), s)
		if c.spec.Load() != s {
			continue
		}
		if v <= old || c.count.CompareAndSwap(old, v) {
			return
		}
	}
}

// observe records what an origin answer, received at now (Unix ms), says
// about other processes: units beyond this process's own contribution make
// the cell shared, and their growth is the step (see measure). tick is the
// fast tick in ms. Answers are merged only into linked cells (decisions with
// an origin upgrade theirs, see upgrade), but a plain cell would only lose
// the step, an estimate.
func (c *cell) observe(t Totals, now, tick int64) {
	if x := c.links(); x != nil && t.Processes > 0 {
		x.procs.Store(uint32(min(t.Processes, 1<<32-1)))
	}
	if f := t.Cur - t.Mine; f > 0 {
		if x := c.links(); x != nil {
			// It runs before the answer is merged, so the other processes'
			// units in the local view are the count less this process's
			// own (replayed, pending and speculative).
			seen := c.count.Load() - x.own.Load() - x.pending.Load() - c.spec.Load()
			x.measure(f, f-max(seen, 0), now, tick)
		}
	} else if !t.Shared {
		return
	}
	if c.state()&stShared == 0 {
		c.setBits(stShared)
	}
}

// markMax is the largest count a mark holds; beyond it the step is what
// each answer adds, unscaled.
const markMax = 1<<32 - 1

// measure updates the step from an answer at now that shows f units of
// other processes, d more than the local view held. The first answer's
// step is d: everything the others counted before, as if within a tick
// (the safe side for a key first seen near its limit). After that, the
// growth since the mark becomes the step once at least half a tick has
// passed, scaled to a tick when less than one has: answers close together
// (a reservation per request, 500 µs apart) would otherwise show the
// others' pace as a unit a tick, and both processes would decide locally
// near the limit, each admitting what the other did within a tick. Over a
// tick or more the growth is taken whole, as per tick: the safe side.
func (x *cellLinks) measure(f, d, now, tick int64) {
	m := x.mark.Load()
	next := uint64(uint32(now))<<32 | uint64(min(f, markMax))
	if m == 0 || f >= markMax {
		if d > 0 {
			x.step.Store(d)
		}
		x.mark.CompareAndSwap(m, next)
		return
	}
	elapsed := int64(uint32(now) - uint32(m>>32))
	if elapsed < max(tick/2, 1) {
		return
	}
	if !x.mark.CompareAndSwap(m, next) {
		return // another answer measured meanwhile
	}
	grown := f - int64(m&markMax)
	if grown <= 0 {
		return // no growth (or the origin lost units): the step stands
	}
	if elapsed < tick {
		grown = grown * tick / elapsed // grown < 2^32: no overflow
	}
	x.step.Store(grown)
}

// importGlobal raises the cell's imported count to n: what other regions
// counted in it, as the region's cross-region role left it at the origin.
// A plain cell holds none (an engine with an origin makes linked cells).
func (c *cell) importGlobal(n int64) {
	if n <= 0 {
		return
	}
	if x := c.links(); x != nil {
		raise(&x.global, ClampCount(n))
	}
}

// extendFresh moves the freshness deadline forward to until (never back),
// but for a deadline later than until + span: set by a clock that has since
// stepped back (an hour ahead, say), it would keep a stale view fresh for
// that long, and is replaced by until. A plain cell has no deadline: it is
// never fresh.
func (c *cell) extendFresh(until, span int64) {
	x := c.links()
	if x == nil {
		return
	}
	for {
		old := x.fresh.Load()
		if old >= until && old <= until+span {
			return
		}
		if x.fresh.CompareAndSwap(old, until) {
			return
		}
	}
}

// freshUntil returns the cell's freshness deadline (see cellLinks.fresh), 0
// for a plain cell.
func (c *cell) freshUntil() int64 {
	if x := c.links(); x != nil {
		return x.fresh.Load()
	}
	return 0
}

// addSat adds n ≥ 0 to a, saturating at MaxCount.
func addSat(a *atomic.Int64, n int64) {
	for {
		old := a.Load()
		if a.CompareAndSwap(old, SatAdd(old, n)) {
			return
		}
	}
}
