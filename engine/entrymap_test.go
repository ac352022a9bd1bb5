package engine

import (
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

// TestEntryMap_StoresFindsAndDeletes checks the map against a plain map
// through inserts, deletions, reinsertions and the rehashes they cause,
// growing and shrinking.
func TestEntryMap_StoresFindsAndDeletes(t *testing.T) {
	m := newEntryMap()
	want := map[string]*entry{}
	check := func(stage string) {
		t.Helper()
		for id, en := range want {
			if got, ok := m.Load(id); !ok || got != en || got.id() != id {
				t.Fatalf("%s: Load(%q) = %p, %v; want %p", stage, id, got, ok, en)
			}
		}
		for i := 0; i < 1000; i++ {
			id := "absent-" + strconv.Itoa(i)
			if _, ok := m.Load(id); ok {
				t.Fatalf("%s: Load(%q) found an entry never stored", stage, id)
			}
		}
		seen := map[string]int{}
		m.Range(func(id string, en *entry) bool {
			seen[id]++
			if want[id] != en {
				t.Fatalf("%s: Range gave %q → %p, want %p", stage, id, en, want[id])
			}
			return true
		})
		if len(seen) != len(want) {
			t.Fatalf("%s: Range saw %d entries, want %d", stage, len(seen), len(want))
		}
		for id, n := range seen {
			if n != 1 {
				t.Fatalf("%s: Range saw %q %d times", stage, id, n)
			}
		}
		if m.live != len(want) {
			t.Fatalf("%s: live = %d, want %d", stage, m.live, len(want))
		}
	}
	const n = 20_000
	for i := 0; i < n; i++ {
		id := "k" + strconv.Itoa(i)
		en, loaded := m.LoadOrCreate(id, 0, 0, false, false)
		if loaded {
			t.Fatalf("LoadOrCreate(%q) loaded an entry never stored", id)
		}
		want[id] = en
		if again, loaded := m.LoadOrCreate(id, 0, 0, false, false); !loaded || again != en {
			t.Fatalf("second LoadOrCreate(%q) = %p, %v; want %p, true", id, again, loaded, en)
		}
	}
	settle(m)
	check("inserted")
	grown := len(m.table.Load().buckets)
	for i := 0; i < n; i += 2 {
		id := "k" + strconv.Itoa(i)
		if en, ok := m.LoadAndDelete(id); !ok || en != want[id] {
			t.Fatalf("LoadAndDelete(%q) = %p, %v; want %p", id, en, ok, want[id])
		}
		delete(want, id)
	}
	if _, ok := m.LoadAndDelete("k0"); ok {
		t.Fatal("LoadAndDelete of a deleted key found it")
	}
	check("half deleted")
	// Deleted slots are taken again by new keys.
	for i := 0; i < n; i += 2 {
		id := "k" + strconv.Itoa(i)
		en, _ := m.LoadOrCreate(id, 0, 0, false, false)
		want[id] = en
	}
	settle(m)
	check("reinserted")
	if got := len(m.table.Load().buckets); got > grown {
		t.Fatalf("table grew from %d to %d buckets for as many keys", grown, got)
	}
	deleted := m.DeleteMatching(func(id string, en *entry) (bool, bool) {
		return id != "k1", false
	})
	if deleted != n-1 {
		t.Fatalf("DeleteMatching deleted %d, want %d", deleted, n-1)
	}
	want = map[string]*entry{"k1": want["k1"]}
	check("all but one deleted")
	if got := len(m.table.Load().buckets); got != minBuckets {
		t.Fatalf("table of one entry has %d buckets, want %d", got, minBuckets)
	}
	m.LoadAndDelete("k1")
	replacement, loaded := m.LoadOrCreate("k1", 0, 0, false, false)
	if loaded || replacement == want["k1"] {
		t.Fatal("a key deleted and made again has its old entry")
	}
	want["k1"] = replacement
	check("replaced")
}

// TestEntryMap_DeleteMatchingStops checks that DeleteMatching stops where
// its function says.
func TestEntryMap_DeleteMatchingStops(t *testing.T) {
	m := newEntryMap()
	for i := 0; i < 100; i++ {
		m.LoadOrCreate(strconv.Itoa(i), 0, 0, false, false)
	}
	calls := 0
	deleted := m.DeleteMatching(func(string, *entry) (bool, bool) {
		calls++
		return true, calls == 10
	})
	if deleted != 10 || m.live != 90 {
		t.Fatalf("deleted %d, %d left; want 10 deleted, 90 left", deleted, m.live)
	}
}

// TestEntryMap_DeleteMatchingLetsWritersIn checks that a pass over a
// large map lets the lock go between chunks (a new key's insert waits for
// a chunk, not for the table: before, the janitor's pass over 500,000
// keys held it 40 to 50 ms), and that keys stored between chunks, and a
// table rebuilt between them, cost the pass none of the entries it must
// delete and make it see none it deleted twice.
func TestEntryMap_DeleteMatchingLetsWritersIn(t *testing.T) {
	for _, grow := range []bool{false, true} {
		m := newEntryMap()
		const n = 5000 // a table of 2,048 buckets: 8 chunks
		for i := range n {
			m.LoadOrCreate("k"+strconv.Itoa(i), 0, 0, false, false)
		}
		settle(m)
		first := m.table.Load()
		chunks, added := 0, 0
		m.betweenChunks = func() {
			chunks++
			if !m.mu.TryLock() {
				t.Fatal("the map's lock is held between chunks")
			}
			m.mu.Unlock()
			more := 1
			if grow && chunks == 1 {
				more = n // past seven eighths of the table: it is rebuilt
			}
			for range more {
				m.LoadOrCreate("new"+strconv.Itoa(added), 0, 0, false, false)
				added++
			}
		}
		deleted := map[string]bool{}
		got := m.DeleteMatching(func(id string, _ *entry) (bool, bool) {
			if deleted[id] {
				t.Errorf("grow %v: %q seen after it was deleted", grow, id)
			}
			del := strings.HasPrefix(id, "k") && id[len(id)-1]%2 == 0
			deleted[id] = del
			return del, false
		})
		if chunks < 2 {
			t.Fatalf("grow %v: %d pauses between chunks; want a pass in several", grow, chunks)
		}
		if grow && m.table.Load() == first {
			t.Fatal("the table was not rebuilt during the pass")
		}
		if got != n/2 {
			t.Errorf("grow %v: deleted %d; want %d", grow, got, n/2)
		}
		for i := range n {
			id := "k" + strconv.Itoa(i)
			if _, ok := m.Load(id); ok != (i%2 == 1) {
				t.Fatalf("grow %v: %q present %v after the pass", grow, id, ok)
			}
		}
		for i := range added {
			if _, ok := m.Load("new" + strconv.Itoa(i)); !ok {
				t.Fatalf("grow %v: new%d, stored between chunks, is gone", grow, i)
			}
		}
		if m.live != n/2+added {
			t.Errorf("grow %v: %d live; want %d", grow, m.live, n/2+added)
		}
	}
}

// TestEntryMap_GrowsInSteps grows a table while keys are stored and
// deleted beside the copy, which goes on in steps under the lock the
// inserts and a janitor's pass hold anyway (the insert that grew a table
// past 800,000 keys once held it for the whole copy, 180 ms, and every new
// key waited): changes to buckets copied and not yet copied both reach the
// new table, a pass of DeleteMatching ends the growth, and the new table
// ends holding exactly the entries the map holds, each once.
func TestEntryMap_GrowsInSteps(t *testing.T) {
	m := newEntryMap()
	want := map[string]*entry{}
	add := func(id string) {
		en, loaded := m.LoadOrCreate(id, 0, 0, false, false)
		if loaded {
			t.Errorf("%q was already there", id)
		}
		want[id] = en
	}
	del := func(id string) {
		if en, ok := m.LoadAndDelete(id); !ok || en != want[id] {
			t.Errorf("LoadAndDelete(%q) = %p, %v; want %p", id, en, ok, want[id])
		}
		delete(want, id)
	}
	old := fillToGrowth(t, m, 1024, add)
	g := m.growing
	if g == nil || g.next != 0 {
		t.Fatalf("growth %+v after the table passed seven eighths; want one begun", g)
	}
	// Beside the copy: new keys, deletions of old and new ones (in
	// buckets copied and not), and a key deleted and made again.
	for j := range 20 {
		add("during" + strconv.Itoa(j))
	}
	for j := range 10 {
		del("k" + strconv.Itoa(j))
		del("during" + strconv.Itoa(j))
	}
	add("k0")
	if m.table.Load() != old || g.next != 21*growStep {
		t.Fatalf("after 21 inserts: %d buckets copied (table replaced: %v); want %d", g.next, m.table.Load() != old, 21*growStep)
	}
	// A janitor's pass ends it, and visits the new table after.
	visited := map[string]int{}
	m.DeleteMatching(func(id string, _ *entry) (bool, bool) {
		visited[id]++
		if id == "k10" || id == "during10" {
			delete(want, id)
			return true, false
		}
		return false, false
	})
	if m.growing != nil || m.table.Load() == old {
		t.Fatalf("a pass of DeleteMatching left the growth under way (%d of %d buckets)", g.next, len(old.buckets))
	}
	for id, en := range want {
		if visited[id] == 0 {
			t.Fatalf("the pass never saw %q (%p)", id, en)
		}
	}
	tbl := m.table.Load()
	if len(tbl.buckets) <= len(old.buckets) {
		t.Fatalf("%d buckets after the growth; want more than %d", len(tbl.buckets), len(old.buckets))
	}
	for id, en := range want {
		if got, ok := m.Load(id); !ok || got != en {
			t.Fatalf("Load(%q) = %p, %v; want %p", id, got, ok, en)
		}
	}
	seen, used := map[*entry]bool{}, 0
	for b := range tbl.buckets {
		bk := &tbl.buckets[b]
		meta := bk.meta.Load()
		for j := range bk.slots {
			if meta>>(8*j)&0xff != 0 {
				used++
			}
			if en := bk.slots[j].Load(); en != nil {
				if seen[en] {
					t.Fatalf("%q held twice", en.id())
				}
				seen[en] = true
				if want[en.id()] != en {
					t.Fatalf("the table holds %q (%p), which the map does not", en.id(), en)
				}
			}
		}
	}
	if len(seen) != len(want) || m.live != len(want) || m.used != used {
		t.Fatalf("table holds %d entries in %d used slots; map says %d live, %d used; want %d", len(seen), used, m.live, m.used, len(want))
	}
}

// fillToGrowth adds keys k0, k1, … with add until m's table of buckets
// buckets passes seven eighths and starts its growth, and returns that
// table.
func fillToGrowth(t *testing.T, m *entryMap, buckets int, add func(string)) *entryTable {
	t.Helper()
	for i := 0; ; i++ {
		add("k" + strconv.Itoa(i))
		if m.growing != nil && len(m.table.Load().buckets) == buckets {
			return m.table.Load()
		}
		settle(m) // the smaller tables' growths
		if len(m.table.Load().buckets) > buckets {
			t.Fatalf("the table grew past %d buckets", buckets)
		}
	}
}

// TestEntryMap_InsertsEndAGrowth: with nothing else running, the inserts
// after a growth began copy the old table in steps of growStep buckets,
// and it is replaced before they fill it past fifteen sixteenths (a probe
// must always end at an empty slot); on a table so small that they
// cannot, the insert that would is the one that ends the copy.
func TestEntryMap_InsertsEndAGrowth(t *testing.T) {
	for _, buckets := range []int{2, 8, 1024, 16384} {
		m := newEntryMap()
		n := 0
		add := func(id string) {
			if _, loaded := m.LoadOrCreate(id, 0, 0, false, false); loaded {
				t.Fatalf("%q was already there", id)
			}
			n++
		}
		old := fillToGrowth(t, m, buckets, add)
		inserts, mostUsed := 0, 0
		for ; m.table.Load() == old; inserts++ {
			mostUsed = max(mostUsed, m.used)
			add("new" + strconv.Itoa(inserts))
		}
		if 16*mostUsed > 15*bucketSlots*buckets {
			t.Fatalf("%d buckets: the old table held %d used slots of %d while it grew", buckets, mostUsed, bucketSlots*buckets)
		}
		if want := (buckets + growStep - 1) / growStep; buckets >= 1024 && inserts != want {
			t.Fatalf("%d buckets: the table was replaced after %d inserts; want %d", buckets, inserts, want)
		}
		if m.growing != nil || m.live != n || len(m.table.Load().buckets) <= buckets {
			t.Fatalf("%d buckets: after the growth: growing %v, %d live of %d, %d buckets", buckets, m.growing, m.live, n, len(m.table.Load().buckets))
		}
		for i := range inserts {
			if _, ok := m.Load("new" + strconv.Itoa(i)); !ok {
				t.Fatalf("%d buckets: new%d, stored during the growth, is gone", buckets, i)
			}
		}
	}
}

// TestEntryMap_ReadersNeverMissAStableKey runs lookups of keys that stay
// in the map throughout while writers insert and delete other keys, which
// makes the table grow, shrink and reuse deleted slots: no lookup of a
// stable key may fail, and no lookup may return another key's entry.
func TestEntryMap_ReadersNeverMissAStableKey(t *testing.T) {
	m := newEntryMap()
	stable := make([]string, 200)
	for i := range stable {
		stable[i] = "stable-" + strconv.Itoa(i)
		m.LoadOrCreate(stable[i], 0, 0, false, false)
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	for w := 0; w < 2; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for round := 0; round < 20; round++ {
				n := 500 * (round%5 + 1)
				for i := 0; i < n; i++ {
					id := "churn-" + strconv.Itoa(w) + "-" + strconv.Itoa(i)
					m.LoadOrCreate(id, 0, 0, false, false)
				}
				for i := 0; i < n; i++ {
					m.LoadAndDelete("churn-" + strconv.Itoa(w) + "-" + strconv.Itoa(i))
				}
			}
		}(w)
	}
	errs := make(chan string, 4)
	var readers sync.WaitGroup
	for r := 0; r < 2; r++ {
		readers.Add(1)
		go func(r int) {
			defer readers.Done()
			for i := r; !stop.Load(); i++ {
				id := stable[i%len(stable)]
				if en, ok := m.Load(id); !ok || en.id() != id {
					errs <- id
					return
				}
				m.Range(func(id string, en *entry) bool { return en.id() == id })
			}
		}(r)
	}
	wg.Wait()
	stop.Store(true)
	readers.Wait()
	close(errs)
	for id := range errs {
		t.Fatalf("a lookup of %q, stored all along, failed", id)
	}
	if m.live != len(stable) {
		t.Fatalf("live = %d, want %d", m.live, len(stable))
	}
}

// TestEntryMap_OneEntryPerKey races LoadOrCreate calls for the same keys:
// each key gets one entry, which every caller receives.
func TestEntryMap_OneEntryPerKey(t *testing.T) {
	m := newEntryMap()
	const keys, callers = 2000, 4
	got := make([][]*entry, callers)
	var wg sync.WaitGroup
	for c := 0; c < callers; c++ {
		got[c] = make([]*entry, keys)
		wg.Add(1)
		go func(c int) {
			defer wg.Done()
			for i := 0; i < keys; i++ {
				id := strconv.Itoa(i)
				got[c][i], _ = m.LoadOrCreate(id, 0, 0, false, false)
			}
		}(c)
	}
	wg.Wait()
	if m.live != keys {
		t.Fatalf("%d entries stored for %d keys", m.live, keys)
	}
	for i := 0; i < keys; i++ {
		for c := 1; c < callers; c++ {
			if got[c][i] != got[0][i] {
				t.Fatalf("key %d: callers got different entries", i)
			}
		}
	}
}

// TestEntryNamed compares named with == at every length it reads by
// words and around, with the identifiers equal and differing in each byte.
func TestEntryNamed(t *testing.T) {
	for n := 0; n <= 40; n++ {
		a := make([]byte, n)
		for i := range a {
			a[i] = byte('a' + i%26)
		}
		x, y := newEntry(string(a), 0, false), strings.Clone(string(a))
		if !x.named(y) {
			t.Fatalf("len %d: equal strings differ", n)
		}
		if n > 0 && x.named(y[:n-1]) {
			t.Fatalf("len %d: a prefix is the same", n)
		}
		for i := 0; i < n; i++ {
			b := []byte(y)
			b[i] ^= 0x20
			if x.named(string(b)) {
				t.Fatalf("len %d: strings differing in byte %d are the same", n, i)
			}
		}
	}
}

// TestEntryMap_LoadComparesEveryByte plants, for identifiers of every
// length a name can have, an entry named id where the probe for a name
// differing from id in one byte (or one byte shorter) looks first, with
// that name's tag: Load must compare the names and find nothing, and
// still find id itself. Load reads names of 9 to 32 bytes as words.
func TestEntryMap_LoadComparesEveryByte(t *testing.T) {
	for n := 1; n <= 65; n++ {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte('a' + i%26)
		}
		id := string(b)
		var others []string
		for i := range n {
			o := []byte(id)
			o[i] ^= 0x20
			others = append(others, string(o))
		}
		others = append(others, id[:n-1])
		for _, other := range others {
			m := newEntryMap()
			en, _ := m.LoadOrCreate(id, 0, 0, false, false)
			plant(m, m.seed.hash(other), en)
			if got, ok := m.Load(other); ok {
				t.Fatalf("len %d: Load(%q) found the entry of %q (%q)", n, other, id, got.id())
			}
			if got, ok := m.Load(id); !ok || got != en {
				t.Fatalf("len %d: Load(%q) = %p, %v; want %p", n, id, got, ok, en)
			}
		}
	}
}

// plant puts en in the first free slot of the bucket hash h looks in
// first, under h's tag, as if it hashed to h.
func plant(m *entryMap, h uint64, en *entry) {
	t := m.table.Load()
	bk := &t.buckets[h&t.mask]
	meta := bk.meta.Load()
	for i := range bucketSlots {
		if byte(meta>>(8*i)) == 0 {
			bk.slots[i].Store(en)
			bk.meta.Store(meta | tagOf(h)<<(8*i))
			return
		}
	}
	panic("plant: the bucket is full")
}

// TestIDSeedHash_EveryByteCounts checks that the hash depends on every
// byte and on the length, and that two seeds hash differently.
func TestIDSeedHash_EveryByteCounts(t *testing.T) {
	k, k2 := newIDSeed(), newIDSeed()
	for n := 0; n <= 200; n++ {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(i * 7)
		}
		h := k.hash(string(b))
		if n > 0 && k2.hash(string(b)) == h {
			t.Fatalf("len %d: two seeds, one hash", n)
		}
		if n > 0 && k.hash(string(b[:n-1])) == h {
			t.Fatalf("len %d: a prefix hashes the same", n)
		}
		for i := 0; i < n; i++ {
			b[i] ^= 1
			if k.hash(string(b)) == h {
				t.Fatalf("len %d: flipping byte %d leaves the hash", n, i)
			}
			b[i] ^= 1
		}
	}
}

// TestIDSeedHash_Spreads hashes identifiers as clients send them (short
// counters, addresses, long keys) into 16,384 buckets: no bucket may get
// far more than its share, or probes would grow long.
func TestIDSeedHash_Spreads(t *testing.T) {
	k := newIDSeed()
	for _, form := range []func(i int) string{
		func(i int) string { return "k" + strconv.Itoa(i) },
		func(i int) string {
			return "10." + strconv.Itoa(i>>16) + "." + strconv.Itoa(i>>8&255) + "." + strconv.Itoa(i&255)
		},
		func(i int) string { return "sk_live_0123456789abcdef0123456789abcdef" + strconv.Itoa(i) },
	} {
		const n, buckets = 100_000, 16_384
		var count [buckets]int
		seen := make(map[uint64]bool, n)
		for i := 0; i < n; i++ {
			h := k.hash(form(i))
			seen[h] = true
			count[h&(buckets-1)]++
		}
		if len(seen) != n {
			t.Fatalf("%q…: %d distinct hashes for %d identifiers", form(0), len(seen), n)
		}
		most := 0
		for _, c := range count {
			most = max(most, c)
		}
		// About 6 a bucket on average; a uniform hash puts more than 30 in one once in millions of runs.
		if most > 30 {
			t.Fatalf("%q…: a bucket got %d of %d identifiers", form(0), most, n)
		}
		// The tag bits (the top 7) spread too.
		var tags [128]int
		for i := 0; i < n; i++ {
			tags[k.hash(form(i))>>57]++
		}
		for tag, c := range tags {
			if c < n/128/2 || c > n/128*2 {
				t.Fatalf("%q…: tag %d got %d of %d identifiers", form(0), tag, c, n)
			}
		}
	}
}

// settle ends m's growth under way, if any, as a pass of the janitor
// would.
func settle(m *entryMap) {
	m.mu.Lock()
	if g := m.growing; g != nil {
		m.copyOld(g, len(m.table.Load().buckets))
	}
	m.mu.Unlock()
}
