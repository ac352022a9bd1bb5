package engine

import (
	"strconv"
	"testing"
	"testing/synctest"
	"time"
)

// TestEvict_AKeyLetGoWhileItsWriteFailsKeepsItsUnits: a key evicted while
// the origin is down holds units its eviction could not write; they wait
// in the replay queue. Its next entry started from nothing while the
// origin stayed down, and from the origin's count when it came back
// before the replay's next tick: either way it admitted those units
// again (14 for a limit of 10). It takes the key's cells back now, and
// the units reach the origin once, with the replay.
func TestEvict_AKeyLetGoWhileItsWriteFailsKeepsItsUnits(t *testing.T) {
	for _, c := range []struct {
		name string
		// up runs between the eviction and the key's next decisions,
		// upAfter after them: what brings the origin back.
		up, upAfter func(e *Engine, o *memOrigin)
	}{
		{"while the origin is still down", nil, func(e *Engine, o *memOrigin) { o.down.Store(false) }},
		{"once it is back, before the replay's tick", func(e *Engine, o *memOrigin) { o.down.Store(false) }, nil},
		{"once the replay wrote them", func(e *Engine, o *memOrigin) {
			o.down.Store(false)
			if _, err := replayBoth(e); err != nil {
				t.Fatal(err)
			}
		}, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			e, clk, o := withOrigin(t, Config{MaxEntries: 1})
			l := lim("k", time.Minute, 10, 1)
			seq := clk.UnixMilli() / time.Minute.Milliseconds()
			admitted := admittedOf(e, l, 4)
			heavier := admittedOf(e, lim("heavier", time.Minute, 100, 1), 5) // k is the lighter: evicted
			o.down.Store(true)
			if n := e.Evict(); n == 0 {
				t.Fatal("nothing evicted over a cap of 1")
			}
			if _, ok := e.Zone(l.Namespace, l.Window).entries.Load(l.Identifier); ok {
				t.Fatal("k was not evicted")
			}
			if c.up != nil {
				c.up(e, o)
			}
			admitted += admittedOf(e, l, 30)
			if c.upAfter != nil {
				c.upAfter(e, o)
			}
			if admitted != 10 {
				t.Errorf("k admitted %d around its eviction, limit 10", admitted)
			}
			if _, err := replayBoth(e); err != nil {
				t.Fatal(err)
			}
			if got := o.total(l.Key, seq); got != int64(admitted) {
				t.Errorf("the origin holds %d units of k, %d admitted", got, admitted)
			}
			if got := o.total(lim("heavier", time.Minute, 100, 1).Key, seq); got != int64(heavier) {
				t.Errorf("the origin holds %d units of the heavier key, %d admitted", got, heavier)
			}
			if lost := e.Stats().LostUnits; lost != 0 {
				t.Errorf("%d units counted as lost", lost)
			}
			if e.Sweep(); e.orphans.n.Load() != 0 {
				t.Errorf("%d orphans left once the origin holds every unit", e.orphans.n.Load())
			}
		})
	}
}

// TestEvict_AKeyLetGoDuringAnOutageKeepsItsUnitsThroughARestart: the
// origin comes back restarted empty. The key's next entry takes its cells
// back, reads an empty origin, which raises nothing, and admits only what
// its limit has left; the resend and the replay then give the origin
// every unit admitted, once.
func TestEvict_AKeyLetGoDuringAnOutageKeepsItsUnitsThroughARestart(t *testing.T) {
	e, clk, o := withOrigin(t, Config{MaxEntries: 1})
	l := lim("k", time.Minute, 10, 1)
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	admitted := admittedOf(e, l, 4)
	if _, err := replayBoth(e); err != nil {
		t.Fatal(err)
	}
	decideN(e, lim("heavier", time.Minute, 100, 1), 5)
	admitted += admittedOf(e, l, 2) // unwritten when the origin goes down
	o.down.Store(true)
	if n := e.Evict(); n == 0 {
		t.Fatal("nothing evicted over a cap of 1")
	}
	o.restart()
	o.down.Store(false)
	if admitted += admittedOf(e, l, 30); admitted != 10 {
		t.Errorf("k admitted %d around its eviction and a restart of the origin, limit 10", admitted)
	}
	e.Resend()
	if _, err := replayBoth(e); err != nil {
		t.Fatal(err)
	}
	if got := o.total(l.Key, seq); got != int64(admitted) {
		t.Errorf("the origin holds %d units of k after the resend, %d admitted", got, admitted)
	}
}

// TestEvict_AKeyMetDuringItsEvictionsFailingWriteKeepsItsUnits: the key's
// requests come while its eviction's write is on its way (a partition
// holds it until its timeout), and the write then fails. The entry they
// made takes the cells back then, not once the write has ended: made
// from nothing, its read waited for the write and found an origin
// without the units (14 admitted for a limit of 10).
func TestEvict_AKeyMetDuringItsEvictionsFailingWriteKeepsItsUnits(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, _, o := withOrigin(t, Config{MaxEntries: 1})
		l := lim("k", time.Minute, 10, 1)
		admitted := admittedOf(e, l, 4)
		decideN(e, lim("heavier", time.Minute, 100, 1), 5) // k is the lighter: evicted
		gate := make(chan struct{})
		o.flushGate.Store(&gate)
		o.failFlushes(errOriginDown)
		evicted := make(chan int)
		go func() { evicted <- e.Evict() }()
		synctest.Wait() // its write waits at the gate
		o.flushGate.Store(nil)
		if _, ok := e.Zone(l.Namespace, l.Window).entries.Load(l.Identifier); ok {
			close(gate)
			t.Fatal("k was not evicted")
		}
		after := make(chan int)
		go func() { after <- admittedOf(e, l, 30) }()
		synctest.Wait()
		close(gate) // the write fails now
		<-evicted
		if s := e.Stats(); s.FlushErrors == 0 {
			t.Fatal("the eviction's write did not fail")
		}
		o.failFlushes(nil)
		if admitted += <-after; admitted != 10 {
			t.Fatalf("k admitted %d around an eviction whose write failed, limit 10", admitted)
		}
	})
}

// TestEvict_AKeyLetGoInTheWindowBeforeWeighsItsUnits: the cells a key let
// go at the end of a window are taken back by its entry of the next, as
// its previous cell: the sliding window still weighs them (9 units at 10 %
// into the next window weigh 8, and leave 2 of a limit of 10).
func TestEvict_AKeyLetGoInTheWindowBeforeWeighsItsUnits(t *testing.T) {
	e, clk, o := withOrigin(t, Config{MaxEntries: 1})
	l := lim("k", time.Minute, 10, 1)
	clk.Advance(59 * time.Second)
	decideN(e, l, 9)
	decideN(e, lim("heavier", time.Minute, 100, 1), 10)
	o.down.Store(true)
	if n := e.Evict(); n == 0 {
		t.Fatal("nothing evicted over a cap of 1")
	}
	clk.Advance(7 * time.Second) // 10 % into the next window
	if n := admittedOf(e, l, 10); n != 2 {
		t.Errorf("k admitted %d in the window after its eviction, want 2 (9 units before weigh 8)", n)
	}
}

// TestForget_AFailedWriteLeavesTheUnitsToTheKeysNextEntry: a forget whose
// write fails leaves the key's units queued, as an eviction's; its next
// entry takes them back.
func TestForget_AFailedWriteLeavesTheUnitsToTheKeysNextEntry(t *testing.T) {
	e, _, o := withOrigin(t, Config{})
	l := lim("k", time.Minute, 10, 1)
	admitted := admittedOf(e, l, 4)
	o.down.Store(true)
	if !e.Forget(l.Key) {
		t.Fatal("nothing forgotten")
	}
	if admitted += admittedOf(e, l, 30); admitted != 10 {
		t.Errorf("k admitted %d around a forget whose write failed, limit 10", admitted)
	}
}

// TestDropMatching_AResetTakesOffTheUnitsOfCellsLetGo: a key evicted with
// units its write could not take, then reset: its next entry takes no
// cell back, and the key has its whole limit again.
func TestDropMatching_AResetTakesOffTheUnitsOfCellsLetGo(t *testing.T) {
	e, clk, o := withOrigin(t, Config{MaxEntries: 1})
	l := lim("k", time.Minute, 10, 1)
	decideN(e, l, 4)
	decideN(e, lim("heavier", time.Minute, 100, 1), 5)
	o.down.Store(true)
	if n := e.Evict(); n == 0 {
		t.Fatal("nothing evicted over a cap of 1")
	}
	e.DropMatching(l.Namespace, l.Window, func(id string) bool { return id == "k" }, clk.UnixMilli())
	if n := admittedOf(e, l, 30); n != 10 {
		t.Errorf("k admitted %d after a reset, want its whole limit of 10", n)
	}
}

// TestOrphans_TheOldestGoPastTheBound: past orphanCells keys, the oldest
// is forgotten, and a key put again keeps its newest cells.
func TestOrphans_TheOldestGoPastTheBound(t *testing.T) {
	var o orphans
	held := func() [2]*cell {
		c := newCell(1, true)
		c.links().pending.Store(1)
		return [2]*cell{c, nil}
	}
	key := func(i int) Key { return Key{Namespace: "zone", Identifier: strconv.Itoa(i), Window: time.Minute} }
	again := held()
	for i := range orphanCells + 1 {
		o.put(key(i), held())
		if i == 1 {
			o.put(key(1), again)
		}
	}
	if n := o.n.Load(); n != orphanCells {
		t.Fatalf("%d orphans, want the bound %d", n, orphanCells)
	}
	if o.find(key(0))[0] != nil {
		t.Error("the oldest key is still there past the bound")
	}
	if o.find(key(1)) != again {
		t.Error("a key put again does not hold its newest cells")
	}
	if o.find(key(orphanCells))[0] == nil {
		t.Error("the newest key is missing")
	}
	o.put(key(-1), [2]*cell{newCell(1, true), nil})
	if o.find(key(-1))[0] != nil {
		t.Error("cells holding nothing unwritten were kept")
	}
}

// TestOrphans_PastTheBoundALighterKeyPushesOutNoHeavierOne: a busy key
// evicted during an outage with 8 units unwritten, then a flood of
// one-off keys evicted after it, past the bound. The oldest went first
// whatever it held: the busy key's cells were forgotten, and its next
// entry, with the origin still down, admitted its 8 units again. A
// lighter key now pushes out no heavier one; as heavy a one does.
func TestOrphans_PastTheBoundALighterKeyPushesOutNoHeavierOne(t *testing.T) {
	var o orphans
	holding := func(n int64) [2]*cell {
		c := newCell(1, true)
		c.links().pending.Store(n)
		return [2]*cell{c, nil}
	}
	key := func(i int) Key { return Key{Namespace: "zone", Identifier: strconv.Itoa(i), Window: time.Minute} }
	busy := holding(8)
	o.put(key(-1), busy)
	for i := range orphanCells {
		o.put(key(i), holding(1))
	}
	if n := o.n.Load(); n != orphanCells {
		t.Fatalf("%d orphans, want the bound %d", n, orphanCells)
	}
	if o.find(key(-1)) != busy {
		t.Error("the busy key's cells were pushed out by lighter keys")
	}
	if o.find(key(orphanCells - 1))[0] != nil {
		t.Error("a key lighter than the oldest was kept past the bound")
	}
	if o.find(key(0))[0] == nil {
		t.Error("the second oldest is gone, with the oldest kept")
	}
	heavier := holding(9)
	o.put(key(-2), heavier)
	if o.find(key(-2)) != heavier || o.find(key(-1))[0] != nil {
		t.Error("a heavier key did not take the oldest's place")
	}
}

// TestEvict_AWriteThatLandsKeepsNoCells: with the origin up, an eviction's
// write takes every unit, and no cell stays kept: new keys then look no
// further than one atomic load (orphans.n).
func TestEvict_AWriteThatLandsKeepsNoCells(t *testing.T) {
	e, _, _ := withOrigin(t, Config{MaxEntries: 1})
	l := lim("k", time.Minute, 10, 1)
	decideN(e, l, 4)
	decideN(e, lim("heavier", time.Minute, 100, 1), 5)
	if n := e.Evict(); n == 0 {
		t.Fatal("nothing evicted over a cap of 1")
	}
	if n := e.orphans.n.Load(); n != 0 {
		t.Errorf("%d keys' cells kept after their eviction's write landed", n)
	}
	f := lim("f", time.Minute, 10, 1)
	decideN(e, f, 3)
	if !e.Forget(f.Key) {
		t.Fatal("nothing forgotten")
	}
	if n := e.orphans.n.Load(); n != 0 {
		t.Errorf("%d keys' cells kept after a forget's write landed", n)
	}
}
