package engine

import (
	"sync"
	"sync/atomic"
)

// Orphans are the cells of keys let go (evicted, forgotten) whose units
// the origin has not taken yet: kept from the moment the entry leaves its
// map until the write that lets the key go has landed. Should it fail
// (Redis down, a partition) or be given up (evictBudget), the units wait
// in the replay queues or the graves; should it be slow, a read of the
// key stops waiting for it after a read timeout. The key's next entry
// takes the cells back (insert, entry.adopt) instead of starting from
// what the origin holds, which misses those units until they land: until
// then a key evicted while Redis was unreachable admitted them again, 14
// for a limit of 10, whether its next entry decided alone or read a Redis
// that had just come back
// (TestEvict_AKeyLetGoWhileItsWriteFailsKeepsItsUnits). Taken back, the
// cells count on as if the key had stayed: under their own incarnations,
// so that the replay's writes of them and the entry's are one record.
//
// orphanCells bounds them: past it the oldest are forgotten, unless they
// hold more unwritten units than the key let go now, which is then not
// kept (their units still reach the origin, by the replay or the graves;
// only the key's next entry no longer sees them before that). A key busy
// enough to matter comes back within moments of its eviction, and the
// lightest keys are evicted first.
const orphanCells = 1 << 14

// orphans indexes the orphaned cells by key.
type orphans struct {
	// n is len(m), read without the lock: the insert of a new key looks
	// no further while it is 0, as it is, but during the writes, while
	// the origin takes every write that lets a key go (see landed).
	n    atomic.Int64
	mu   sync.Mutex
	m    map[Key]orphan
	ring []Key // in the order they came, for the bound
	next int
}

// orphan is a key's cells as its entry held them (current, previous) and
// its place in the ring.
type orphan struct {
	cells [2]*cell
	slot  int
}

// put records cells, the cells key's entry let go, when one of them holds
// units no write has taken yet.
func (o *orphans) put(key Key, cells [2]*cell) {
	if !holdsUnwritten(cells) {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.m == nil {
		o.m = map[Key]orphan{}
	}
	if v, ok := o.m[key]; ok {
		o.m[key] = orphan{cells, v.slot}
		return
	}
	slot := len(o.ring)
	if slot < orphanCells {
		o.ring = append(o.ring, key)
	} else {
		slot = o.next
		if v, ok := o.m[o.ring[slot]]; ok && v.slot == slot {
			if unwrittenUnits(v.cells) > unwrittenUnits(cells) {
				// The oldest stays, and these are not kept: a flood of
				// one-off keys evicted during an outage pushed out a
				// busy key let go before them, whose next entry then
				// started from nothing and admitted its units again
				// (TestOrphans_PastTheBoundALighterKeyPushesOutNoHeavierOne).
				return
			}
			delete(o.m, o.ring[slot])
		}
		o.next = (o.next + 1) % orphanCells
		o.ring[slot] = key
	}
	o.m[key] = orphan{cells, slot}
	o.n.Store(int64(len(o.m)))
}

// unwrittenUnits is what cells hold that no write has taken yet.
func unwrittenUnits(cells [2]*cell) int64 {
	var n int64
	for _, c := range cells {
		if c != nil && c != tombstone {
			n += c.pending()
		}
	}
	return n
}

// find returns the cells key's last entry let go while they hold units
// no write has taken. Written since, they are forgotten: the origin has
// their units, and a later entry of the key (made by a request that
// looked the key up just before the cells were kept, which then took
// none) may have counted more there than they show. Taken back anyway,
// such stale cells let a key forgotten, reset and swept over and over
// admit up to 48 past a limit of 50, in 1 or 2 rounds of 330
// (TestRace_ALoneProcessForgettingAKeyItDecidesStaysWithinTheLimit).
func (o *orphans) find(key Key) [2]*cell {
	o.mu.Lock()
	defer o.mu.Unlock()
	v, ok := o.m[key]
	if ok && !holdsUnwritten(v.cells) {
		delete(o.m, key)
		o.n.Store(int64(len(o.m)))
		return [2]*cell{}
	}
	return v.cells
}

// taken forgets key's cells once an entry holds them again.
func (o *orphans) taken(key Key, cells [2]*cell) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.m[key].cells == cells {
		delete(o.m, key)
		o.n.Store(int64(len(o.m)))
	}
}

// landed forgets key's cells, cells, once the write that let the key go
// has taken all they held.
func (o *orphans) landed(key Key, cells [2]*cell) {
	if o.n.Load() > 0 && !holdsUnwritten(cells) {
		o.taken(key, cells)
	}
}

// prune forgets the orphans whose units the origin has all taken, those
// that weigh nothing at now (Unix ms) any more, and those drop says to
// (nil: none).
func (o *orphans) prune(now int64, drop func(Key, [2]*cell) bool) {
	if o.n.Load() == 0 {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	for k, v := range o.m {
		w := k.Window.Milliseconds()
		if !holdsUnwritten(v.cells) || v.cells[0].seq() < now/w-1 || (drop != nil && drop(k, v.cells)) {
			delete(o.m, k)
		}
	}
	o.n.Store(int64(len(o.m)))
}

// adopt makes cells, the cells a previous entry of the key let go, the
// entry's, which no other goroutine sees yet: as its current and previous
// cells when the current one is for seq (or ahead of it: a clock stepped
// back), as its previous one when it is for the window before. A current
// cell taken back is read again before it decides, as a new one is: its
// view is as old as the entry that let it go, and an entry of the key
// made in between (see orphans.find) may have written more to the origin.
// The read raises the count, never lowers it; while the origin is down
// the cell decides on what it holds.
func (en *entry) adopt(cells [2]*cell, seq int64) {
	cur, prev := cells[0], cells[1]
	switch {
	case cur == nil || cur == tombstone:
	case cur.seq() >= seq:
		cur.clearBits(stRead)
		if x := cur.links(); x != nil {
			x.fresh.Store(0)
		}
		en.cur.Store(cur)
		if prev != nil && prev.seq() < cur.seq() {
			en.prev.Store(prev)
		}
	case cur.seq() == seq-1:
		en.prev.Store(cur)
	}
}
