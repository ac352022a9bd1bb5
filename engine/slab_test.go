package engine

import (
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
	"weak"
)

// slabTestID returns the i-th identifier of n bytes (i < 256 when n is 1),
// unlike any other of its length.
func slabTestID(n, i int) string {
	b := make([]byte, n)
	for j := range b {
		b[j] = byte(i >> (8 * (j % 3)) * (j/3 + 1))
	}
	if n > 0 {
		b[0] = byte(i)
	}
	if n > 1 {
		b[1] = byte(i >> 8)
	}
	return string(b)
}

// garbage allocates and drops objects of every small size, so that memory
// the collector freed by mistake is soon written over.
func garbage() {
	var sink [][]byte
	for size := 8; size <= 2048; size += 8 {
		for range 16 {
			sink = append(sink, make([]byte, size))
		}
	}
	runtime.KeepAlive(sink)
}

// TestSlab_EveryLayoutKeepsItsEntries makes entries of every identifier
// length, local and linked, several slabs of each, and checks each after
// collections that would have freed any slab nothing kept: its name, its
// cell's sequence and kind, and that the map finds it.
func TestSlab_EveryLayoutKeepsItsEntries(t *testing.T) {
	m := newEntryMap()
	type made struct {
		id     string
		seq    int64
		linked bool
		en     *entry
	}
	var all []made
	for n := 0; n <= 65; n++ {
		for _, linked := range []bool{false, true} {
			count := 25
			if n == 0 {
				count = 1
			}
			for i := range count {
				id := slabTestID(n, i)
				if linked {
					id = slabTestID(n, i+count) // a name of its own
				}
				seq := int64(n*1000 + i)
				en, loaded := m.LoadOrCreate(id, seq, 0, linked, false)
				if loaded {
					if n == 0 {
						continue // the one empty identifier, made local
					}
					t.Fatalf("length %d, %d: %q made twice", n, i, id)
				}
				all = append(all, made{id, seq, linked, en})
			}
		}
	}
	for range 3 {
		runtime.GC()
		garbage()
	}
	for _, x := range all {
		en, ok := m.Load(x.id)
		if !ok || en != x.en {
			t.Fatalf("%q: not found after collections", x.id)
		}
		c := en.cur.Load()
		if en.id() != x.id || c.seq() != x.seq || (c.state()&stLinked != 0) != x.linked {
			t.Fatalf("%q (seq %d, linked %v): holds %q, seq %d, state %#x", x.id, x.seq, x.linked, en.id(), c.seq(), c.state())
		}
	}
}

// removeAll removes every entry of m as the janitor does: the tombstone,
// then the deletion.
func removeAll(m *entryMap, keep func(id string) bool) int {
	return m.DeleteMatching(func(id string, en *entry) (bool, bool) {
		if keep(id) {
			return false, false
		}
		return en.cur.CompareAndSwap(en.cur.Load(), tombstone), false
	})
}

// TestSlab_DeadSlabsAreLetGo removes most keys of a map: the full slabs
// whose entries were all removed leave the map's set, the ones with a key
// left stay, an entry a request still holds stays readable after
// collections, and so does every entry a table replaced meanwhile points
// at, for a reader still on it.
func TestSlab_DeadSlabsAreLetGo(t *testing.T) {
	m := newEntryMap()
	const n = 10_000
	for i := range n {
		m.LoadOrCreate("k"+strconv.Itoa(i), 0, 0, false, false)
	}
	settle(m)
	if full := len(m.slabs.full); full < n/maxSlabSlots-slabShards*2 {
		t.Fatalf("%d full slabs for %d keys", full, n)
	}
	held, _ := m.Load("k5") // a request holds it
	old := m.table.Load()   // a reader is on the table of the first keys
	for i := n; i < 2*n; i++ {
		m.LoadOrCreate("k"+strconv.Itoa(i), 0, 0, false, false)
	}
	settle(m)
	if m.table.Load() == old {
		t.Fatal("the table was not replaced")
	}
	frozen := readAll(t, old)
	if frozen < n {
		t.Fatalf("the replaced table holds %d entries, want at least %d", frozen, n)
	}
	kept := func(id string) bool { return id == "k4000" || id == "k4001" }
	if got := removeAll(m, kept); got != 2*n-2 {
		t.Fatalf("removed %d, want %d", got, 2*n-2)
	}
	if got := len(m.slabs.full); got > 2 {
		t.Fatalf("%d full slabs left for 2 keys, want at most 2", got)
	}
	for range 3 {
		runtime.GC()
		garbage()
	}
	if held.id() != "k5" || held.cur.Load() != tombstone {
		t.Fatalf("a held entry reads %q", held.id())
	}
	if got := readAll(t, old); got != frozen {
		t.Fatalf("the replaced table holds %d entries, want %d", got, frozen)
	}
	for _, id := range []string{"k4000", "k4001"} {
		if en, ok := m.Load(id); !ok || en.id() != id {
			t.Fatalf("%s lost", id)
		}
	}
}

// readAll reads the identifier of every entry of t, which must be one the
// test made, and returns how many there are.
func readAll(t *testing.T, tb *entryTable) int {
	t.Helper()
	seen := 0
	for b := range tb.buckets {
		for j := range tb.buckets[b].slots {
			if en := tb.buckets[b].slots[j].Load(); en != nil {
				if id := en.id(); len(id) < 2 || id[0] != 'k' {
					t.Fatalf("an entry of the table reads %q", id)
				}
				seen++
			}
		}
	}
	return seen
}

// TestSlab_ReplacedTableKeepsItsOpenSlabs replaces a table while a slab
// is open, lets the map's set change, then fills that slab, removes its
// entries and lets the set change again: the replaced table, which still
// points into the slab, must keep it, though no set the table kept ever
// held it.
func TestSlab_ReplacedTableKeepsItsOpenSlabs(t *testing.T) {
	m := newEntryMap()
	create := func(id string) {
		if _, loaded := m.LoadOrCreate(id, 0, 0, false, false); loaded {
			t.Fatalf("%q made twice", id)
		}
	}
	for i := range 100 {
		create("ka" + strconv.Itoa(i)) // ten full slabs of short keys
	}
	kb0, _ := m.LoadOrCreate("kb0", 0, 0, false, false) // the first of an open slab
	w := weak.Make(kb0)
	kb0 = nil
	for i := 1; i < 5; i++ {
		create("kb" + strconv.Itoa(i)) // half of it
	}
	old := m.table.Load()
	long := func(i int) string { return "k" + strings.Repeat("x", 29) + strconv.Itoa(i) }
	for i := 0; m.table.Load() == old; i++ {
		create(long(i)) // slabs of another kind, until the table is replaced
	}
	settle(m)
	frozen := readAll(t, old)
	isA := func(id string) bool { return strings.HasPrefix(id, "ka") }
	if removeAll(m, func(id string) bool { return !isA(id) }) != 100 {
		t.Fatal("the short keys were not all removed")
	}
	set := m.slabs
	for i := 5; i < 200; i++ {
		create("kb" + strconv.Itoa(i)) // fills the open slabs, which join the new set
	}
	if m.slabs != set {
		t.Fatal("the set changed while the open slab filled")
	}
	settle(m) // a growth under way puts the slabs' sweep off
	removeAll(m, func(string) bool { return false })
	if m.slabs == set || len(m.slabs.full) != 0 {
		t.Fatalf("%d full slabs left of an empty map", len(m.slabs.full))
	}
	for range 3 {
		runtime.GC()
		garbage()
	}
	if w.Value() == nil {
		t.Fatal("the slab of entries a replaced table holds was freed")
	}
	if got := readAll(t, old); got != frozen {
		t.Fatalf("the replaced table holds %d entries, want %d", got, frozen)
	}
}

// TestSlab_ForgottenAndIdleKeysGiveTheirSlabsBack forgets half of a zone's
// keys through the admin path (Forget, which leaves the tombstone after
// the deletion) and lets the other half go idle: the janitor's passes
// leave no full slab behind.
func TestSlab_ForgottenAndIdleKeysGiveTheirSlabsBack(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	z := e.Zone("zone", time.Minute)
	const n = 2000
	for i := range n {
		l := lim("k"+strconv.Itoa(i), time.Minute, 100, 1)
		l.Zone = z
		e.Decide(bg, l)
	}
	settle(z.entries)
	if full := len(z.entries.slabs.full); full < n/maxSlabSlots-slabShards*2 {
		t.Fatalf("%d full slabs for %d keys", full, n)
	}
	for i := 0; i < n; i += 2 {
		if !e.Forget(Key{Namespace: "zone", Identifier: "k" + strconv.Itoa(i), Window: time.Minute}) {
			t.Fatalf("k%d not forgotten", i)
		}
	}
	e.Sweep() // the forgotten keys' slabs still hold the others
	clk.Advance(3 * time.Minute)
	if got := e.Sweep(); got != n/2 {
		t.Fatalf("the janitor dropped %d idle keys, want %d", got, n/2)
	}
	if full := len(z.entries.slabs.full); full != 0 {
		t.Fatalf("%d full slabs left with no key", full)
	}
}

// TestSlab_AFloodThatRemovesAsItAddsLetsGoOfItsSlabs: a flood of one-off
// keys past max_entries removes a key for each it adds. The sweep came
// once the removals since the last were twice the full slabs; a slab of
// two slots (a linked entry of an identifier over 16 bytes: a hashed one
// with Redis) adds half a slab a key, so the removals never caught up,
// and no slab was ever let go: the heap grew by about 200 bytes an
// eviction for as long as a flood lasted (an audit: a Caddy with Redis
// under 1–4 KB identifiers, from 31 to 84 MB of live heap in 45 s at
// 20,000 keys).
func TestSlab_AFloodThatRemovesAsItAddsLetsGoOfItsSlabs(t *testing.T) {
	for _, c := range []struct {
		name   string
		id     func(i int) string
		linked bool
	}{
		{"linked, hashed identifiers", func(i int) string { return fmt.Sprintf("#%064x", i) }, true},
		{"linked, 24-byte identifiers", func(i int) string { return fmt.Sprintf("user-%019d", i) }, true},
		{"local, hashed identifiers", func(i int) string { return fmt.Sprintf("#%064x", i) }, false},
		{"local, short identifiers", func(i int) string { return "k" + strconv.Itoa(i) }, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := newEntryMap()
			const live, rounds = 500, 200
			most := 0
			for r := range rounds {
				for i := r * live; i < (r+1)*live; i++ {
					m.LoadOrCreate(c.id(i), 0, 0, c.linked, false)
				}
				newest := map[string]bool{}
				for i := r * live; i < (r+1)*live; i++ {
					newest[c.id(i)] = true
				}
				removeAll(m, func(id string) bool { return newest[id] })
				most = max(most, len(m.slabs.full))
			}
			// 500 live keys hold at most 250 slabs of two slots; the dead
			// ones the sweep has not reached yet are fewer than those.
			if most > live {
				t.Fatalf("%d full slabs at most for %d live keys over %d keys made", most, live, live*rounds)
			}
			t.Logf("%d full slabs at most for %d live keys", most, live)
		})
	}
}
