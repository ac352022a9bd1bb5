package engine

import (
	"encoding/binary"
	"math/bits"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"
)

// entryMap is a zone's map of entries by identifier, made for what the
// engine does with it: a lookup on every decision, an insert per new key,
// deletions by the janitor. Its slots point at the entries themselves,
// which hold their identifier, so a key costs its entry, its cells and its
// identifier plus about 10 to 20 bytes of table, where a general concurrent
// map (xsync's, before) added an object per key (identifier and value, 24
// bytes) and about 25 bytes of buckets.
//
// The map makes its entries, in slabs of its own (see slab.go): an entry,
// its identifier and its first cell in one slot, up to ten slots an
// object. Its table is memory the collector does not scan; the slabs keep
// the entries alive. Before, each entry was an object of its own that the
// table pointed at, and the collector followed 100,000 pointers to
// 100,000 places on every cycle with keys100k's keys. An earlier layout
// still, which copied the identifier into a string of its own, raised
// the heap in use after a collection by a fifth through the handler with
// 100,000 keys, live entries scattered among a request's freed objects of
// the same size class.
//
// A lookup takes no lock and writes no memory: it hashes the identifier,
// reads one bucket's tag word, and compares the identifier of the entries
// whose tag matches. The table is open-addressed by buckets of seven
// slots, one cache line each, with one tag byte per slot in the bucket's
// meta word: 0 empty, tagDeleted for a deleted slot (probes go on past
// it), else 0x80 | 7 bits of the hash. A probe goes from the hash's bucket
// to the next until the key or a bucket with an empty slot is found; the
// table grows before seven eighths of its slots are used, so every probe
// ends. The hash (idSeed.hash) is keyed per map at random, so
// identifiers chosen by clients cannot be made to collide.
//
// Writers take the map's mutex. A writer publishes an entry by storing its
// slot before the tag, and deletes one by setting the tag to tagDeleted
// before clearing the slot, so a reader that sees a tag finds the entry or
// nil (a deletion racing it). A table that grows or shrinks is copied
// into a new one, published by one atomic store once it holds every
// entry, and never written again: a reader still on it sees the map as it
// was a moment earlier, as it would had it run a moment earlier. Readers
// never wait for writers, and a writer waits for a chunk of buckets at
// most (see insert and DeleteMatching).
type entryMap struct {
	seed  idSeed
	table atomic.Pointer[entryTable]
	_     [64 - 40]byte // what writers change on a line of its own

	mu sync.Mutex
	// used counts the slots holding an entry or tagDeleted, live the
	// entries; both under mu.
	used, live int
	// removed counts the entries removed since the last sweep, and
	// fullSlots the slots of the full slabs (both under mu).
	removed, fullSlots int
	// The entries' slabs (see slab.go): the one being filled of each kind
	// (replaced under mu), and the set of full ones (under mu).
	open  [slabShards * slabKinds]atomic.Pointer[openSlab]
	slabs *slabSet
	// growing is the growth under way, or nil (under mu).
	growing *growth
	// betweenChunks, when set (by tests), runs between two of
	// DeleteMatching's chunks, without the lock.
	betweenChunks func()
}

// growth is a table's growth under way (see insert): the new table, which
// holds a copy of the old table's buckets below next and the changes made
// to those since, and how many of its slots are used.
type growth struct {
	t    *entryTable
	next int
	used int
}

// growStep is how many of the old table's buckets an insert copies
// during a growth: enough that the copy ends before the old table, which
// takes inserts from seven eighths full on, is fifteen sixteenths full
// (2.3 buckets an insert at least).
const growStep = 4

const (
	// bucketSlots fills a bucket's 64 bytes: a meta word and seven
	// pointers, one cache line.
	bucketSlots = 7
	// minBuckets is the table of an empty map.
	minBuckets = 2
	tagDeleted = 0x01
	// slotBytes marks the seven bytes of a meta word that tag slots.
	slotBytes = 1<<(8*bucketSlots) - 1
	lows      = 0x0101010101010101
	highs     = lows * 0x80 & slotBytes
	sevens    = 0x7f7f7f7f7f7f7f7f
)

// entryTable is a table of the map. Its buckets are memory the collector
// does not scan (see newEntryTable): what keeps the entries its slots
// point at alive is the slabs they lie in. The current table keeps its
// map, whose open slabs and set of full ones hold every entry the table
// holds: a slab leaves the set only when every entry in it has been
// removed from the current table (see entryMap.sweep). A table that a
// rehash replaces is written no more, and keeps frozen, the slabs of the
// map as they were then (the set, and the open slabs, which may later
// join a set it does not keep), for a reader still on it. A reader that
// has loaded an entry holds it on its stack, where the collector sees it;
// and a deletion stores nil through the write barrier, which marks the
// entry it overwrites during a collection, as it does for any pointer
// store.
type entryTable struct {
	mask    uint64 // len(buckets) − 1
	buckets []entryBucket
	owner   *entryMap
	frozen  atomic.Pointer[slabsThen]
}

// slabsThen is a map's slabs at one moment: its set of full ones and its
// open ones.
type slabsThen struct {
	set  *slabSet
	open [slabShards * slabKinds]*openSlab
}

type entryBucket struct {
	meta  atomic.Uint64
	slots [bucketSlots]atomic.Pointer[entry]
}

// rawBucket is an entryBucket as the collector sees it: words that hold
// no pointer.
type rawBucket [1 + bucketSlots]uint64

// An entryBucket and a rawBucket are the same 64 bytes.
const _ = uint(unsafe.Sizeof(entryBucket{})-unsafe.Sizeof(rawBucket{})) +
	uint(unsafe.Sizeof(rawBucket{})-unsafe.Sizeof(entryBucket{}))

func newEntryMap() *entryMap {
	m := &entryMap{seed: newIDSeed(), slabs: new(slabSet)}
	m.table.Store(newEntryTable(minBuckets, m))
	return m
}

// newEntryTable returns an empty table of m of buckets buckets. Its
// buckets are allocated as rawBuckets, so the collector never scans them:
// each slot's pointer would otherwise be one more object to mark per
// key, on every cycle.
func newEntryTable(buckets int, m *entryMap) *entryTable {
	raw := make([]rawBucket, buckets)
	return &entryTable{
		mask:    uint64(buckets - 1),
		buckets: unsafe.Slice((*entryBucket)(unsafe.Pointer(unsafe.SliceData(raw))), buckets),
		owner:   m,
	}
}

// tagOf is the tag byte of hash h: its top 7 bits (the bucket takes the
// low bits).
func tagOf(h uint64) uint64 { return 0x80 | h>>57 }

// zeroBytes returns 0x80 in each slot byte of x that is zero and 0
// elsewhere, exactly.
func zeroBytes(x uint64) uint64 {
	return ^((x&sevens + sevens) | x | sevens) & highs
}

// someZeroBytes returns 0x80 in each slot byte of x that is zero, and
// perhaps in some others above a zero byte (a borrow): enough to find the
// slots whose identifier is then compared, in fewer steps.
func someZeroBytes(x uint64) uint64 { return (x - lows) &^ x & highs }

// Load returns the entry of id: find, written out, a call less on the
// decision path. The table is loaded while the identifier is hashed:
// nothing the first load needs waits for the hash. An identifier of 1 to
// 32 bytes (API keys, addresses, short keys) takes loadShort or
// loadWords, where its hash and its comparisons are written out too, from
// its bytes read once: a decision's lookup calls nothing (hash and named
// are over the inlining budget).
func (m *entryMap) Load(id string) (*entry, bool) {
	t := m.table.Load()
	switch n := len(id); {
	case n > 8 && n <= 32:
		return m.loadWords(t, id)
	case n > 0 && n <= 8:
		return m.loadShort(t, id)
	}
	h := m.seed.hash(id)
	tags := tagOf(h) * lows
	for b := h & t.mask; ; b = (b + 1) & t.mask {
		bk := &t.buckets[b]
		meta := bk.meta.Load()
		for hit := someZeroBytes(meta ^ tags); hit != 0; hit &= hit - 1 {
			if en := bk.slots[bits.TrailingZeros64(hit)>>3].Load(); en != nil && en.named(id) {
				return en, true
			}
		}
		if zeroBytes(meta) != 0 {
			return nil, false
		}
	}
}

// loadWords is Load of an identifier of 9 to 32 bytes: hash's and
// named's steps for that length, on words of id read once.
func (m *entryMap) loadWords(t *entryTable, id string) (*entry, bool) {
	k := &m.seed
	n := len(id)
	b := unsafe.Slice(unsafe.StringData(id), n)
	le := binary.LittleEndian
	first, last := le.Uint64(b), le.Uint64(b[n-8:])
	var second, third uint64 // bytes 8 to 15 and 16 to 23, when inside id
	seed, x := k[0], first
	if n > 16 {
		second, x = le.Uint64(b[8:]), le.Uint64(b[n-16:])
		seed = mix(first^k[1], second^seed)
		if n > 24 {
			third = le.Uint64(b[16:])
		}
	}
	h := k.finish(n, x, last, seed)
	tags := tagOf(h) * lows
	for bi := h & t.mask; ; bi = (bi + 1) & t.mask {
		bk := &t.buckets[bi]
		meta := bk.meta.Load()
		for hit := someZeroBytes(meta ^ tags); hit != 0; hit &= hit - 1 {
			en := bk.slots[bits.TrailingZeros64(hit)>>3].Load()
			if en == nil || int(*en.length()) != n {
				continue
			}
			// The name's bytes follow its length byte (see idBytes).
			y := unsafe.Slice((*byte)(unsafe.Add(unsafe.Pointer(en.length()), 1)), n)
			if le.Uint64(y) != first || le.Uint64(y[n-8:]) != last ||
				n > 16 && le.Uint64(y[8:]) != second || n > 24 && le.Uint64(y[16:]) != third {
				continue
			}
			return en, true
		}
		if zeroBytes(meta) != 0 {
			return nil, false
		}
	}
}

// loadShort is Load of an identifier of 1 to 8 bytes (short keys, most
// IPv4 addresses), as loadWords: hash's steps for that length, and the
// name compared on the same bytes, which cover all of it. Its probe loop
// is find's, written out again on purpose: a shared one would compare
// names through a call, which is what these functions exist to avoid.
func (m *entryMap) loadShort(t *entryTable, id string) (*entry, bool) {
	k := &m.seed
	n := len(id)
	x, y := shortWords(unsafe.Slice(unsafe.StringData(id), n))
	h := k.finish(n, x, y, k[0])
	tags := tagOf(h) * lows
	for bi := h & t.mask; ; bi = (bi + 1) & t.mask {
		bk := &t.buckets[bi]
		meta := bk.meta.Load()
		for hit := someZeroBytes(meta ^ tags); hit != 0; hit &= hit - 1 {
			en := bk.slots[bits.TrailingZeros64(hit)>>3].Load()
			if en == nil || int(*en.length()) != n {
				continue
			}
			// The name's bytes follow its length byte (see idBytes).
			cx, cy := shortWords(unsafe.Slice((*byte)(unsafe.Add(unsafe.Pointer(en.length()), 1)), n))
			if cx == x && cy == y {
				return en, true
			}
		}
		if zeroBytes(meta) != 0 {
			return nil, false
		}
	}
}

// find returns the entry of id, whose hash is h, or nil.
func (t *entryTable) find(h uint64, id string) *entry {
	tags := tagOf(h) * lows
	for b := h & t.mask; ; b = (b + 1) & t.mask {
		bk := &t.buckets[b]
		meta := bk.meta.Load()
		for hit := someZeroBytes(meta ^ tags); hit != 0; hit &= hit - 1 {
			if en := bk.slots[bits.TrailingZeros64(hit)>>3].Load(); en != nil && en.named(id) {
				return en
			}
		}
		if zeroBytes(meta) != 0 {
			return nil
		}
	}
}

// LoadOrCreate returns the entry of id, or makes one in the map's slabs
// whose current cell is an empty cell for seq (a linked cell when linked
// is set, made at now: see madeAt; marked read when read is) and returns it; loaded reports
// whether it was there. The entry is made before the map's lock is
// taken (its slot claimed with one atomic addition in the open slab of
// the hash's shard, see slotIn), so that
// inserts of new keys hold the lock only to place one: when two callers
// race for one key, both make one, and the loser's is out of the map at
// once (its tombstone, see slab.dead).
func (m *entryMap) LoadOrCreate(id string, seq, now int64, linked, read bool) (en *entry, loaded bool) {
	return m.loadOrAdopt(id, seq, now, linked, read, [2]*cell{})
}

// loadOrAdopt is LoadOrCreate, whose new entry adopts back (see
// entry.adopt) when it holds a cell.
func (m *entryMap) loadOrAdopt(id string, seq, now int64, linked, read bool, back [2]*cell) (en *entry, loaded bool) {
	h := m.seed.hash(id)
	if en := m.table.Load().find(h, id); en != nil {
		return en, true
	}
	made := newEntryIn(m, int(h>>62)*slabKinds, id, seq, now, linked)
	if back[0] != nil {
		made.adopt(back, seq)
	}
	if read {
		made.cur.Load().setBits(stRead)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.roomDuringGrowth()
	if en := m.table.Load().find(h, id); en != nil {
		made.cur.Store(tombstone)
		return en, true
	}
	m.insert(h, made)
	return made, false
}

// LoadAndDelete deletes the entry of id and returns it.
func (m *entryMap) LoadAndDelete(id string) (*entry, bool) {
	h := m.seed.hash(id)
	m.mu.Lock()
	defer m.mu.Unlock()
	en := m.remove(h, id)
	m.shrink()
	return en, en != nil
}

// Range calls f for each entry until f returns false. It takes no lock: f
// may use the map. An entry stored or deleted meanwhile may be seen or
// not; every other one is seen once.
func (m *entryMap) Range(f func(id string, en *entry) bool) {
	t := m.table.Load()
	for b := range t.buckets {
		bk := &t.buckets[b]
		for j := range bk.slots {
			if en := bk.slots[j].Load(); en != nil && !f(en.id(), en) {
				return
			}
		}
	}
}

// deleteChunk is how many buckets DeleteMatching visits per hold of the
// map's lock (and copies, of a growth under way): 1,792 slots, tens of
// microseconds. Held for a whole
// table, the janitor's pass over 500,000 keys kept every new key waiting
// for its insert for 40 to 50 ms, every JanitorInterval.
const deleteChunk = 256

// DeleteMatching calls f for each entry, under the map's lock (f must not
// use the map), deletes those for which f returns del, and stops when f
// returns stop. It returns the number deleted.
//
// It lets the lock go between chunks of deleteChunk buckets, so inserts
// wait for a chunk, not for the table. An entry stored meanwhile in a
// bucket already visited is not seen. When the table is rebuilt between
// two chunks (it grew or shrank), the visit starts over on the new one:
// f may see an entry it kept a second time, never one it deleted.
func (m *entryMap) DeleteMatching(f func(id string, en *entry) (del, stop bool)) int {
	var t *entryTable
	n, b := 0, 0
	for {
		m.mu.Lock()
		if cur := m.table.Load(); cur != t {
			t, b = cur, 0
		}
		stop := false
		for end := min(b+deleteChunk, len(t.buckets)); b < end && !stop; b++ {
			bk := &t.buckets[b]
			for j := range bk.slots {
				en := bk.slots[j].Load()
				if en == nil {
					continue
				}
				var del bool
				del, stop = f(en.id(), en)
				if del {
					m.clear(b, bk, j)
					n++
				}
				if stop {
					break
				}
			}
		}
		done := stop || b >= len(t.buckets)
		if g := m.growing; g != nil {
			// A pass ends the growth under way (the table is then
			// replaced: the next chunk starts the visit over).
			m.copyOld(g, deleteChunk)
		}
		if done {
			m.shrink()
			m.sweep()
		}
		m.mu.Unlock()
		if done {
			return n
		}
		if m.betweenChunks != nil {
			m.betweenChunks()
		}
		// A writer that waited has been woken: let it take the lock
		// before this pass takes it again.
		runtime.Gosched()
	}
}

// insert adds en, whose hash is h, made in the map's slabs, and which the
// map does not hold; under mu.
//
// The insert that fills the table to seven eighths starts its growth: a
// new table sized for the entries then (at most half full), which takes a
// copy of the old one's buckets in steps. Each insert during the growth
// copies growStep buckets, and each chunk of a janitor's pass
// (DeleteMatching) deleteChunk of them, under the lock they hold anyway;
// the table is replaced when the last bucket is copied. Meanwhile inserts
// and deletions go on in the old table, and to the new one too when the
// bucket they change has been copied already.
//
// The map's lock held for the whole copy, in the insert that started it,
// kept that request and every new key waiting: 180 ms for a table grown
// past 800,000 keys. A copy of the whole table on a goroutine of its own,
// without the lock, which took the changes made meanwhile at its end,
// still held a core: with Caddy on one, every decision waited behind it,
// 20 ms past its time for a table of 500,000 keys
// (BenchmarkNewKeysWorst, late-µs, -cpu 1). The same goroutine copying in
// chunks under the lock took the lock from the inserts it raced on two
// cores (20-35 ms late there). In steps, a new key pays for a few
// buckets, about a microsecond, while a growth is under way.
func (m *entryMap) insert(h uint64, en *entry) {
	t := m.table.Load()
	b, wasEmpty := t.place(h, en)
	if wasEmpty {
		m.used++
	}
	m.live++
	if g := m.growing; g != nil {
		if int(b) < g.next {
			g.place(h, en)
		}
		m.copyOld(g, growStep)
	} else if 8*m.used > 7*bucketSlots*len(t.buckets) {
		m.growing = &growth{t: newEntryTable(bucketsFor(m.live), m)}
	}
}

// roomDuringGrowth ends a growth under way at once, under mu, when the
// next insert could fill the table it copies past fifteen sixteenths: a
// probe must always end at an empty slot, even in a table a reader keeps
// after it is replaced. growStep keeps a large table's copy ahead of
// that; a small table (two buckets, fourteen slots) starts its growth one
// insert from it, and copies it whole in the next.
func (m *entryMap) roomDuringGrowth() {
	if g := m.growing; g != nil {
		if n := len(m.table.Load().buckets); 16*(m.used+1) > 15*bucketSlots*n {
			m.copyOld(g, n)
		}
	}
}

// copyOld copies up to n more buckets of the current table into g's, and
// publishes g's table once every bucket is copied; under mu.
func (m *entryMap) copyOld(g *growth, n int) {
	old := m.table.Load()
	end := min(g.next+n, len(old.buckets))
	for ; g.next < end; g.next++ {
		bk := &old.buckets[g.next]
		for j := range bk.slots {
			if en := bk.slots[j].Load(); en != nil {
				g.place(m.seed.hash(en.id()), en)
			}
		}
	}
	if g.next < len(old.buckets) {
		return
	}
	m.publish(old, g.t)
	m.used = g.used
	m.growing = nil
}

// place puts en, whose hash is h, in the growth's table.
func (g *growth) place(h uint64, en *entry) {
	if _, wasEmpty := g.t.place(h, en); wasEmpty {
		g.used++
	}
}

// slotOf finds en, whose hash is h, in t: its bucket and slot, or a nil
// bucket. It compares pointers and reads nothing of en.
func (t *entryTable) slotOf(h uint64, en *entry) (*entryBucket, int) {
	tags := tagOf(h) * lows
	for b := h & t.mask; ; b = (b + 1) & t.mask {
		bk := &t.buckets[b]
		meta := bk.meta.Load()
		for hit := someZeroBytes(meta ^ tags); hit != 0; hit &= hit - 1 {
			if j := bits.TrailingZeros64(hit) >> 3; bk.slots[j].Load() == en {
				return bk, j
			}
		}
		if zeroBytes(meta) != 0 {
			return nil, 0
		}
	}
}

// place puts en, whose hash is h, in the first free slot from its hash's
// bucket on, and returns that slot's bucket and whether the slot was
// empty (not deleted). The slot is stored before the tag: a reader that
// sees the tag finds the entry. A deleted slot is taken again: probes for
// other keys go on past it either way, and a probe for en stops at it.
func (t *entryTable) place(h uint64, en *entry) (bucket uint64, wasEmpty bool) {
	for b := h & t.mask; ; b = (b + 1) & t.mask {
		bk := &t.buckets[b]
		meta := bk.meta.Load()
		free := zeroBytes(meta) | zeroBytes(meta^tagDeleted*lows)
		if free == 0 {
			continue
		}
		j := bits.TrailingZeros64(free) >> 3
		bk.slots[j].Store(en)
		bk.meta.Store(meta&^(0xff<<(8*j)) | tagOf(h)<<(8*j))
		return b, meta>>(8*j)&0xff == 0
	}
}

// remove deletes the entry of id and returns it, or nil; under mu.
func (m *entryMap) remove(h uint64, id string) *entry {
	t := m.table.Load()
	tags := tagOf(h) * lows
	for b := h & t.mask; ; b = (b + 1) & t.mask {
		bk := &t.buckets[b]
		meta := bk.meta.Load()
		for hit := someZeroBytes(meta ^ tags); hit != 0; hit &= hit - 1 {
			j := bits.TrailingZeros64(hit) >> 3
			if en := bk.slots[j].Load(); en != nil && en.named(id) {
				m.clear(int(b), bk, j)
				return en
			}
		}
		if zeroBytes(meta) != 0 {
			return nil
		}
	}
}

// clear deletes slot j of bk, bucket b of the current table; under mu.
// The tag first: a reader that still saw the old one finds nil or the
// entry, as if it ran a moment earlier. A growth that copied the bucket
// already loses the entry too.
func (m *entryMap) clear(b int, bk *entryBucket, j int) {
	if g := m.growing; g != nil && b < g.next {
		en := bk.slots[j].Load()
		if nb, nj := g.t.slotOf(m.seed.hash(en.id()), en); nb != nil {
			nb.clear(nj)
		}
	}
	bk.clear(j)
	m.live--
	m.removed++
}

// clear marks slot j deleted and empties it, the tag first.
func (bk *entryBucket) clear(j int) {
	meta := bk.meta.Load()
	bk.meta.Store(meta&^(0xff<<(8*j)) | tagDeleted<<(8*j))
	bk.slots[j].Store(nil)
}

// sweep lets go of the full slabs whose entries have all been removed
// (see slab.go), once the entries removed since the last sweep are a
// quarter of the full slabs' slots (each sweep reads at most every full
// slot, so a removal costs at most four reads); under mu. The set is
// copied, not changed: a table replaced earlier keeps the set it had
// (see entryTable).
//
// Until 2026-11-29 the sweep came once the removals were twice the full
// slabs. A flood past max_entries removes a key for each it adds, and a
// slab of two slots (a linked entry of a long identifier: a hashed one
// with Redis) adds half a slab a key: the removals never caught up, no
// slab was let go, and the heap grew by about 200 bytes an eviction for
// as long as a flood lasted (TestSlab_AFloodThatRemovesAsItAdds…).
func (m *entryMap) sweep() {
	full := m.slabs.full
	if 4*m.removed < m.fullSlots || len(full) == 0 {
		return
	}
	m.removed = 0
	live := make([]slab, 0, len(full))
	slots := 0
	for i := range full {
		if !full[i].dead() {
			live = append(live, full[i])
			slots += int(full[i].cap)
		}
	}
	if len(live) == len(full) {
		return
	}
	m.slabs, m.fullSlots = &slabSet{full: live}, slots
}

// shrink rebuilds a table that deletions left less than a sixteenth
// full, so that a flood of keys the janitor dropped gives its memory
// back; under mu.
func (m *entryMap) shrink() {
	if n := len(m.table.Load().buckets); n > minBuckets && 16*m.live < bucketSlots*n && m.growing == nil {
		m.rehash(m.live)
	}
}

// rehash copies the entries into a new table sized for n entries (at
// most half full) and publishes it; under mu throughout (a shrink: the
// table holds few entries), as a growth copied at once.
func (m *entryMap) rehash(n int) {
	m.copyOld(&growth{t: newEntryTable(bucketsFor(n), m)}, len(m.table.Load().buckets))
}

// bucketsFor is the size of a table for n entries: at most half full.
func bucketsFor(n int) int {
	buckets := minBuckets
	for buckets*bucketSlots < 2*n {
		buckets *= 2
	}
	return buckets
}

// publish makes t, which holds every entry of old, the map's table; under
// mu. The old table is not written again, and keeps the map's slabs as
// they are now for a reader still on it.
func (m *entryMap) publish(old, t *entryTable) {
	then := &slabsThen{set: m.slabs}
	for k := range m.open {
		then.open[k] = m.open[k].Load()
	}
	old.frozen.Store(then)
	m.table.Store(t)
}

// idSeed is the random key of a map's hash.
type idSeed [4]uint64

func newIDSeed() idSeed { return idSeed{rand.Uint64(), rand.Uint64(), rand.Uint64(), rand.Uint64()} }

// hash returns the hash of an identifier: the algorithm of the Go
// runtime's string hash where the processor has no AES instructions (a
// wyhash), keyed by the seed. Written here, where the runtime's hash is
// three calls deep, so that Load can write out its steps for the common
// lengths (see loadWords): the lookup of a decision calls nothing.
func (k *idSeed) hash(s string) uint64 {
	n := len(s)
	b := unsafe.Slice(unsafe.StringData(s), n)
	seed := k[0]
	var x, y uint64
	switch {
	case n == 0:
		return seed
	case n <= 8:
		x, y = shortWords(b)
	case n <= 16:
		x = binary.LittleEndian.Uint64(b)
		y = binary.LittleEndian.Uint64(b[n-8:])
	case n <= 32:
		// hashLong's loop, once: its first 16 bytes, then its last 16.
		seed = mix(binary.LittleEndian.Uint64(b)^k[1], binary.LittleEndian.Uint64(b[8:])^seed)
		x = binary.LittleEndian.Uint64(b[n-16:])
		y = binary.LittleEndian.Uint64(b[n-8:])
	default:
		return k.hashLong(b)
	}
	return k.finish(n, x, y, seed)
}

// shortWords are the two words hash reads of 1 to 8 bytes, which hold
// every byte: under 4, the first, middle and last byte; else the first 4
// and the last 4.
func shortWords(b []byte) (x, y uint64) {
	n := len(b)
	if n < 4 {
		return uint64(b[0]) | uint64(b[n>>1])<<8 | uint64(b[n-1])<<16, 0
	}
	return uint64(binary.LittleEndian.Uint32(b)), uint64(binary.LittleEndian.Uint32(b[n-4:]))
}

// finish is every hash's last step: the words x and y of an identifier of
// n bytes mixed with seed, which the earlier steps made. hash, hashLong,
// loadWords and loadShort share it, so they cannot disagree.
func (k *idSeed) finish(n int, x, y, seed uint64) uint64 {
	const m5 = 0x1d8e4e27c47d124f
	return mix(m5^uint64(n), mix(x^k[1], y^seed))
}

// hashLong is hash for more than 16 bytes.
func (k *idSeed) hashLong(b []byte) uint64 {
	le := binary.LittleEndian
	n := len(b)
	seed := k[0]
	off := 0
	if n > 48 {
		seed1, seed2 := seed, seed
		for ; n-off > 48; off += 48 {
			c := b[off : off+48]
			seed = mix(le.Uint64(c)^k[1], le.Uint64(c[8:])^seed)
			seed1 = mix(le.Uint64(c[16:])^k[2], le.Uint64(c[24:])^seed1)
			seed2 = mix(le.Uint64(c[32:])^k[3], le.Uint64(c[40:])^seed2)
		}
		seed ^= seed1 ^ seed2
	}
	for ; n-off > 16; off += 16 {
		seed = mix(le.Uint64(b[off:])^k[1], le.Uint64(b[off+8:])^seed)
	}
	// The last 16 bytes of the identifier, read from its end.
	return k.finish(n, le.Uint64(b[n-16:]), le.Uint64(b[n-8:]), seed)
}

func mix(a, b uint64) uint64 {
	hi, lo := bits.Mul64(a, b)
	return hi ^ lo
}
