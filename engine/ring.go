package engine

import "sync/atomic"

// ring is a bounded multi-producer multi-consumer queue of dirty cells
// (Vyukov's array queue): each slot carries a sequence number that tells
// producers and consumers whose turn it is, so neither side takes a lock and
// a full queue is refused at once instead of waited on.
type ring struct {
	mask  uint64
	slots []slot
	head  atomic.Uint64 // next position to dequeue
	_     [56]byte      // keep producers and consumers off one cache line
	tail  atomic.Uint64 // next position to enqueue
}

type slot struct {
	turn atomic.Uint64
	zone *Zone
	id   string
	cell *cell
}

// newRing returns a ring of n slots; n must be a power of two.
func newRing(n int) *ring {
	r := &ring{mask: uint64(n - 1), slots: make([]slot, n)}
	for i := range r.slots {
		r.slots[i].turn.Store(uint64(i))
	}
	return r
}

// push enqueues (z, id, c) and reports false when the ring is full.
func (r *ring) push(z *Zone, id string, c *cell) bool {
	for {
		pos := r.tail.Load()
		s := &r.slots[pos&r.mask]
		turn := s.turn.Load()
		switch {
		case turn == pos:
			if r.tail.CompareAndSwap(pos, pos+1) {
				s.zone, s.id, s.cell = z, id, c
				s.turn.Store(pos + 1)
				return true
			}
		case turn < pos:
			return false // the consumer has not freed this slot: full
		}
	}
}

// pop dequeues one item; ok is false when the ring is empty.
func (r *ring) pop() (z *Zone, id string, c *cell, ok bool) {
	for {
		pos := r.head.Load()
		s := &r.slots[pos&r.mask]
		turn := s.turn.Load()
		switch {
		case turn == pos+1:
			if r.head.CompareAndSwap(pos, pos+1) {
				z, id, c = s.zone, s.id, s.cell
				s.zone, s.id, s.cell = nil, "", nil
				s.turn.Store(pos + r.mask + 1)
				return z, id, c, true
			}
		case turn < pos+1:
			return nil, "", nil, false
		}
	}
}

// len returns about how many items are queued.
func (r *ring) len() int {
	n := int64(r.tail.Load()) - int64(r.head.Load())
	if n < 0 {
		return 0
	}
	return int(n)
}
