package engine

import (
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

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
