package engine

import (
	"sync/atomic"
	"unsafe"
)

// Entries live in slabs: arrays of slots of one layout, each slot an entry,
// its identifier and its first cell (see entry). A zone's map allocates them
// and keeps its slabs in a list, and its table of entries (see entryMap) is
// memory the garbage collector does not scan: the collector reaches a
// zone's entries through one pointer per slab instead of one per key, and
// the slabs it scans hold only the entries' two cell pointers, which for
// most keys point back into the slab itself.
//
// Measured before this layout, in a CPU profile of a loaded keys100k Caddy
// (100,000 keys, each entry an object of its own that the table pointed
// at): marking cost 14.5 % of the process against 10.7 % in plain Caddy
// under the same traffic,
// most of the difference the table's 100,000 pointers, each a cache miss
// on its target's span as the collector marked it.
//
// A slab is at most slabBytes, as many slots as fit: 10 local entries of
// up to 7 bytes of identifier, 3 linked ones. Larger objects that hold
// pointers carry an 8-byte header that moves them up a size class (16
// slots of 48 bytes took 896 bytes, not 768), and the collector marks
// small objects span by span, a cheaper path.
//
// A slot is never used again once its entry is removed: a request, a
// replay queue or the graveyard may still hold the entry, and must find
// its tombstone and its identifier, not another key's. A slab whose slots
// have all been used and removed leaves the list (see entryMap.sweep), and
// the collector frees it once nothing holds any of its entries. Until
// then, a live entry keeps its whole slab: after a flood of one-off keys
// that the janitor drops, a key that stays keeps at most slabBytes.
const slabBytes = 512

// slabKinds is the number of slot layouts: a local and a linked one for
// each number of words the identifier and its length take (1 to 9).
const slabKinds = 2 * 9

// slabShards is the number of open slabs of each kind; a new key takes a
// slot in one of them by its hash. New keys made at once on two cores
// then seldom write to one cache line: with one open slab a kind, a new
// key cost 1.2 times as much on two cores as on one
// (BenchmarkDecideNewKeys, -cpu 1,2), with four 1.0 times.
const slabShards = 4

// localSlot is the slot of an entry whose first cell is a plain cell, B a
// byte array that holds its identifier's length and bytes.
type localSlot[B any] struct {
	entry
	b B
	c cell
}

// linkedSlot is the slot of an entry whose first cell is a linked cell.
type linkedSlot[B any] struct {
	entry
	b B
	c linkedCell
}

// slab is a run of slots of one layout: its first slot, the size of one
// (unsafe.Sizeof) and how many it has; 16 bytes.
type slab struct {
	base unsafe.Pointer
	size uint32
	cap  uint32
}

// slot returns slot i's entry, which is the slot's first field.
func (s *slab) slot(i int) *entry {
	return (*entry)(unsafe.Add(s.base, uintptr(i)*uintptr(s.size)))
}

// dead reports whether every slot of s, a full slab, is out of the map:
// the tombstone is left in an entry by its removal, or by losing a race
// to make its key (see LoadOrCreate), and by nothing else.
func (s *slab) dead() bool {
	for i := range int(s.cap) {
		if s.slot(i).cur.Load() != tombstone {
			return false
		}
	}
	return true
}

// slabSet is the list of a map's full slabs. A replaced table holds the
// set that was current when it was replaced (see entryTable): the
// collector keeps alive every slab the table's slots may point into, for
// as long as a reader may still be on the table.
type slabSet struct {
	full []slab
}

// maxSlabSlots bounds a slab's slots, however small they are.
const maxSlabSlots = 10

// newSlots allocates an array of n slots of S (at least 2, at most
// maxSlabSlots) and returns its first.
func newSlots[S any](n int) unsafe.Pointer {
	switch n {
	case 1, 2:
		return unsafe.Pointer(new([2]S))
	case 3:
		return unsafe.Pointer(new([3]S))
	case 4:
		return unsafe.Pointer(new([4]S))
	case 5:
		return unsafe.Pointer(new([5]S))
	case 6:
		return unsafe.Pointer(new([6]S))
	case 7:
		return unsafe.Pointer(new([7]S))
	case 8:
		return unsafe.Pointer(new([8]S))
	case 9:
		return unsafe.Pointer(new([9]S))
	}
	return unsafe.Pointer(new([maxSlabSlots]S))
}

// openSlab is a slab being filled: a slot is claimed by adding one to
// next, which may run past cap while a full slab is being replaced.
type openSlab struct {
	slab
	next atomic.Int32
}

// slotIn returns a new slot of layout S from m's open slab k (a kind in
// a shard, see slabShards), or, with m nil, an object of its own. A slot
// is claimed without a lock, so that new keys made at once on several
// cores share only a counter; a full slab is replaced under m.mu, by a
// new one allocated before it is taken, and joins the set.
func slotIn[S any](m *entryMap, k int) *S {
	if m == nil {
		return new(S)
	}
	for {
		o := m.open[k].Load()
		if o != nil {
			if i := o.next.Add(1) - 1; i < int32(o.cap) {
				return (*S)(unsafe.Add(o.base, uintptr(i)*uintptr(o.size)))
			}
		}
		if m.open[k].Load() != o {
			continue // replaced by another new key's slab meanwhile
		}
		size := unsafe.Sizeof(*new(S))
		n := min(slabBytes/size, maxSlabSlots)
		fresh := &openSlab{slab: slab{base: newSlots[S](int(n)), size: uint32(size), cap: uint32(n)}}
		m.mu.Lock()
		if m.open[k].Load() == o { // else another new key's slab came first
			if o != nil {
				m.slabs.full = append(m.slabs.full, o.slab)
				m.fullSlots += int(o.cap)
			}
			m.open[k].Store(fresh)
		}
		m.mu.Unlock()
	}
}
