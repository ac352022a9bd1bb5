package engine

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

func TestJanitor_DropsEntriesTwoWindowsAfterTheirLastRequest(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	for i := 0; i < 100; i++ {
		e.Decide(bg, lim("id-"+strconv.Itoa(i), time.Minute, 10, 1))
	}
	clk.Advance(time.Minute) // the cells still weigh as previous ones
	if n := e.Sweep(); n != 0 {
		t.Fatalf("dropped %d entries whose cells still weigh", n)
	}
	clk.Advance(time.Minute)
	if n := e.Sweep(); n != 100 {
		t.Fatalf("dropped %d entries two windows later, want 100", n)
	}
	if s := e.Stats(); s.Entries != 0 {
		t.Fatalf("live entries = %d after the sweep", s.Entries)
	}
	// A dropped key starts afresh.
	if d := e.Decide(bg, lim("id-1", time.Minute, 10, 1)); d.Remaining != 9 {
		t.Fatalf("remaining = %d for a dropped key, want 9", d.Remaining)
	}
}

func TestJanitor_DropsExpiredStrictDeadlines(t *testing.T) {
	e, clk, _ := withOrigin(t, Config{})
	l := lim("k", time.Minute, 1, 1)
	e.Decide(bg, l)
	e.Decide(bg, l)
	if len(e.StrictKeys()) != 1 {
		t.Fatal("a denial did not put the key in strict mode")
	}
	clk.Advance(time.Minute)
	e.Sweep()
	if s := e.Stats(); s.StrictKeys != 0 {
		t.Fatalf("strict keys = %d after the deadline", s.StrictKeys)
	}
}

func TestEvict_FloodOfNewIdentifiersCannotEvictHotKeys(t *testing.T) {
	e, _ := newTestEngine(t, manual(Config{MaxEntries: 1000}))
	hot := make([]Limit, 50)
	for i := range hot {
		hot[i] = lim("hot-"+strconv.Itoa(i), time.Hour, 1000, 1)
		for j := 0; j < 20; j++ {
			e.Decide(bg, hot[i])
		}
	}
	for i := 0; i < 5000; i++ {
		e.Decide(bg, lim("flood-"+strconv.Itoa(i), time.Hour, 1000, 1))
		if i%500 == 0 {
			e.Evict()
		}
	}
	e.Evict()
	s := e.Stats()
	if s.Entries > 1000 {
		t.Fatalf("live entries = %d over the cap of 1000", s.Entries)
	}
	if s.Evictions < 4000 {
		t.Fatalf("evictions = %d, want the flood evicted", s.Evictions)
	}
	for _, l := range hot {
		ks, ok := e.Inspect(l.Key)
		if !ok || ks.Cells[0].Regional != 20 {
			t.Fatalf("hot key %s lost its count: %+v %v", l.Identifier, ks, ok)
		}
	}
}

// TestEvict_AKeyBusyInThePreviousWindowOutlivesAFlood: a key that took its
// whole limit in the last second of a window still weighs nearly all of
// it a second into the next, but eviction ranked keys by the window they
// were last touched in first: a flood of one-request identifiers right
// after the border evicted it, and it was admitted its whole limit again
// (before the fix: 100 more for a limit of 100, 200 in two seconds).
func TestEvict_AKeyBusyInThePreviousWindowOutlivesAFlood(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{MaxEntries: 1000}))
	start := clk.Now().Truncate(time.Minute)
	clk.Set(start.Add(59 * time.Second))
	busy := lim("busy", time.Minute, 100, 1)
	for range 100 {
		if !e.Decide(bg, busy).Allowed {
			t.Fatal("denied within the limit")
		}
	}
	clk.Set(start.Add(61 * time.Second)) // a second into the next window
	for i := range 1500 {
		e.Decide(bg, lim("flood-"+strconv.Itoa(i), time.Minute, 100, 1))
	}
	e.Evict()
	admitted := 0
	for range 100 {
		if e.Decide(bg, busy).Allowed {
			admitted++
		}
	}
	// ⌊100 × 59/60⌋ = 98 of the previous window still weigh: 2 pass.
	if admitted != 2 {
		t.Fatalf("the busy key admitted %d more after the flood, want 2", admitted)
	}
}

func TestEvict_InsertSignalsTheJanitor(t *testing.T) {
	var evicted sync.WaitGroup
	evicted.Add(1)
	var once sync.Once
	e, _ := newTestEngine(t, Config{MaxEntries: 10, OnEvict: func(int) { once.Do(evicted.Done) }})
	for i := 0; i < 11; i++ {
		e.Decide(bg, lim("id-"+strconv.Itoa(i), time.Hour, 10, 1))
	}
	evicted.Wait() // the janitor goroutine evicted without a tick
	if n := e.Stats().Entries; n > 10 {
		t.Fatalf("live entries = %d after eviction", n)
	}
}

func TestSweep_KeepsAnEntryWhoseUnitsNoQueueTook(t *testing.T) {
	e, clk, o := oneCellQueuesEngine(t)
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	for _, id := range []string{"a", "b", "c", "d"} {
		e.Decide(bg, lim(id, time.Minute, 100, 1))
	}
	// Two windows later every entry is idle, and both queues (one slot
	// each) are full: the sweep must not forget the units of the rest.
	clk.Advance(2 * time.Minute)
	e.Sweep()
	for i := 0; i < 4; i++ {
		for _, tier := range []Tier{Fast, Slow} {
			if _, err := e.ReplayOnce(bg, tier); err != nil {
				t.Fatal(err)
			}
		}
		e.Sweep()
	}
	for _, id := range []string{"a", "b", "c", "d"} {
		if got := o.total(Key{"zone", id, time.Minute}, seq); got != 1 {
			t.Fatalf("origin total of %s = %d, want 1", id, got)
		}
	}
	if n := e.Stats().Entries; n != 0 {
		t.Fatalf("%d entries left after their units reached the origin", n)
	}
}

// TestEvict_UnitsOfAnEvictedKeyAreReadBack: a key evicted while it holds
// units not replayed yet, its requests coming back while the eviction's
// write is on its way (held at a gate). The key's next entry reads the
// origin, which must hold them first: queued for the replay instead, they
// reached it after that read and were admitted again (2 before the
// eviction, then 5 more of a limit of 5: 7 admitted).
func TestEvict_UnitsOfAnEvictedKeyAreReadBack(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, _, o := withOrigin(t, Config{MaxEntries: 1})
		l := lim("k", time.Hour, 5, 1)
		decideN(e, l, 2)
		decideN(e, lim("heavier", time.Hour, 10, 1), 5) // k is the lighter: evicted
		gate := make(chan struct{})
		o.flushGate.Store(&gate)
		evicted := make(chan int)
		go func() { evicted <- e.Evict() }()
		synctest.Wait() // its write, if any, waits at the gate
		o.flushGate.Store(nil)
		if _, ok := e.Zone(l.Namespace, l.Window).entries.Load(l.Identifier); ok {
			close(gate)
			t.Fatal("k was not evicted")
		}
		after := make(chan int)
		go func() { after <- admittedOf(e, l, 5) }()
		synctest.Wait()
		close(gate)
		<-evicted
		if admitted := 2 + <-after; admitted != 5 {
			t.Fatalf("admitted %d for a limit of 5 around an eviction", admitted)
		}
	})
}

// TestEvict_TheCapHoldsWhileTheOriginIsDown: a flood of new identifiers
// while the origin is down. Every key holds a unit no write took, and once
// the replay queues were full eviction kept every key whose units no queue
// could take: the cap stopped holding, and memory grew with the flood
// (1,000 keys over a cap of 100, with queues of 4 cells, before the fix;
// 41,335 over a cap of 1,000 with the real queues). A key at its limit
// stays denied throughout, and its units reach the origin when it is back.
func TestEvict_TheCapHoldsWhileTheOriginIsDown(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{MaxEntries: 100}))
	e.queueLen = 4
	o := newMemOrigin()
	e.SetOrigin(o)
	o.down.Store(true)
	hot := lim("hot", time.Minute, 10, 1)
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	if n := admittedOf(e, hot, 20); n != 10 {
		t.Fatalf("the hot key admitted %d of 20, want 10", n)
	}
	for i := range 1000 {
		e.Decide(bg, lim("flood-"+strconv.Itoa(i), time.Minute, 1000, 1))
		if i%50 == 49 {
			_, _ = replayBoth(e) // fails: the units go back to their cells
			e.Evict()
			if n := e.Stats().Entries; n > 100 {
				t.Fatalf("%d live entries after an eviction, over the cap of 100", n)
			}
			if e.Decide(bg, hot).Allowed {
				t.Fatalf("the hot key at its limit was admitted after %d flood keys", i+1)
			}
			clk.Advance(100 * time.Millisecond)
		}
	}
	if n := len(e.graves.list()); n > graveCells {
		t.Fatalf("%d cells remembered, over %d", n, graveCells)
	}
	o.down.Store(false)
	for range 3 {
		e.Sweep()
		if _, err := replayBoth(e); err != nil {
			t.Fatal(err)
		}
	}
	if got := o.total(hot.Key, seq); got != 10 {
		t.Fatalf("the origin holds %d of the hot key's 10 units", got)
	}
}

// TestEvict_ASlowOriginDoesNotHoldTheCapOff: a flood of new identifiers,
// 8,000 a second for 15 s over a cap of 2,000, while every write to the
// origin takes half a second. The eviction wrote its keys' units 256 a
// round trip, one after another (and waited for the replay's writes of
// its cells one by one), and the janitor evicted nothing more meanwhile:
// each pass evicted more keys than the last and took longer, and the
// flood grew memory far past the cap (passes 28 s apart, 65,000 live
// entries, before the fix; 930 ms and 9,240 after). Now a pass writes
// for at most evictBudget, several larger batches at a time, and the live
// entries stay within the cap plus what the flood brings in a pass.
func TestEvict_ASlowOriginDoesNotHoldTheCapOff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const maxEntries, perTick, tick, keys = 2_000, 80, 10 * time.Millisecond, 120_000
		longest := time.Duration(0)
		var last time.Time
		passes := 0
		onEvict := func(int) { // on the janitor's goroutine, whose passes it times
			if !last.IsZero() {
				longest = max(longest, time.Since(last))
			}
			last = time.Now()
			passes++
		}
		e := New(Config{MaxEntries: maxEntries, Now: time.Now, OnEvict: onEvict})
		o := newMemOrigin()
		o.flushDelay.Store(int64(500 * time.Millisecond))
		e.SetOrigin(o)
		most := int64(0)
		for i := range keys {
			e.Decide(bg, lim("flood-"+strconv.Itoa(i), time.Hour, 10, 1))
			if i%perTick == perTick-1 {
				most = max(most, e.live.Load())
				time.Sleep(tick)
			}
		}
		ctx, cancel := context.WithTimeout(bg, time.Second)
		defer cancel()
		_ = e.Close(ctx)
		// A pass lasts at most evictBudget and a write's bound; in one,
		// the flood brings perTick keys a tick.
		pass := evictBudget + flushTimeout
		bound := int64(maxEntries) + int64(pass/tick+1)*perTick
		t.Logf("%d passes, %v apart at most; at most %d live entries, bound %d", passes, longest, most, bound)
		if most > bound {
			t.Fatalf("%d live entries during the flood, over the cap of %d plus a pass's flood (%d)", most, maxEntries, bound)
		}
		if longest > pass+tick {
			t.Fatalf("eviction passes %v apart, over %v", longest, pass)
		}
	})
}

// TestEvict_ManyKeysAtOnceKeepTheirUnits: more keys evicted at once than
// the replay queues and the graveyard hold, each with a unit the origin
// has not received. Evict buried every key's cells before writing any,
// and past the graveyard's bound a burial gave up the units of an earlier
// one, whose write had not begun: with a working origin, 5,808 of 10,000
// units were counted as lost and never written (64,842 of 101,000 with
// the real queues).
func TestEvict_ManyKeysAtOnceKeepTheirUnits(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{MaxEntries: 100}))
	e.queueLen = 4
	o := newMemOrigin()
	e.SetOrigin(o)
	const keys = 10_000
	for i := range keys {
		e.Decide(bg, lim("k-"+strconv.Itoa(i), time.Hour, 10, 1))
	}
	n := e.Evict()
	if n < keys-100 {
		t.Fatalf("evicted %d of %d keys over a cap of 100", n, keys)
	}
	if lost := e.Stats().LostUnits; lost != 0 {
		t.Fatalf("%d units lost by an eviction while the origin answered", lost)
	}
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	written := 0
	for i := range keys {
		if _, live := e.Zone("zone", time.Hour).entries.Load("k-" + strconv.Itoa(i)); live {
			continue
		}
		if o.total(Key{"zone", "k-" + strconv.Itoa(i), time.Hour}, seq) == 1 {
			written++
		}
	}
	if written != n {
		t.Fatalf("the origin holds the unit of %d of the %d keys evicted", written, n)
	}
}

// TestEvict_TheBudgetCountsTheKeysItDefers: an eviction of more keys than
// a slow origin writes within the pass's budget leaves the rest to the
// replay, and counts them (EvictionsDeferred), so an operator sees the
// cap's writes falling behind; every key is written in the end, and a
// pass whose writes all started counts none.
func TestEvict_TheBudgetCountsTheKeysItDefers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const cap, keys = 100, 20_000
		e := New(Config{MaxEntries: cap, Now: time.Now})
		defer e.Close(bg)
		o := newMemOrigin()
		o.flushDelay.Store(int64(600 * time.Millisecond))
		e.SetOrigin(o)
		for i := range keys {
			e.Decide(bg, lim("k-"+strconv.Itoa(i), time.Hour, 10, 1))
		}
		e.Evict()
		synctest.Wait()
		// A pass starts evictWrites writes at once, and more as each
		// returns (0.6 s), none past the 1 s budget: it starts at most
		// 8,192 keys' writes, so a pass over 20,000 (or the flood's own
		// passes over fewer) leaves keys to the replay.
		st := e.Stats()
		if st.EvictionsDeferred == 0 || st.EvictionsDeferred > st.Evictions-evictWrites*evictBatch {
			t.Fatalf("%d of %d evicted keys counted as deferred; the first %d writes start at once", st.EvictionsDeferred, st.Evictions, evictWrites)
		}
		o.flushDelay.Store(0)
		before := st.EvictionsDeferred
		for i := range keys {
			e.Decide(bg, lim("again-"+strconv.Itoa(i), time.Hour, 10, 1))
		}
		e.Evict()
		synctest.Wait()
		if d := e.Stats().EvictionsDeferred; d != before {
			t.Fatalf("evictions whose writes all started counted %d keys as deferred", d-before)
		}
		if err := e.Close(bg); err != nil {
			t.Fatal(err)
		}
		seq := time.Now().UnixMilli() / time.Hour.Milliseconds()
		for i := range keys {
			if got := o.total(Key{"zone", "k-" + strconv.Itoa(i), time.Hour}, seq); got != 1 {
				t.Fatalf("key %d: the origin holds %d units of 1 after the deferred writes; %+v", i, got, e.Stats())
			}
		}
	})
}

// evictedIntoTheGraves evicts keys keys while the origin is down and
// the replay queues hold 4 cells: the eviction's write fails, the queues
// cannot take the units back, and only the graves hold them. It returns
// the engine, the origin (up again) and the window's sequence.
func evictedIntoTheGraves(t *testing.T, keys int) (*Engine, *memOrigin, int64) {
	t.Helper()
	e, clk := newTestEngine(t, manual(Config{MaxEntries: 100}))
	e.queueLen = 4
	o := newMemOrigin()
	e.SetOrigin(o)
	for i := range keys {
		e.Decide(bg, lim("k-"+strconv.Itoa(i), time.Hour, 10, 1))
	}
	o.down.Store(true)
	if n := e.Evict(); n < keys-100 {
		t.Fatalf("evicted %d of %d keys over a cap of 100", n, keys)
	}
	o.down.Store(false)
	if len(e.unqueuedGraves()) == 0 {
		t.Fatal("no grave holds units outside the queues: the test sets nothing up")
	}
	return e, o, clk.UnixMilli() / time.Hour.Milliseconds()
}

// originHoldsEveryKey fails the test unless the origin holds each key's
// unit.
func originHoldsEveryKey(t *testing.T, o *memOrigin, keys int, seq int64) {
	t.Helper()
	missing := 0
	for i := range keys {
		if o.total(Key{"zone", "k-" + strconv.Itoa(i), time.Hour}, seq) != 1 {
			missing++
		}
	}
	if missing > 0 {
		t.Fatalf("the origin lacks the unit of %d of %d keys", missing, keys)
	}
}

// TestEvict_UnitsOnlyTheGravesHoldAreReplayed: keys evicted while the
// origin failed and the replay queues were full keep their units in the
// graves alone. The janitor requeued the live entries' units, never the
// graves': they waited for another origin (a reload), and were never
// sent to this one once it answered again.
func TestEvict_UnitsOnlyTheGravesHoldAreReplayed(t *testing.T) {
	const keys = 1000
	e, o, seq := evictedIntoTheGraves(t, keys)
	for range 2 * keys { // the queues take 4 cells a sweep
		e.Sweep()
		n, err := e.ReplayOnce(bg, Slow)
		m, err2 := e.ReplayOnce(bg, Fast)
		if err != nil || err2 != nil {
			t.Fatal(err, err2)
		}
		if n+m == 0 {
			break
		}
	}
	originHoldsEveryKey(t, o, keys, seq)
}

// TestEvict_CloseSendsUnitsOnlyTheGravesHold: the last flush of a
// shutdown sent the queues' and the live entries' units, not those only
// the graves held; and a reload without an origin gave them up without
// counting them as lost.
func TestEvict_CloseSendsUnitsOnlyTheGravesHold(t *testing.T) {
	const keys = 1000
	e, o, seq := evictedIntoTheGraves(t, keys)
	if err := e.Close(bg); err != nil {
		t.Fatal(err)
	}
	originHoldsEveryKey(t, o, keys, seq)

	e, _, _ = evictedIntoTheGraves(t, keys)
	want := int64(0)
	for _, d := range e.unqueuedGraves() {
		want += d.cell.pending()
	}
	before := e.Stats().LostUnits
	e.DropUnsent()
	if lost := e.Stats().LostUnits - before; lost < want {
		t.Fatalf("dropping the unsent units counted %d as lost; the graves alone held %d", lost, want)
	}
}

// TestEvict_EveryUnitIsSentOrCountedAsLost: a flood of one-off keys past
// the cap while the origin fails, with replay queues too small for it,
// and then the origin back and a shutdown: every unit admitted reaches
// the origin or is counted as lost (Stats.LostUnits), none is dropped
// unseen.
func TestEvict_EveryUnitIsSentOrCountedAsLost(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const keys = 30_000
		e, o := smallQueuesEngine()
		defer e.Close(bg)
		for i := range keys {
			if i == keys/4 {
				o.down.Store(true)
			}
			if i == 3*keys/4 {
				o.down.Store(false)
			}
			e.Decide(bg, lim("k-"+strconv.Itoa(i), time.Hour, 10, 1))
			if i%100 == 99 {
				time.Sleep(10 * time.Millisecond)
			}
		}
		time.Sleep(time.Minute) // the janitor's sweeps and the replay's ticks
		if err := e.Close(bg); err != nil {
			t.Fatal(err)
		}
		seq := time.Now().UnixMilli() / time.Hour.Milliseconds()
		sent := int64(0)
		for i := range keys {
			sent += o.total(Key{"zone", "k-" + strconv.Itoa(i), time.Hour}, seq)
		}
		st := e.Stats()
		t.Logf("sent %d, lost %d, evictions %d, drops %d", sent, st.LostUnits, st.Evictions, st.ReplayDrops)
		if sent+st.LostUnits != keys {
			t.Fatalf("%d units sent and %d counted as lost, of %d admitted", sent, st.LostUnits, keys)
		}
	})
}

// TestEngine_EveryUnitIsSentOrCountedAsLostAcrossWindows is the same
// account with keys that come back and windows that roll over during the
// outage: rotated cells, evicted ones and live ones alike reach the
// origin or are counted as lost.
func TestEngine_EveryUnitIsSentOrCountedAsLostAcrossWindows(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const keys, requests = 3000, 40_000
		e, o := smallQueuesEngine()
		defer e.Close(bg)
		admitted := int64(0)
		for i := range requests {
			switch i {
			case requests / 4:
				o.down.Store(true)
			case 3 * requests / 4:
				o.down.Store(false)
			}
			if e.Decide(bg, lim("k-"+strconv.Itoa(i*7%keys), time.Second, 5, 1)).Allowed {
				admitted++
			}
			if i%100 == 99 {
				time.Sleep(20 * time.Millisecond)
			}
		}
		time.Sleep(time.Minute)
		if err := e.Close(bg); err != nil {
			t.Fatal(err)
		}
		o.mu.Lock()
		sent := int64(0)
		for _, v := range o.totals {
			sent += v
		}
		o.mu.Unlock()
		st := e.Stats()
		t.Logf("admitted %d, sent %d, lost %d, evictions %d, drops %d", admitted, sent, st.LostUnits, st.Evictions, st.ReplayDrops)
		if sent+st.LostUnits != admitted {
			t.Fatalf("%d units sent and %d counted as lost, of %d admitted", sent, st.LostUnits, admitted)
		}
	})
}

// smallQueuesEngine is an engine on the real clock (inside a bubble),
// capped at 1,000 keys, whose replay queues hold 64 cells, on an origin.
func smallQueuesEngine() (*Engine, *memOrigin) {
	e := New(Config{MaxEntries: 1000, Now: time.Now})
	e.queueLen = 64
	e.queues.Store(&replayQueues{slow: newQueue(e.queueLen), fast: newQueue(e.queueLen)})
	o := newMemOrigin()
	e.SetOrigin(o)
	return e, o
}

// TestSweep_AFailedWriteOfAPreviousCellItDroppedIsRemembered: the janitor
// dropped an idle entry while a write of its previous cell was in flight;
// the write failed, and the full queues refused the units it gave back.
// markDirty, which buries a cell its entry let go, took the cell for held:
// the dead entry still pointed at it as its previous cell. Neither a queue
// nor the graves nor an entry held it, and its unit was neither written
// nor counted as lost (TestEngine_EveryUnitIsSentOrCountedAsLostAcrossWindows,
// a run in twenty under load).
func TestSweep_AFailedWriteOfAPreviousCellItDroppedIsRemembered(t *testing.T) {
	e, clk, o := oneCellQueuesEngine(t)
	k := lim("k", time.Second, 10, 1)
	seq := clk.UnixMilli() / 1000
	e.Decide(bg, k)
	batch := e.drain(Fast, 1, nil) // the write of the cell, in flight
	if len(batch) != 1 {
		t.Fatalf("took %d cells, want the key's", len(batch))
	}
	clk.Advance(time.Second)
	e.Decide(bg, k) // the cell is the previous one now
	if _, err := e.ReplayOnce(bg, Fast); err != nil {
		t.Fatal(err)
	}
	e.Decide(bg, lim("f1", time.Hour, 10, 1)) // both queues full
	e.Decide(bg, lim("f2", time.Hour, 10, 1))
	clk.Advance(2 * time.Second)
	e.Sweep()
	if _, ok := e.Zone("zone", time.Second).entries.Load("k"); ok {
		t.Fatal("the idle entry was not dropped")
	}
	o.down.Store(true)
	if err := e.flush(bg, o, batch); err == nil {
		t.Fatal("a write to an origin that is down succeeded")
	}
	o.down.Store(false)
	if err := e.Close(bg); err != nil {
		t.Fatal(err)
	}
	if sent, lost := o.total(k.Key, seq), e.Stats().LostUnits; sent+lost != 1 {
		t.Fatalf("of the cell's unit, %d reached the origin and %d were counted as lost", sent, lost)
	}
}
