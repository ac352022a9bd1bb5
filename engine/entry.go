package engine

import (
	"encoding/binary"
	"sync/atomic"
	"unsafe"
)

// entry is one (namespace, identifier, window): its current cell and the
// cell before it. Rotation moves cur to prev, then swaps cur.
//
// An entry is made by newEntryIn, in one slot of its zone's slabs (see
// slab.go) with its identifier and its first cell: the 16 bytes here, then
// the identifier's length and bytes (see idBytes), padded to a word, then
// the cell, plain or linked. A decision on a key whose first cell is
// current reads one or two cache lines for both, and the collector finds
// cur pointing back into the slab it already marked. The first cell stays
// with the entry when a rotation or an upgrade replaces it: 24 bytes (112
// linked) that an entry past its first window carries until it is
// forgotten. A linked first cell was an object of its own while each
// entry was one (128-byte objects the collector scans, against 96-byte
// ones it need not, raised redis_keys100k's p99); in slabs, which the
// collector scans anyway, it is inside, and in one run alternating the
// two builds redis_keys100k cost 1.350 × plain Caddy's CPU with it inside
// and 1.381 × apart.
type entry struct {
	cur  atomic.Pointer[cell]
	prev atomic.Pointer[cell]
}

// A stored identifier is normalized (NormalizeIdentifier): at most 65
// bytes, whose length one byte holds (this does not compile otherwise).
const _ = uint8(len(hashedPrefix) + 2*32)

// newEntry returns an entry named id whose current cell is a new one for
// seq (a linked cell when linked is set), as an object of its own: what a
// map's slab holds in a slot (see slotIn), for tests of the entry alone.
func newEntry(id string, seq int64, linked bool) *entry {
	return newEntryIn(nil, 0, id, seq, 0, linked)
}

// newEntryIn returns an entry named id whose current cell is a new one for
// seq (a linked cell when linked is set, made at now: see madeAt; 0 for
// not known), in a slot of m's slabs (see slab.go), or with m nil an
// object of its own: 48 bytes for a local key of up to 7 bytes, 64 for an
// IPv4 address, 80 for an identifier of 32 bytes; 88 more for a linked
// one. shard is the first open slab of the key's shard (a multiple of
// slabKinds).
func newEntryIn(m *entryMap, shard int, id string, seq, now int64, linked bool) *entry {
	words := (1 + len(id) + 7) / 8 // for the length and the bytes
	switch words {
	case 1:
		return entryIn[[8]byte](m, shard, words, id, seq, now, linked)
	case 2:
		return entryIn[[16]byte](m, shard, words, id, seq, now, linked)
	case 3:
		return entryIn[[24]byte](m, shard, words, id, seq, now, linked)
	case 4:
		return entryIn[[32]byte](m, shard, words, id, seq, now, linked)
	case 5:
		return entryIn[[40]byte](m, shard, words, id, seq, now, linked)
	case 6:
		return entryIn[[48]byte](m, shard, words, id, seq, now, linked)
	case 7:
		return entryIn[[56]byte](m, shard, words, id, seq, now, linked)
	case 8:
		return entryIn[[64]byte](m, shard, words, id, seq, now, linked)
	}
	return entryIn[[72]byte](m, shard, 9, id, seq, now, linked) // a normalized identifier is at most 65 bytes
}

// entryIn makes an entry, its name in B (a byte array of words words) and
// its first cell in one slot (see slotIn).
func entryIn[B any](m *entryMap, shard, words int, id string, seq, now int64, linked bool) *entry {
	var en *entry
	var b *B
	if linked {
		x := slotIn[linkedSlot[B]](m, shard+9+words-1)
		x.c.init(seq)
		if now != 0 {
			x.c.madeAt(now)
		}
		en, b = &x.entry, &x.b
		en.cur.Store(&x.c.cell)
	} else {
		x := slotIn[localSlot[B]](m, shard+words-1)
		x.c.init(seq)
		en, b = &x.entry, &x.b
		en.cur.Store(&x.c)
	}
	name := unsafe.Slice((*byte)(unsafe.Pointer(b)), unsafe.Sizeof(*b))
	name[0] = byte(len(id))
	copy(name[1:], id)
	return en
}

// length returns the byte of the identifier's length, right after the
// entry (see entry).
func (en *entry) length() *byte {
	return (*byte)(unsafe.Add(unsafe.Pointer(en), unsafe.Sizeof(entry{})))
}

// idBytes returns the bytes of the entry's identifier, which follow its
// length right after the entry, never written again.
func (en *entry) idBytes() []byte {
	p := en.length()
	return unsafe.Slice((*byte)(unsafe.Add(unsafe.Pointer(p), 1)), int(*p))
}

// id returns the entry's identifier.
func (en *entry) id() string {
	b := en.idBytes()
	return unsafe.String(unsafe.SliceData(b), len(b))
}

// named reports whether the entry's identifier is id: its length byte
// first, then its bytes, identifiers of 8 to 32 bytes (the common API keys
// and addresses) read as words instead of through the runtime's
// comparison.
func (en *entry) named(id string) bool {
	n := len(id)
	if int(*en.length()) != n {
		return false
	}
	x := en.idBytes()
	if n < 8 || n > 32 {
		return string(x) == id
	}
	y := unsafe.Slice(unsafe.StringData(id), n)
	le := binary.LittleEndian
	if le.Uint64(x) != le.Uint64(y) || le.Uint64(x[n-8:]) != le.Uint64(y[n-8:]) {
		return false
	}
	if n > 16 {
		if le.Uint64(x[8:]) != le.Uint64(y[8:]) {
			return false
		}
		if n > 24 && le.Uint64(x[16:]) != le.Uint64(y[16:]) {
			return false
		}
	}
	return true
}

// previous returns the cell before c, or nil. While a rotation is between
// its two steps prev may already be c itself; a decision in that instant
// weighs no previous cell, and it can only be one that reads the clock at
// the very end of the window, where the previous cell weighs nothing.
func (en *entry) previous(c *cell) *cell {
	if p := en.prev.Load(); p != nil && p.seq() == c.seq()-1 {
		return p
	}
	return nil
}

// holds reports whether the entry, still in its map, holds c as its
// current or its previous cell. A removed entry holds nothing, though it
// still points at its previous cell: a cell let go that way is only found
// among the graves (TestSweep_AFailedWriteOfAPreviousCellItDroppedIsRemembered).
func (en *entry) holds(c *cell) bool {
	cur := en.cur.Load()
	return cur != tombstone && (c == cur || c == en.prev.Load())
}

// tombstone marks an entry removed from the map: a request that still holds
// the entry looks it up again instead of counting into a forgotten cell.
var tombstone = newCell(-1, false)

// current returns the entry's cell for seq, rotating when seq has advanced,
// or nil when the entry has been removed. It never moves a key back to an
// older cell: a request that read the clock a moment ago, or a node whose
// clock is a little behind, counts in the newer cell. A cell far ahead of
// the clock is replaced by the engine (see replaceStale). A cell made here
// is a linked cell when linked is set (the engine has an origin or a
// global layer), made at now (Unix ms, see madeAt). dropped are the cells a rotation let go (neither current nor
// previous any more), for the engine to remember (see bury): they weigh
// nothing now, unless the clock has jumped. keep (the engine has no
// origin) keeps a cell rotated from over a gap as the previous one
// instead, for replaceStale.
func (en *entry) current(seq, now int64, linked, keep bool) (c *cell, dropped [2]*cell) {
	for {
		c := en.cur.Load()
		if c == tombstone {
			return nil, dropped
		}
		if c.seq() >= seq {
			return c, dropped
		}
		p := en.prev.Load()
		n := newCell(seq, linked).madeAt(now)
		// A cell rotated from the window just before, of a key that was
		// read, counts as read but stale: the tiers decide whether it is
		// read again now or in the background. A key idle for a window or
		// more (or whose clock jumped) knows nothing of the new window:
		// others may have counted it near its limit meanwhile, so it waits
		// for a cold read, as a first touch does, and is young again
		// (see heard): processes may meet it together as they met a new
		// one. A key that several processes use stays shared across
		// windows, and the others' pace and number carry over as the
		// first estimates.
		inherit := stShared
		if c.seq() == seq-1 {
			inherit |= stRead | stGrown
		}
		n.orState(c.state() & inherit)
		if x, cx := n.links(), c.links(); x != nil && cx != nil {
			x.step.Store(cx.step.Load())
			x.procs.Store(cx.procs.Load()) // the processes on the key stay those it had
		}
		var np *cell
		switch {
		case c.seq() == seq-1:
			np = c
		case keep:
			// Rotated over a gap: c weighs nothing in the new window, but
			// a clock that jumped forward and comes back finds its window
			// live again, and without an origin to read its count back
			// from, only this process holds it. It stays as the entry's
			// previous cell (previous ignores a cell that is not the one
			// just before) until the next rotation lets it go, for
			// replaceStale. With an origin it is let go now (and
			// remembered, see bury): the new incarnation reads the origin.
			np = c
		default:
			dropped[0] = c
		}
		// prev first, by compare-and-swap against what was read with c, so
		// a rotation that stalled cannot put back a cell that a newer one
		// has already moved past.
		if p != np {
			if !en.prev.CompareAndSwap(p, np) {
				dropped[0] = nil
				continue
			}
			if afterPrevSwap != nil {
				afterPrevSwap()
			}
		}
		if en.cur.CompareAndSwap(c, n) {
			if p != np {
				dropped[1] = p
			}
			return n, dropped
		}
		if p != np {
			// Another rotation took the current cell after this one let
			// p go from the previous: that one found the previous cell
			// swapped and lets nothing go, so p is this one's to report.
			// Look again (nil), as after any rotation by another.
			return nil, [2]*cell{nil, p}
		}
		dropped[0] = nil
	}
}

// afterPrevSwap, when set (by a test), runs in current between the swap
// of the previous cell and that of the current one.
var afterPrevSwap func()

// replaceStale replaces c, the entry's current cell, which lies more than
// a window ahead of seq, by a new cell for seq, and returns it; nil when c
// is no longer current (look again). The wall clock stepped forward (an
// NTP step, a resumed VM) and back: kept, the cell from the future would
// hold the key's count until real time reached it, admitting next to
// nothing meanwhile. The new cell is a new incarnation (see
// Delta.Incarnation) that waits for a cold read like a first touch, so it
// reads what the origin holds for seq; the old cell's pending units still replay from
// the replay queue, which holds the cell itself. dropped is the previous
// cell it let go (the one before the stale cell), for the engine to
// remember as it remembers the stale one.
//
// Without an origin (keep), the cell for seq itself may still be the entry's
// previous cell, left there by the rotation over the gap (see current):
// it comes back as the current cell, with its count. Made anew, it was
// empty, and a key at its limit when the clock stepped an hour forward and
// back was admitted its whole limit again
// (TestClock_StepForwardAndBackKeepsALocalKeysCount). The cell before it
// was let go at that rotation: its weight in the window does not come back.
func (en *entry) replaceStale(c *cell, seq, now int64, linked, keep bool) (_, dropped *cell) {
	p := en.prev.Load()
	if p != nil && p.seq() == seq && keep {
		// prev first, as below: a rotation past the restored cell that
		// runs meanwhile keeps it as its previous cell.
		if !en.prev.CompareAndSwap(p, nil) {
			return nil, nil
		}
		if !en.cur.CompareAndSwap(c, p) {
			en.prev.CompareAndSwap(nil, p) // c was rotated meanwhile: as it was
			return nil, nil
		}
		return p, nil
	}
	n := newCell(seq, linked).madeAt(now)
	n.orState(c.state() & stShared)
	var np *cell
	if p != nil && p.seq() == seq-1 {
		np = p
	}
	if p != np && !en.prev.CompareAndSwap(p, np) {
		return nil, nil
	}
	if p != np {
		dropped = p
	}
	if en.cur.CompareAndSwap(c, n) {
		return n, dropped
	}
	return nil, dropped
}
