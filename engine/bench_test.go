package engine

import (
	"context"
	"math/rand/v2"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"
)

// The hot path through the public API, map lookup included, on a warm key.
// The "RealClock" variants read time.Now like production does.

func benchDecide(b *testing.B, cfg Config, limit int64, warm int) {
	e, _ := newTestEngine(b, cfg)
	l := lim("api-key-0123456789", time.Hour, limit, 1)
	l.Zone = e.Zone(l.Namespace, l.Window)
	for i := 0; i < warm; i++ {
		e.Decide(bg, l)
	}
	allowed := e.Decide(bg, l).Allowed
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		e.Decide(bg, l)
	}
	b.StopTimer()
	if got := e.Decide(bg, l).Allowed; got != allowed {
		b.Fatalf("verdict changed during the benchmark: %v then %v", allowed, got)
	}
}

func BenchmarkDecideAllow(b *testing.B) { benchDecide(b, Config{}, 1<<62, 1) }
func BenchmarkDecideDeny(b *testing.B)  { benchDecide(b, Config{}, 10, 10) }
func BenchmarkDecideAllowRealClock(b *testing.B) {
	benchDecide(b, Config{Now: time.Now}, 1<<62, 1)
}
func BenchmarkDecideDenyRealClock(b *testing.B) {
	benchDecide(b, Config{Now: time.Now}, 10, 10)
}

func BenchmarkDecideManyAllow2(b *testing.B) {
	e, _ := newTestEngine(b, Config{})
	ls := []Limit{lim("k", time.Hour, 1<<62, 1), {Key: Key{"ip", "10.0.0.0", time.Minute}, Limit: 1 << 62, Cost: 1}}
	for i := range ls {
		ls[i].Zone = e.Zone(ls[i].Namespace, ls[i].Window)
	}
	out := make([]Decision, 2)
	e.DecideMany(bg, ls, out)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		e.DecideMany(bg, ls, out)
	}
}

// BenchmarkDecideParallel spreads allows over 1,000 keys from every
// processor; compare -cpu 1 and -cpu 2 for the scaling.
func BenchmarkDecideParallel(b *testing.B) {
	e, _ := newTestEngine(b, Config{Now: time.Now})
	ls := make([]Limit, 1000)
	for i := range ls {
		ls[i] = lim("key-"+strconv.Itoa(i), time.Hour, 1<<62, 1)
		ls[i].Zone = e.Zone(ls[i].Namespace, ls[i].Window)
		e.Decide(bg, ls[i])
	}
	var seed atomic.Uint64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		i := seed.Add(7919)
		for pb.Next() {
			i++
			e.Decide(bg, ls[i%1000])
		}
	})
}

// BenchmarkDecide100kKeys cycles allows through 100,000 warm keys of one
// zone (the load harness's keys100k row in process): what a large key set
// adds to a decision is reaching an entry and its cell that are not in
// the CPU's caches.
func BenchmarkDecide100kKeys(b *testing.B) { benchDecide100kKeys(b, false) }

// BenchmarkDecide100kKeysShuffled decides the same keys in an order
// unrelated to the one they were made in, as a gateway's traffic meets
// them: each decision's memory is wherever its key was allocated, not next
// to the last one's, and the processor's prefetching cannot hide its misses.
func BenchmarkDecide100kKeysShuffled(b *testing.B) { benchDecide100kKeys(b, true) }

func benchDecide100kKeys(b *testing.B, shuffled bool) {
	const n = 100_000
	e, _ := newTestEngine(b, Config{})
	z := e.Zone("lt_keys", time.Hour)
	ls := make([]Limit, n)
	for i := range ls {
		ls[i] = lim("k"+strconv.Itoa(i), time.Hour, 1_000_000_000, 1)
		ls[i].Zone = z
		e.Decide(bg, ls[i])
	}
	if shuffled {
		r := rand.New(rand.NewPCG(1, 2))
		r.Shuffle(n, func(i, j int) { ls[i], ls[j] = ls[j], ls[i] })
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		e.Decide(bg, ls[i])
		if i++; i == n {
			i = 0
		}
	}
}

// BenchmarkDecideNewKeys decides a new key every time, from every
// processor (a flood of one-off identifiers, as limits per address see):
// what making an entry costs, its insert into the zone's map included.
// The janitor is left out (keys accumulate).
func BenchmarkDecideNewKeys(b *testing.B) {
	e, _ := newTestEngine(b, Config{MaxEntries: 1 << 30, Manual: true})
	z := e.Zone("ip", time.Minute)
	var seed atomic.Int64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		base := seed.Add(1) << 40
		l := lim("", time.Minute, 100, 1)
		l.Zone = z
		var buf [24]byte
		for i := base; pb.Next(); i++ {
			l.Identifier = string(strconv.AppendInt(buf[:0], i, 36))
			e.Decide(bg, l)
		}
	})
}

// BenchmarkMemoryPerEntry inserts a million distinct identifiers into a
// local-only engine (plain cells, 24 bytes each) and reports the live heap
// per entry, key included, then checks that the janitor frees them two
// windows after the traffic stops.
func BenchmarkMemoryPerEntry(b *testing.B) {
	const n = 1_000_000
	for i := 0; i < b.N; i++ {
		e, clk := newTestEngine(b, Config{MaxEntries: 2 * n})
		ids := make([]string, n)
		for j := range ids {
			ids[j] = "user-" + strconv.Itoa(10_000_000+j)
		}
		before := liveHeap()
		for j := range ids {
			e.Decide(bg, lim(ids[j], time.Minute, 100, 1))
		}
		after := liveHeap()
		idBytes := uint64(0)
		for j := range ids {
			idBytes += uint64(len(ids[j]))
		}
		b.ReportMetric(float64(after-before)/n, "heap-B/entry")
		b.ReportMetric(float64(after-before+idBytes)/n, "heap+ids-B/entry")
		if got := e.Stats().Entries; got != n {
			b.Fatalf("live entries = %d, want %d", got, n)
		}
		// The next window: every key now holds a current and a previous cell.
		clk.Advance(time.Minute)
		for j := range ids {
			e.Decide(bg, lim(ids[j], time.Minute, 100, 1))
		}
		after2 := liveHeap()
		b.ReportMetric(float64(after2-before+idBytes)/n, "2cells-heap+ids-B/entry")
		clk.Advance(2 * time.Minute)
		if dropped := e.Sweep(); dropped != n {
			b.Fatalf("janitor dropped %d entries two windows later, want %d", dropped, n)
		}
		runtime.KeepAlive(ids)
	}
}

// BenchmarkMemoryAfterFlood is the slabs' trade-off (see slab.go): a
// flood of 100,000 one-off keys with one key in a hundred that stays busy,
// then the janitor drops the one-off keys. A slot is never used again, so
// each key that stays keeps its slab: it reports the heap that the keys
// left behind hold, per key that stays, against the heap per key of the
// flood.
func BenchmarkMemoryAfterFlood(b *testing.B) {
	const n, every = 100_000, 100
	for b.Loop() {
		e, clk := newTestEngine(b, manual(Config{MaxEntries: 2 * n}))
		z := e.Zone("ip", time.Minute)
		decide := func(j int) {
			l := lim("10.0."+strconv.Itoa(j>>8)+"."+strconv.Itoa(j&255), time.Minute, 1<<40, 1)
			l.Zone = z
			e.Decide(bg, l)
		}
		before := liveHeap()
		for j := range n {
			decide(j)
		}
		flood := liveHeap()
		// The keys that stay are busy in every window; the others never
		// come back.
		for range 3 {
			clk.Advance(time.Minute)
			for j := 0; j < n; j += every {
				decide(j)
			}
		}
		if dropped := e.Sweep(); dropped != n-n/every {
			b.Fatalf("the janitor dropped %d keys, want %d", dropped, n-n/every)
		}
		left := liveHeap()
		b.ReportMetric(float64(flood-before)/n, "flood-B/key")
		b.ReportMetric(float64(left-before)/(n/every), "left-B/staying-key")
		runtime.KeepAlive(e)
	}
}

func liveHeap() uint64 {
	var m runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// BenchmarkGCWith100kKeys measures what 100,000 live keys (two cells each)
// cost the garbage collector: the time of one full collection with them in
// the heap. Compare it with and without pointer-bearing engine storage.
func BenchmarkGCWith100kKeys(b *testing.B) {
	const n = 100_000
	e, clk := newTestEngine(b, Config{})
	ls := make([]Limit, n)
	for i := range ls {
		ls[i] = lim("user-"+strconv.Itoa(10_000_000+i), time.Minute, 100, 1)
		e.Decide(bg, ls[i])
	}
	clk.Advance(time.Minute)
	for i := range ls {
		e.Decide(bg, ls[i])
	}
	ls = nil // only the engine's storage stays live
	runtime.GC()
	b.ResetTimer()
	for b.Loop() {
		runtime.GC()
	}
	b.StopTimer()
	if got := e.Stats().Entries; got != n {
		b.Fatalf("live entries = %d, want %d", got, n)
	}
}

// BenchmarkMemory100kKeys is the load harness's keys100k row in process: a
// local-only engine, one zone of a one-hour window, 100,000 identifiers
// ("k0" … "k99999", each its own string, as a request's header value is)
// decided once each. It reports the heap in use and the heap objects per
// key after a collection, identifiers included (the engine's map holds
// them), so the cost of a key can be measured before and after a change.
// The harness's RSS per key is about twice the heap per key (the
// collector lets the heap grow to twice what is live).
func BenchmarkMemory100kKeys(b *testing.B) { benchMemory100kKeys(b, false) }

// benchMemory100kKeys decides 100,000 new keys in one zone and reports
// their heap per key; linked, through an origin that keeps nothing, with
// every key's units replayed once.
func benchMemory100kKeys(b *testing.B, linked bool) {
	const n = 100_000
	for b.Loop() {
		e, _ := newTestEngine(b, manual(Config{}))
		if linked {
			e.SetOrigin(emptyOrigin{})
		}
		z := e.Zone("lt_keys", time.Hour)
		before := memStats()
		for j := 0; j < n; j++ {
			l := lim("k"+strconv.Itoa(j), time.Hour, 1_000_000_000, 1)
			l.Zone = z
			e.Decide(bg, l)
			if linked && (j%4096 == 4095 || j == n-1) { // within the replay queue's room
				if _, err := e.ReplayOnce(bg, Fast); err != nil {
					b.Fatal(err)
				}
			}
		}
		after := memStats()
		if got := e.Stats().Entries; got != n {
			b.Fatalf("live entries = %d, want %d", got, n)
		}
		if p := e.Stats().PendingCells; p != 0 {
			b.Fatalf("%d cells still pending", p)
		}
		b.ReportMetric(float64(after.HeapInuse-before.HeapInuse)/n, "heap-inuse-B/key")
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/n, "heap-alloc-B/key")
		b.ReportMetric(float64(after.HeapObjects-before.HeapObjects)/n, "objects/key")
		runtime.KeepAlive(e)
	}
}

// memStats returns the memory statistics after two full collections.
func memStats() runtime.MemStats {
	var m runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&m)
	return m
}

// emptyOrigin answers every call with empty totals and keeps nothing, so
// that a benchmark's heap is the engine's alone.
type emptyOrigin struct{}

func (emptyOrigin) Read(context.Context, Key, int64, uint32) (Totals, error) { return Totals{}, nil }
func (emptyOrigin) Flush(_ context.Context, batch []Delta) error {
	for i := range batch {
		batch[i].Totals = Totals{Cur: batch[i].Own, Mine: batch[i].Own}
		batch[i].Done = true
	}
	return nil
}
func (emptyOrigin) Reserve(context.Context, *Reservation) error { return nil }

// BenchmarkMemory100kKeysLinked is BenchmarkMemory100kKeys with an origin
// (the redis_keys100k row): linked cells, each key's units replayed once.
func BenchmarkMemory100kKeysLinked(b *testing.B) { benchMemory100kKeys(b, true) }

// BenchmarkNewKeyDuringSweep decides new keys while the janitor passes
// over 500,000 others, and reports the longest a new key's decision took
// (worst-µs: it waits for the map's lock to insert) and the pass's length
// (sweep-µs).
func BenchmarkNewKeyDuringSweep(b *testing.B) {
	e, _ := newTestEngine(b, manual(Config{}))
	z := e.Zone("zone", time.Hour)
	for i := range 500_000 {
		l := lim("k"+strconv.Itoa(i), time.Hour, 1<<40, 1)
		l.Zone = z
		e.Decide(bg, l)
	}
	var worst, sweeps time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		var done atomic.Bool
		var took time.Duration
		go func() {
			t0 := time.Now()
			e.Sweep()
			took = time.Since(t0)
			done.Store(true)
		}()
		for n := 0; !done.Load(); n++ {
			l := lim("new-"+strconv.Itoa(i)+"-"+strconv.Itoa(n), time.Hour, 1<<40, 1)
			l.Zone = z
			t0 := time.Now()
			e.Decide(bg, l)
			worst = max(worst, time.Since(t0))
		}
		sweeps += took
	}
	b.ReportMetric(float64(worst.Microseconds()), "worst-µs")
	b.ReportMetric(float64(sweeps.Microseconds())/float64(b.N), "sweep-µs")
}

// BenchmarkNewKeysWorst decides 500,000 new keys in one zone, arriving
// at 200,000 a second (more than one core of Caddy serves), and reports
// the longest decision (worst-µs): the table grows eight times on the way.
// late-µs is the most a decision ended after its key arrived: on one core
// (-cpu 1, as a Caddy pinned to one), work off the request path that keeps
// the core (a table's copy did, before it went in steps; the garbage
// collector's marking does) delays the decisions behind it without being
// inside any.
func BenchmarkNewKeysWorst(b *testing.B) {
	const keys, every = 500_000, 5 * time.Microsecond
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		e, _ := newTestEngine(b, manual(Config{}))
		z := e.Zone("zone", time.Hour)
		ls := make([]Limit, keys)
		for k := range ls {
			ls[k] = lim("k"+strconv.Itoa(k), time.Hour, 1<<40, 1)
			ls[k].Zone = z
		}
		b.StartTimer()
		var worst, late time.Duration
		start := time.Now()
		for k := range ls {
			arrival := start.Add(time.Duration(k) * every)
			for time.Now().Before(arrival) {
			}
			t0 := time.Now()
			e.Decide(bg, ls[k])
			worst = max(worst, time.Since(t0))
			late = max(late, time.Since(arrival))
		}
		b.ReportMetric(float64(worst.Microseconds()), "worst-µs")
		b.ReportMetric(float64(late.Microseconds()), "late-µs")
	}
}
