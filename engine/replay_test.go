package engine

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

func TestReplay_FullFastQueueFallsBackToTheSlowOne(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	e.queueLen = 2
	o := newMemOrigin()
	e.SetOrigin(o)
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	// Three keys at half their limit want the fast queue, which holds two.
	for _, id := range []string{"a", "b", "c"} {
		l := lim(id, time.Minute, 2, 1)
		if !e.Decide(bg, l).Allowed {
			t.Fatal("denied below the limit")
		}
	}
	for _, tier := range []Tier{Fast, Slow} {
		if _, err := e.ReplayOnce(bg, tier); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"a", "b", "c"} {
		if got := o.total(Key{"zone", id, time.Minute}, seq); got != 1 {
			t.Fatalf("origin total of %s = %d, want 1: its unit was stranded", id, got)
		}
	}
}

func TestQueue_HoldsWhatItsCapacityAllowsInOrder(t *testing.T) {
	q := newQueue(2)
	z := &Zone{}
	a, b := newCell(1, true), newCell(2, true)
	if !q.push(z, newEntry("a", 0, true), a) || !q.push(z, newEntry("b", 0, true), b) {
		t.Fatal("a queue of 2 refused a cell")
	}
	if q.push(z, newEntry("c", 0, true), newCell(3, true)) {
		t.Fatal("a full queue took a third cell")
	}
	if q.len() != 2 {
		t.Fatalf("len %d, want 2", q.len())
	}
	for _, want := range []*cell{a, b} {
		if d, ok := q.pop(); !ok || d.cell != want {
			t.Fatalf("pop = %v, %v; want the cells in the order pushed", d, ok)
		}
	}
	if _, ok := q.pop(); ok || q.len() != 0 {
		t.Fatal("an empty queue popped a cell")
	}
}

// tierOrigin is a memOrigin that counts the slow tier's flushes in flight
// and, while slowGate is set, holds them until it is closed.
type tierOrigin struct {
	*memOrigin
	mu             sync.Mutex
	inSlow, most   int
	slowGate       chan struct{}
	slowed, fasted atomic.Int64
}

func (o *tierOrigin) Flush(ctx context.Context, batch []Delta) error {
	if len(batch) > 0 && batch[0].fast {
		o.fasted.Add(1)
		return o.memOrigin.Flush(ctx, batch)
	}
	o.mu.Lock()
	o.inSlow++
	o.most = max(o.most, o.inSlow)
	gate := o.slowGate
	o.mu.Unlock()
	o.slowed.Add(1)
	if gate != nil {
		<-gate
	}
	defer func() {
		o.mu.Lock()
		o.inSlow--
		o.mu.Unlock()
	}()
	return o.memOrigin.Flush(ctx, batch)
}

// TestReplay_SlowTierFlushesOneBatchAtATime: the replay loop sends the slow
// tier's batches one after another, so a tick's worth of keys below half
// their limit never holds the origin with many pipelines at once, and a
// key near its limit (the fast tier) is flushed on its own tick while a
// slow flush is still in flight.
func TestReplay_SlowTierFlushesOneBatchAtATime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, clk := newTestEngine(t, Config{})
		o := &tierOrigin{memOrigin: newMemOrigin()}
		e.SetOrigin(o)
		seq := clk.UnixMilli() / time.Hour.Milliseconds()
		const keys = 6 * replayBatch
		decideAll := func() {
			for i := range keys {
				if !e.Decide(bg, lim("k"+strconv.Itoa(i), time.Hour, 1_000_000, 1)).Allowed {
					t.Fatal("denied far below the limit")
				}
			}
		}
		// Each key's first replay (it decided without a read) goes out on
		// the fast tick; after it, the keys are the slow tier's.
		decideAll()
		time.Sleep(time.Second)
		synctest.Wait()
		gate := make(chan struct{})
		o.mu.Lock()
		o.slowGate, o.most = gate, 0
		o.mu.Unlock()
		decideAll()
		time.Sleep(DefaultSlowTick + time.Millisecond)
		synctest.Wait()
		if o.mu.Lock(); o.inSlow != 1 || o.most != 1 {
			t.Fatalf("%d slow flushes in flight (at most %d), want 1", o.inSlow, o.most)
		}
		o.mu.Unlock()
		// A key at half its limit replays on the fast tick meanwhile.
		hot := lim("hot", time.Hour, 2, 1)
		fasted := o.fasted.Load()
		if !e.Decide(bg, hot).Allowed {
			t.Fatal("denied below the limit")
		}
		time.Sleep(2 * DefaultFastTick)
		synctest.Wait()
		if got := o.total(hot.Key, seq); got != 1 || o.fasted.Load() == fasted {
			t.Fatalf("the hot key's origin total is %d, want 1 while a slow flush is held", got)
		}
		close(gate)
		time.Sleep(time.Second)
		synctest.Wait()
		for i := range keys {
			if got := o.total(Key{"zone", "k" + strconv.Itoa(i), time.Hour}, seq); got != 2 {
				t.Fatalf("key %d: origin total %d, want 2", i, got)
			}
		}
		if o.mu.Lock(); o.most != 1 || o.slowed.Load() < keys/replayBatch {
			t.Fatalf("at most %d slow flushes in flight over %d, want 1 over %d or more", o.most, o.slowed.Load(), keys/replayBatch)
		}
		o.mu.Unlock()
	})
}

// TestReplay_SlowOverrunsCountTicksThatFindAFlushRunning: a slow tick that
// comes while the slow tier still flushes an earlier tick's keys (one batch
// at a time, so a slow origin or a flood of keys can make it fall behind)
// counts one overrun; ticks that find it idle count none.
func TestReplay_SlowOverrunsCountTicksThatFindAFlushRunning(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, _ := newTestEngine(t, Config{})
		o := &tierOrigin{memOrigin: newMemOrigin()}
		e.SetOrigin(o)
		decideAll := func() {
			for i := range 2 * replayBatch {
				if !e.Decide(bg, lim("k"+strconv.Itoa(i), time.Hour, 1_000_000, 1)).Allowed {
					t.Fatal("denied far below the limit")
				}
			}
		}
		decideAll()
		time.Sleep(time.Second) // first replays (fast), then slow ticks with nothing to do
		synctest.Wait()
		decideAll()
		time.Sleep(time.Second) // ten slow ticks, the first of which flushes the keys at once
		synctest.Wait()
		if got := e.Stats().SlowOverruns; got != 0 {
			t.Fatalf("%d overruns while every flush returned at once, want 0", got)
		}
		gate := make(chan struct{})
		o.mu.Lock()
		o.slowGate = gate
		o.mu.Unlock()
		decideAll()
		time.Sleep(DefaultSlowTick + time.Millisecond) // a tick starts the held flush
		synctest.Wait()
		time.Sleep(3 * DefaultSlowTick)
		synctest.Wait()
		if got := e.Stats().SlowOverruns; got != 3 {
			t.Fatalf("%d overruns over three slow ticks that found a flush held, want 3", got)
		}
		close(gate)
		time.Sleep(time.Second)
		synctest.Wait()
		if got := e.Stats().SlowOverruns; got != 3 {
			t.Fatalf("%d overruns once the flush returned, want still 3", got)
		}
		if got := e.Stats().PendingCells; got != 0 {
			t.Fatalf("%d cells still pending after the held flush returned, want 0", got)
		}
	})
}

// TestReplay_AFastMarkAsTheSlowReplayTakesTheCellLeavesItInNoQueue: a
// cell marked for the fast queue, full, while the slow replay took it
// from the slow queue kept the dirty bit that take had just cleared,
// judged by the state read before: it sat in no queue, its write failed
// back into pending, and nothing queued it again (the janitor skips a
// cell marked queued), so its units never reached the origin; let go, it
// was skipped by the graves too, neither written nor counted as lost
// (TestEvict_EveryUnitIsSentOrCountedAsLost, a run in ten under load).
func TestReplay_AFastMarkAsTheSlowReplayTakesTheCellLeavesItInNoQueue(t *testing.T) {
	e, clk, o := oneCellQueuesEngine(t)
	k := lim("k", time.Hour, 10, 1)
	e.Decide(bg, k) // a cell's first units go to the fast queue
	if _, err := e.ReplayOnce(bg, Fast); err != nil {
		t.Fatal(err)
	}
	e.Decide(bg, k)                          // 2 of 10: the slow queue
	e.Decide(bg, lim("f", time.Hour, 10, 1)) // fills the fast queue
	en := entryOf(t, e, k.Key)
	c := en.cur.Load()
	var batch []Delta
	beforeFastMark = func() {
		beforeFastMark = nil
		batch = e.drain(Slow, 1, nil) // the slow replay takes the cell
	}
	t.Cleanup(func() { beforeFastMark = nil })
	c.links().pending.Add(1) // a third unit, as a commit near the limit adds it
	e.markDirty(e.Zone("zone", time.Hour), en, c, true)
	if len(batch) != 1 || batch[0].cell != c {
		t.Fatalf("the slow replay took %d cells, want the key's", len(batch))
	}
	o.down.Store(true)
	if err := e.flush(bg, o, batch); err == nil {
		t.Fatal("a write to an origin that is down succeeded")
	}
	o.down.Store(false)
	e.Sweep() // the janitor queues what the queues refused
	if _, err := replayBoth(e); err != nil {
		t.Fatal(err)
	}
	if _, err := replayBoth(e); err != nil {
		t.Fatal(err)
	}
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	if got := o.total(k.Key, seq); got != 3 {
		t.Fatalf("the origin holds %d of the key's 3 units; the cell is dirty %v with %d pending", got, c.state()&stDirty != 0, c.pending())
	}
}
