package engine

import (
	"math/rand/v2"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// raceStressTime is how long each of the stress tests below runs.
const raceStressTime = 2 * time.Second

// These tests are for the race detector as much as for their assertions:
// 64 goroutines on the paths that rotate, evict, reserve and mark strict.

func TestRace_RotationNeverAdmitsMoreThanTheLimitPerCell(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	const limit = 50
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for g := 0; g < 64; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 1000; i++ {
				if g == 0 && i%10 == 0 {
					clk.Advance(time.Duration(100) * time.Millisecond) // ten windows of one second in all
				}
				if e.Decide(bg, lim("k", time.Second, limit, 1)).Allowed {
					admitted.Add(1)
				}
			}
		}(g)
	}
	wg.Wait()
	if admitted.Load() == 0 || admitted.Load() > 11*limit {
		t.Fatalf("admitted %d over 11 windows of limit %d", admitted.Load(), limit)
	}
	en, _ := e.Zone("zone", time.Second).entries.Load("k")
	c := en.cur.Load()
	for _, x := range []*cell{c, en.previous(c)} {
		if x != nil && x.committed() > limit {
			t.Fatalf("cell %d committed %d over the limit %d", x.seq(), x.committed(), limit)
		}
	}
}

func TestRace_EvictionAndSweepUnderLoad(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{MaxEntries: 500}))
	var wg sync.WaitGroup
	for g := 0; g < 64; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			out := make([]Decision, 2)
			for i := 0; i < 300; i++ {
				id := strconv.Itoa(g*1000 + i%40)
				e.DecideMany(bg, []Limit{lim(id, time.Second, 5, 1), {Key: Key{"other", id, time.Minute}, Limit: 3, Cost: 1}}, out)
				if i%50 == 0 {
					e.Evict()
					e.Sweep()
					clk.Advance(time.Duration(7) * time.Millisecond)
				}
			}
		}(g)
	}
	wg.Wait()
	e.Sweep()
	var n int64
	e.rangeZones(func(z *Zone) bool {
		z.entries.Range(func(string, *entry) bool { n++; return true })
		return true
	})
	if live := e.Stats().Entries; live != n {
		t.Fatalf("live counter %d disagrees with %d entries in the maps", live, n)
	}
}

func TestRace_StrictAndBatchesWithOrigin(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	var wg sync.WaitGroup
	for g := 0; g < 64; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			out := make([]Decision, 2)
			for i := 0; i < 200; i++ {
				ls := []Limit{lim("k", time.Second, 100, 1), {Key: Key{"b", strconv.Itoa(g % 4), time.Second}, Limit: 30, Cost: 1}}
				e.DecideMany(bg, ls, out)
				switch i % 40 {
				case 0:
					e.ReplayOnce(bg, Fast)
				case 20:
					e.ReplayOnce(bg, Slow)
					clk.Advance(time.Duration(13) * time.Millisecond)
				}
				if g == 0 && i%50 == 0 {
					e.StrictKeys()
					e.Stats()
				}
			}
		}(g)
	}
	wg.Wait()
	e.ReplayOnce(bg, Fast)
	e.ReplayOnce(bg, Slow)
	// Everything committed locally reached the origin exactly once.
	e.rangeZones(func(z *Zone) bool {
		z.entries.Range(func(id string, en *entry) bool {
			c := en.cur.Load()
			for _, c := range []*cell{c, en.previous(c)} {
				if c == nil || c == tombstone {
					continue
				}
				x := c.links()
				if x == nil {
					t.Errorf("%s/%s cell %d is plain in an engine with an origin", z.name, id, c.seq())
					continue
				}
				if c.spec.Load() != 0 || x.pending.Load() != 0 {
					t.Errorf("%s/%s cell %d: spec %d pending %d left", z.name, id, c.seq(), c.spec.Load(), x.pending.Load())
				}
				if got := o.total(z.key(id), c.seq()); got != x.own.Load() {
					t.Errorf("%s/%s cell %d: origin %d, own %d", z.name, id, c.seq(), got, x.own.Load())
				}
			}
			return true
		})
		return true
	})
}

func TestRace_OriginAttachedUnderLoad(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	o := newMemOrigin()
	const workers, keys = 32, 4
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for g := 0; g < workers; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			out := make([]Decision, 2)
			for i := 0; i < 400; i++ {
				if g == 0 && i == 100 {
					e.SetOrigin(o) // plain cells are upgraded under the others' feet
				}
				id := strconv.Itoa((g + i) % keys)
				if i%3 == 0 {
					if e.DecideMany(bg, []Limit{lim(id, time.Hour, 1<<40, 1), lim("all", time.Hour, 1<<40, 1)}, out) {
						admitted.Add(2)
					}
				} else if e.Decide(bg, lim(id, time.Hour, 1<<40, 1)).Allowed {
					admitted.Add(1)
				}
			}
		}(g)
	}
	wg.Wait()
	if err := e.Flush(bg); err != nil {
		t.Fatal(err)
	}
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	var counted int64
	for _, id := range []string{"0", "1", "2", "3", "all"} {
		key := Key{"zone", id, time.Hour}
		c := entryOf(t, e, key).cur.Load()
		if c.links() == nil {
			t.Fatalf("%s: still a plain cell after decisions with an origin", id)
		}
		// Every unit the cell holds reached the origin exactly once.
		if got, n := o.total(key, seq), c.committed(); got != n || c.links().own.Load() != n {
			t.Errorf("%s: origin %d, own %d, count %d", id, got, c.links().own.Load(), n)
		}
		counted += c.committed()
	}
	// A request that located a plain cell before the origin was set may
	// charge it after its upgrade: at most one unit per worker and key.
	if lost := admitted.Load() - counted; lost < 0 || lost > workers*5 {
		t.Fatalf("admitted %d, counted %d", admitted.Load(), counted)
	}
}

// forgetStress runs rounds of one hot key each (an hour's window on a
// clock that stands still, so a round's sliding-window count is what it
// admitted), decided by deciders goroutines on each of procs engines
// (each its own process on one store, its writes taking flushDelay, a
// round trip), while an operator goroutine runs ops at random on the first
// engine. It returns how many rounds ran and the admissions of each past
// limit.
func forgetStress(t *testing.T, procs, deciders int, limit int64, flushDelay time.Duration, ops []stressOp) (rounds int, over []int64) {
	t.Helper()
	return forgetStressCapped(t, procs, deciders, limit, flushDelay, ops, 0)
}

// forgetStressCapped is forgetStress on engines that hold at most
// maxEntries keys (0: the default).
func forgetStressCapped(t *testing.T, procs, deciders int, limit int64, flushDelay time.Duration, ops []stressOp, maxEntries int) (rounds int, over []int64) {
	t.Helper()
	clk := testclock.New(time.UnixMilli(epoch))
	store := newMemOrigin()
	es := make([]*Engine, procs)
	os := make([]*memOrigin, procs)
	for i := range es {
		es[i], _ = newTestEngine(t, Config{Now: clk.Now, FastTick: time.Millisecond, SlowTick: 3 * time.Millisecond, ReadTimeout: time.Second, JanitorInterval: time.Hour, MaxEntries: maxEntries})
		os[i] = store.peer("p" + strconv.Itoa(i))
		os[i].flushDelay.Store(int64(flushDelay))
		es[i].SetOrigin(os[i])
		es[i].SetProcesses(int64(procs)) // as the origin's record of them tells Caddy
	}
	end := time.Now().Add(raceStressTime)
	for round := 0; time.Now().Before(end); round++ {
		l := lim("k"+strconv.Itoa(round), time.Hour, limit, 1)
		var admitted atomic.Int64
		var wg sync.WaitGroup
		for _, e := range es {
			for range deciders {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for range 3 * limit {
						if e.Decide(bg, l).Allowed {
							admitted.Add(1)
						}
						runtime.Gosched()
					}
				}()
			}
		}
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		r := rand.New(rand.NewPCG(uint64(round), 7))
	operate:
		for {
			select {
			case <-done:
				break operate
			default:
			}
			ops[r.IntN(len(ops))](es[0], os[0], l)
			for range r.IntN(20) {
				runtime.Gosched()
			}
		}
		rounds++
		if a := admitted.Load(); a > limit {
			over = append(over, a-limit)
		}
	}
	return rounds, over
}

// stressOp is an operator's operation for forgetStress, on the engine e
// whose origin is o, during a round whose key is l's.
type stressOp func(e *Engine, o *memOrigin, l Limit)

var (
	opForget stressOp = func(e *Engine, _ *memOrigin, l Limit) { e.Forget(l.Key) }
	// A region's reset of the window before: the current window's units
	// are written, as a forget writes them.
	opDropBefore stressOp = func(e *Engine, _ *memOrigin, l Limit) {
		e.DropMatching(l.Namespace, l.Window, func(id string) bool { return id == l.Identifier }, e.nowMs()-l.Window.Milliseconds())
	}
	opSweep stressOp = func(e *Engine, _ *memOrigin, _ Limit) { e.Sweep() }
	// A new key past the cap, and the janitor's eviction (the insert
	// signals the janitor too): the round's key, lighter than the last
	// round's, goes first.
	opEvict stressOp = func(e *Engine, _ *memOrigin, l Limit) {
		e.Decide(bg, lim("filler"+strconv.FormatInt(fillers.Add(1), 10), l.Window, l.Limit, 1))
		e.Evict()
	}
	fillers  atomic.Int64
	opReload stressOp = func(e *Engine, o *memOrigin, _ Limit) {
		n := o.peer(o.node) // a new connection of the same process
		n.flushDelay.Store(o.flushDelay.Load())
		e.SetOrigin(n)
	}
)

// A lone process (its origin shared with nobody) that forgets, resets,
// sweeps and reloads a key while 6 goroutines decide it must admit no more
// than the limit: a forget writes the key's units before the key's next
// read. Before the fix, with a write of 100 µs, 37 of 1,069 rounds
// admitted past the limit of 50, by up to 38 (the units of the requests
// that came during the forget's write, and of those that waited for a
// read meanwhile). What remains is a request preempted between its
// snapshot and its charge for as long as a forget and the next read take:
// a unit per such goroutine, a few rounds in a thousand here (under the
// race detector in CI, 1 round of 259 by 4).
func TestRace_ALoneProcessForgettingAKeyItDecidesStaysWithinTheLimit(t *testing.T) {
	const limit, deciders = 50, 6
	rounds, over := forgetStress(t, 1, deciders, limit, 100*time.Microsecond, []stressOp{opForget, opDropBefore, opSweep, opReload})
	stressVerdict(t, rounds, over, limit, deciders, 50)
}

// stressVerdict fails when a round of a stress test admitted more than
// worst past the limit, or when more than one round in every rounds
// went past it at all (0: any share).
func stressVerdict(t *testing.T, rounds int, over []int64, limit, worst int64, every int) {
	t.Helper()
	most := int64(0)
	for _, n := range over {
		most = max(most, n)
	}
	t.Logf("%d rounds, %d past the limit of %d by %v", rounds, len(over), limit, over)
	if most > worst || (every > 0 && len(over)*every > rounds) {
		t.Fatalf("%d of %d rounds admitted past the limit of %d, by %v", len(over), rounds, limit, over)
	}
}

// A lone process holding at most 2 keys, which evicts the key 6 goroutines
// decide, must admit no more than the limit: an eviction writes the key's
// units before the key's next read, as a forget does. Before, with a
// write of 100 µs, an evicted key's units were queued for the replay and
// reached the origin after its next entry had read it: 1,548 of 1,948
// rounds admitted past the limit of 50, by up to 80. What remains is the
// forget's gap: a request that located the entry before its eviction and
// is preempted before its charge, a unit per such goroutine (0 to 6 rounds
// in 800 past the limit, by up to 3: the key is evicted at every
// operation here, far more often than the forget test lets it go); and,
// under the race detector, up to 5 % of rounds by up to 5, the requests
// waiting for a read whose key was evicted under them more than
// maxRelocations times, which then decide in the cell let go (with
// relocations unbounded, 0 or 1 round in 100 by 1).
func TestRace_ALoneProcessEvictingAKeyItDecidesStaysWithinTheLimit(t *testing.T) {
	const limit, deciders = 50, 6
	rounds, over := forgetStressCapped(t, 1, deciders, limit, 100*time.Microsecond, []stressOp{opEvict}, 2)
	stressVerdict(t, rounds, over, limit, deciders, 10)
}

// Three processes deciding a key in a burst while one of them forgets,
// resets, sweeps and reloads it stay within the slack the key has without
// them: what the others admitted that a process could not see yet. Without
// the operator, 11 of 1,969 rounds went past the limit of 50, by at most
// 4; with it, 18 of 1,666, by at most 4.
func TestRace_ProcessesForgettingAKeyTheyShareStayWithinTheSlack(t *testing.T) {
	const limit = 50
	rounds, over := forgetStress(t, 3, 3, limit, 100*time.Microsecond, []stressOp{opForget, opDropBefore, opSweep, opReload})
	stressVerdict(t, rounds, over, limit, limit/5, 0)
}
