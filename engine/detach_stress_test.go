package engine

import (
	"context"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// originSum is every unit the origin holds, all cells together.
func originSum(o *memOrigin) int64 {
	o.mu.Lock()
	defer o.mu.Unlock()
	var s int64
	for _, v := range o.totals {
		s += v
	}
	return s
}

// TestReplay_AnOriginLetGoMidTickStrandsNoCell: reloads take Redis out and
// put it back while requests are decided and the replay loop runs. A fast
// tick's batch taken while the origin was there, and handed to a worker
// that found none, was neither written nor given back: its cells stayed
// "flushing" for good, and every unit they took after that was never
// replayed (before the fix: 80 cells stranded, the origin short of most
// units, in every run). Every admitted unit must reach the origin once it
// is back for good, and no cell may stay flushing. The limits are far
// above the load, so no reservation runs (those are tested apart).
func TestReplay_AnOriginLetGoMidTickStrandsNoCell(t *testing.T) {
	e := New(Config{FastTick: time.Millisecond, SlowTick: 3 * time.Millisecond, ReadTimeout: time.Second})
	o := newMemOrigin()
	e.SetOrigin(o)
	var admitted atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 1))
			for {
				select {
				case <-stop:
					return
				default:
				}
				cost := 1 + r.Int64N(4)
				if e.Decide(bg, lim("k"+strconv.Itoa(r.IntN(40)), time.Hour, 1<<40, cost)).Allowed {
					admitted.Add(cost)
				}
			}
		}()
	}
	wg.Add(1)
	go func() { // the reloads
		defer wg.Done()
		r := rand.New(rand.NewPCG(99, 1))
		for {
			select {
			case <-stop:
				return
			default:
			}
			e.SetOrigin(nil)
			time.Sleep(time.Duration(r.IntN(2000)) * time.Microsecond) // the scenario's pace, not a wait
			e.SetOrigin(o)
			time.Sleep(time.Duration(r.IntN(300)) * time.Microsecond)
		}
	}()
	time.Sleep(1500 * time.Millisecond) // the scenario's length
	close(stop)
	wg.Wait()
	e.SetOrigin(o)
	ctx, cancel := context.WithTimeout(bg, 10*time.Second)
	defer cancel()
	if err := e.Close(ctx); err != nil {
		t.Fatalf("close: %v", err)
	}
	stuck := 0
	e.rangeZones(func(z *Zone) bool {
		z.entries.Range(func(_ string, en *entry) bool {
			for _, c := range [2]*cell{en.cur.Load(), en.prev.Load()} {
				if c != nil && c != tombstone && c.state()&stFlushing != 0 {
					stuck++
				}
			}
			return true
		})
		return true
	})
	if got, want := originSum(o), admitted.Load(); got != want || stuck != 0 {
		t.Fatalf("the origin holds %d units of the %d admitted; %d cells stuck flushing", got, want, stuck)
	}
}
